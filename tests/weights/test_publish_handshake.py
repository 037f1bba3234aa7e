"""Streamed publish over the NCCL transport cannot deadlock against the receivers' handshake: the gloo twin.

Two FSDP2 trainer ranks publish through `NCCLTransport(backend="gloo")` to one receiver that joins late: after the
trainer ranks have entered the publish, and longer after than the trainer's process-group timeout (here 4 s: the
stand-in for NCCL's watchdog). Rank 0 waits for the receiver inside the transport's handshake; before the fix,
rank 1 meanwhile sat in the first bucket's all-gather and its process group timed out. Now every rank waits for
the handshake in a gloo collective whose timeout covers it, and the update arrives whole.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_parallel import _free_port
from test_weight_group import _as_bytes

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.hf import hf_state_dict
from arbor.run_dir import broadcast_dir
from arbor.weights.comm import ReceiverGroup, receive_buckets
from arbor.weights.transport import NCCLTransport, read_nccl_layout, wait_stable

pytestmark = pytest.mark.slow  # three processes

PG_TIMEOUT_S = 4.0
"""The trainer ranks' own collectives give up after this (NCCL's watchdog, scaled down)."""
LATE_S = 2 * PG_TIMEOUT_S
"""How long after the trainer ranks entered the publish the receiver joins."""


def _late_receiver(out: str, port: int, entered: str, q) -> None:
    while not Path(entered).exists():
        time.sleep(0.05)
    time.sleep(LATE_S)
    group = ReceiverGroup("127.0.0.1", port, 1, 2, "gloo", 120.0, torch.device("cpu"))
    version, buckets = read_nccl_layout(wait_stable(broadcast_dir(out, 1), 120.0))
    q.put(_as_bytes(receive_buckets(group.join(version), buckets, torch.device("cpu"))))


def _trainer_rank(rank: int, world: int, port: int, transport_port: int, out: str, entered: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh  # DTensor imports sympy: only the ranks need it

    from arbor.trainer.parallel import apply_fsdp
    from arbor.weights.publish import DeltaTracker, stream_publish

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
    model = build_model(ModelConfig(name="qwen3-test"))
    apply_fsdp(model, init_device_mesh("cpu", (world,)), torch.float32)
    transport = NCCLTransport("127.0.0.1", transport_port, 1, timeout=120.0, bucket_mb=0.02, backend="gloo")
    if rank == 1:
        Path(entered).touch()
    stream_publish(model, transport, out, 1, torch.float32, False, None, DeltaTracker(False), torch.device("cpu"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may abort the interpreter's teardown after a successful run


def test_streamed_publish_waits_for_a_late_receiver_without_a_collective_timing_out(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    transport_port, entered = _free_port(), str(tmp_path / "entered")
    receiver = ctx.Process(target=_late_receiver, args=(str(tmp_path), transport_port, entered, q), daemon=True)
    receiver.start()
    try:
        torch.multiprocessing.start_processes(
            _trainer_rank,
            args=(2, _free_port(), transport_port, str(tmp_path), entered),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        got = q.get(timeout=120)
    finally:
        receiver.kill()
    model = build_model(ModelConfig(name="qwen3-test"))
    expected = _as_bytes(hf_state_dict(model.state_dict(), model.args, False).items())
    assert got.keys() == expected.keys() and all(got[k] == expected[k] for k in expected)
