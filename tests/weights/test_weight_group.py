"""The NCCL weight path's control flow on CPU: the same long-lived group, rendezvous and rejoin code over gloo.

Receivers run in their own processes (as vLLM workers do): consecutive updates over one communicator, a receiver
restarted between updates rejoining, FP8 and expert tensors, a receiver that never arrives failing the update
within the timeout and naming it; the vLLM worker extension's NCCL load path against a stand-in model runner.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_weight_transport import _FakeRunner

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.hf import hf_state_dict
from arbor.run_dir import broadcast_dir
from arbor.weights.comm import ReceiverGroup, WeightTransferError, receive_buckets
from arbor.weights.transport import NCCLTransport, WeightTransferTimeout, read_nccl_layout, wait_stable

CPU = torch.device("cpu")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(name: str, seed: int):
    model = build_model(ModelConfig(name=name))
    model.init_weights(seed, std=0.3)
    return model


def _as_bytes(tensors) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        k: (str(t.dtype), list(t.shape), t.cpu().contiguous().view(torch.uint8).numpy().tobytes()) for k, t in tensors
    }


def _receive(
    out: str,
    port: int,
    rank: int,
    world: int,
    versions: list[int],
    timeout: float,
    q,
    backend: str = "gloo",
    ready=None,
) -> None:
    """A receiver process: takes part in `versions` in order and reports what it got (or its error). With
    NCCL, receiver r uses GPU r (the trainer GPU 0)."""
    device = torch.device("cuda", rank) if backend == "nccl" else CPU
    if backend == "nccl":
        torch.cuda.set_device(device)
    group = ReceiverGroup("127.0.0.1", port, rank, world, backend, timeout, device)
    if ready is not None:  # started (torch imported): what is left to do before checking in takes milliseconds
        ready.set()
    for v in versions:
        try:
            version, buckets = read_nccl_layout(wait_stable(broadcast_dir(out, v), timeout))
            got = _as_bytes(receive_buckets(group.join(version), buckets, device))
            q.put((rank, v, group.generation, got))
        except WeightTransferError as e:
            q.put((rank, v, None, str(e)))
        except Exception as e:  # anything else fails the test at once instead of leaving it waiting on `q`
            q.put((rank, v, None, f"unexpected {type(e).__name__}: {e}"))
            raise


def _start(ctx, *args):
    p = ctx.Process(target=_receive, args=args, daemon=True)
    p.start()
    return p


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu(reason="NCCL over 3 GPUs"))])
def test_five_updates_two_receivers_one_restarted_over_one_long_lived_group(tmp_path, backend):
    if backend == "nccl":
        if torch.cuda.device_count() < 3:
            pytest.skip("needs three GPUs: the trainer and two receivers")
        torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    # One queue per receiver process: a process killed while its queue's feeder thread holds the queue's lock
    # would leave that lock held, and a shared queue would then block the replacement's reports for good.
    queues = {1: ctx.Queue(), 2: ctx.Queue()}
    port, timeout = _port(), 120.0
    transport = NCCLTransport("127.0.0.1", port, 2, keep=2, timeout=timeout, bucket_mb=0.02, backend=backend)
    steady = _start(ctx, str(tmp_path), port, 1, 3, [1, 2, 3, 4, 5], timeout, queues[1], backend)
    restarted = _start(ctx, str(tmp_path), port, 2, 3, [1, 2], timeout, queues[2], backend)
    generations: dict[int, dict[int, str]] = {}
    try:
        for v in range(1, 6):
            # dense updates, then an MoE model's split expert tensors, then FP8-quantised ones
            model = _model("qwen3-test" if v <= 2 else "qwen3-moe-test", seed=v)
            fp8 = v == 5
            transport.publish(tmp_path, v, model.state_dict(), model.args, fp8=fp8)
            expected = _as_bytes(hf_state_dict(model.state_dict(), model.args, fp8).items())
            assert fp8 == any(t == "torch.float8_e4m3fn" for t, _, _ in expected.values())
            for q in queues.values():
                rank, version, generation, got = q.get(timeout=timeout)
                assert version == v and generation is not None, got
                assert got.keys() == expected.keys()
                assert all(got[k] == expected[k] for k in expected), f"rank {rank} differs at update {v}"
                generations.setdefault(v, {})[rank] = generation
            if v == 2:  # the replica dies after update 2; its replacement joins at update 3
                restarted.kill()
                restarted.join(30)
                # told to catch up on update 2, already sent: it hears so at once, then takes 3-5
                queues[2] = ctx.Queue()
                restarted = _start(ctx, str(tmp_path), port, 2, 3, [2, 3, 4, 5], timeout, queues[2], backend)
                rank, version, generation, error = queues[2].get(timeout=timeout)
                assert (rank, version, generation) == (2, 2, None) and "rejoins at the next update" in error
    finally:
        for p in (steady, restarted):
            p.kill()
    # One communicator for updates 1-2, one re-formed for the restarted replica and kept for 3-5.
    assert generations[1] == generations[2] and generations[3] == generations[4] == generations[5]
    assert generations[2][1] != generations[3][1]
    assert transport.group().generations_formed == 2


@pytest.mark.slow
def test_a_receiver_that_never_arrives_fails_the_update_naming_it(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, timeout = _port(), 20.0
    transport = NCCLTransport("127.0.0.1", port, 2, timeout=timeout, backend="gloo")
    ready = ctx.Event()
    present = _start(ctx, str(tmp_path), port, 1, 3, [1], timeout, q, "gloo", ready)
    model = _model("qwen3-test", seed=0)
    try:
        assert ready.wait(120)  # the receiver that comes is up before the trainer's clock starts
        t0 = time.monotonic()
        with pytest.raises(WeightTransferTimeout, match=r"update 1: receiver rank\(s\) \[2\] of 2 did not join"):
            transport.publish(tmp_path, 1, model.state_dict(), model.args)
        assert time.monotonic() - t0 < timeout + 10
        rank, version, generation, error = q.get(timeout=timeout + 60)
        assert (rank, version, generation) == (1, 1, None) and "[2]" in error  # told, not left hanging
    finally:
        present.kill()


class _RecordingRunner(_FakeRunner):
    """The stand-in model runner also records the names each `reload_weights` got."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.loads: list[list[str]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format=True) -> None:
        names: list[str] = []

        def recording():
            for name, t in weights_iterator:
                names.append(name)
                yield name, t

        super().reload_weights(recording(), is_checkpoint_format)
        self.loads.append(names)


def test_worker_extension_nccl_path_takes_three_updates_over_one_group(tmp_path):
    """`arbor_load_nccl` on a CPU worker (gloo twin of the group) against a stand-in model runner."""
    from arbor.inference.vllm.worker import WeightUpdateExtension

    port = _port()
    served = _model("qwen3-test", seed=9)
    worker = WeightUpdateExtension()
    worker.model_runner = _RecordingRunner(served)
    worker.device = CPU
    worker._server_worker_rank = lambda: 0  # one worker: vLLM's world group is not there to ask
    transport = NCCLTransport("127.0.0.1", port, 1, timeout=60, bucket_mb=0.02, backend="gloo")
    for v in range(1, 4):
        trained = _model("qwen3-test", seed=v)
        loaded: list[int] = []
        t = threading.Thread(
            target=lambda: loaded.append(
                worker.arbor_load_nccl(str(broadcast_dir(tmp_path, v)), "127.0.0.1", port, 1, 2, 60)
            )
        )
        t.start()
        transport.publish(tmp_path, v, trained.state_dict(), trained.args)
        t.join(60)
        assert loaded and loaded[0] == len(worker.model_runner.loads[-1])
        for (name, a), b in zip(served.named_parameters(), trained.parameters()):
            assert torch.equal(a, b), (v, name)
    assert worker.weight_receiver.generation.endswith(".1")  # joined once, reused for updates 2 and 3
    assert transport.group().generations_formed == 1


DP_RANKS = """
import json
from types import SimpleNamespace

import vllm.distributed.parallel_state as ps
from vllm.config.parallel import ParallelConfig

from arbor.inference.vllm.worker import WeightUpdateExtension

DP, TP = 2, 2
ranks = {}
for moe in (False, True):
    got = []
    for replica in range(DP):
        pc = ParallelConfig(data_parallel_size=DP, tensor_parallel_size=TP, data_parallel_rank=replica)
        if not moe:  # what vLLM's engine core does for a dense model's replicas
            pc.reconfigure_for_independent_dp_rank()
        worker = WeightUpdateExtension()
        worker.vllm_config = SimpleNamespace(parallel_config=pc)
        for r in range(TP):  # a dense replica's world is its own workers; an MoE model's spans every replica
            world_rank = replica * TP + r if moe else r
            ps.get_world_group = lambda world_rank=world_rank: SimpleNamespace(rank_in_group=world_rank)
            got.append(worker._server_worker_rank())
    ranks["moe" if moe else "dense"] = got
print(json.dumps(ranks))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_every_worker_of_a_data_parallel_vllm_server_gets_its_own_weight_group_rank():
    """A vLLM server with data_parallel_size 2 x tensor_parallel_size 2: its four workers take ranks 0-3 of the
    server's block of the weight group, replica major, for a dense model (vLLM runs its replicas as independent
    engines, each with data_parallel_rank 0) and an MoE one (one world over the replicas), with vLLM's own
    ParallelConfig doing what its engine core does. The old rank collided (dense: 0, 1, 0, 1) or overflowed the
    block (MoE: 0, 1, 4, 5). In a process of its own: importing vLLM here would change what later tests see."""
    res = subprocess.run([sys.executable, "-c", DP_RANKS], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ranks = json.loads(res.stdout.strip().splitlines()[-1])
    assert ranks == {"dense": [0, 1, 2, 3], "moe": [0, 1, 2, 3]}
