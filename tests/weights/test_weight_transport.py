"""Weight transfer implementations: sharding + index, checksums verified on load, timeouts, the NCCL layout."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.config.transport import WeightTransportConfig
from arbor.models import build_model
from arbor.models.hf import load_weights
from arbor.run_dir import STABLE, broadcast_dir, published_steps
from arbor.weights.buckets import flatten
from arbor.weights.comm import ReceiverGroup, deadline_call, receive_buckets
from arbor.weights.transport import (
    INDEX,
    MANIFEST,
    NCCL_SPEC,
    FilesystemTransport,
    NCCLTransport,
    WeightTransferError,
    WeightTransferTimeout,
    make_transport,
    read_nccl_layout,
    read_nccl_spec,
    read_verified,
    wait_stable,
)


def _model(seed: int = 0):
    model = build_model(ModelConfig(name="qwen3-test"))
    model.init_weights(seed, std=0.3)
    return model


def test_sharded_publish_round_trips_with_index_and_manifest(tmp_path):
    model = _model()
    t = FilesystemTransport(keep=2, max_shard_gb=20_000 / 2**30)  # ~20 KB shards: several files
    path = t.publish(tmp_path, 1, model.state_dict(), model.args)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert sorted(json.loads((path / MANIFEST).read_text())["files"]) == shards
    state = t.load(path)
    own = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.args.tie_word_embeddings}
    assert state.keys() == own.keys() and all(torch.equal(state[k], own[k]) for k in own)
    other = _model(seed=5)
    load_weights(other, path)  # an ordinary HF reader understands the sharded layout
    assert torch.equal(other.state_dict()["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])
    for step in (2, 3):
        t.publish(tmp_path, step, model.state_dict(), model.args)
    assert published_steps(tmp_path) == [2, 3]


def test_corrupted_shard_fails_loudly_and_the_engine_keeps_its_weights(tmp_path):
    from arbor.inference.engine.core import Engine
    from arbor.inference.engine.params import WeightUpdateError
    from arbor.models import build_tokenizer

    model = _model()
    path = FilesystemTransport(checksum="sha256").publish(tmp_path, 1, _model(seed=3).state_dict(), model.args)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF  # one flipped bit in a tensor: still parses, wrong numbers
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(WeightTransferError, match="sha256"):
        read_verified(path)
    fast = FilesystemTransport().publish(tmp_path / "crc", 1, model.state_dict(), model.args)
    assert json.loads((fast / MANIFEST).read_text())["algorithm"] == "crc32"
    assert read_verified(fast).keys() == read_verified(path, verify=False).keys()
    data = bytearray((fast / "model.safetensors").read_bytes())
    data[-5] ^= 0x01
    (fast / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(WeightTransferError, match="crc32"):
        read_verified(fast)
    assert read_verified(path, verify=False)  # what loading without the check would have silently accepted
    before = model.state_dict()["model.norm.weight"].clone()
    engine = Engine(model, build_tokenizer(ModelConfig(name="qwen3-test")), seq_len=32, max_batch_size=2).start()
    try:
        with pytest.raises(WeightUpdateError, match="sha256"):  # the manifest names its algorithm
            engine.update_weights(path, 1).result(timeout=60)
        assert engine.version == 0 and torch.equal(model.state_dict()["model.norm.weight"], before)
    finally:
        engine.stop()


def test_timeouts_fail_instead_of_hanging(tmp_path):
    with pytest.raises(WeightTransferTimeout, match="STABLE"):
        wait_stable(tmp_path, 0.2)
    (tmp_path / STABLE).write_text("1")
    assert wait_stable(tmp_path, 0.2) == tmp_path
    never = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(WeightTransferTimeout, match="receiving w"):
        deadline_call(never.wait, 0.2, "receiving w")
    assert time.monotonic() - t0 < 5
    never.set()
    with pytest.raises(ZeroDivisionError):
        deadline_call(lambda: 1 / 0, 5, "x")


def test_nccl_publish_writes_the_tensor_list_and_refuses_file_loads(tmp_path, monkeypatch):
    model = _model()
    sent = []
    monkeypatch.setattr(NCCLTransport, "_send", lambda self, final, tensors: sent.append((final, list(tensors))))
    t = make_transport(WeightTransportConfig(kind="nccl", nccl_inference_ranks=3))
    assert isinstance(t, NCCLTransport) and t.world == 4
    path = t.publish(tmp_path, 2, model.state_dict(), model.args)
    assert (path / STABLE).exists() and (path / NCCL_SPEC).exists() and not list(path.glob("*.safetensors"))
    spec = read_nccl_spec(path)
    assert [s[0] for s in spec] == sent[0][1] and sent[0][0] == broadcast_dir(tmp_path, 2)
    emb = model.state_dict()["model.embed_tokens.weight"]
    assert ("model.embed_tokens.weight", emb.dtype, list(emb.shape)) in spec
    with pytest.raises(WeightTransferError, match="NCCL"):
        read_verified(path)
    with pytest.raises(WeightTransferError, match="filesystem"):
        t.load(path)
    assert isinstance(make_transport(WeightTransportConfig()), FilesystemTransport)


def test_nccl_without_vllm_or_cuda_fails_with_one_clear_error(tmp_path):
    model = _model()
    t = NCCLTransport("127.0.0.1", 29599, 1, timeout=5)
    with pytest.raises(WeightTransferError, match="CUDA|vLLM"):
        t.publish(tmp_path, 1, model.state_dict(), model.args)


@pytest.mark.slow
@pytest.mark.gpu(reason="NCCL broadcast between two CUDA devices")
def test_nccl_broadcast_between_two_processes_matches_the_sender(tmp_path):
    """Trainer rank 0 sends over PyNccl; a receiver process (as a vLLM worker would) gets identical tensors."""
    import multiprocessing as mp

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    model = _model()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(str(tmp_path), q))
    p.start()
    torch.cuda.set_device(0)
    NCCLTransport("127.0.0.1", 29611, 1, timeout=120).publish(tmp_path, 1, model.state_dict(), model.args)
    got = q.get(timeout=300)
    p.join(60)
    ref = {k: v for k, v in model.state_dict().items() if k in got}
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def _receiver(out: str, q) -> None:
    torch.cuda.set_device(1)
    path = wait_stable(broadcast_dir(out, 1), 120)
    version, buckets = read_nccl_layout(path)
    group = ReceiverGroup("127.0.0.1", 29611, 1, 2, "nccl", 120, torch.device("cuda", 1))
    q.put({k: v.cpu() for k, v in receive_buckets(group.join(version), buckets, group.device)})


class _FakeRunner:
    """Stands in for vLLM's model runner: `reload_weights` (and `model.load_weights`) take (HF name, tensor)
    pairs, as vLLM's do."""

    def __init__(self, model) -> None:
        own = dict(model.named_parameters())

        class Loader:
            parameters = model.parameters

            @staticmethod
            def load_weights(weights):
                with torch.no_grad():
                    for name, t in weights:
                        if name in own:
                            own[name].copy_(t)

        self.model = Loader()

    def reload_weights(self, weights_iterator, is_checkpoint_format=True) -> None:
        self.model.load_weights(weights_iterator)


def test_worker_extension_loads_a_published_dir_into_the_model(tmp_path):
    """The vLLM worker extension's file path on CPU: after arbor_load_dir the weights equal the trainer's."""
    from arbor.inference.vllm.worker import WeightUpdateExtension

    trained, served = _model(seed=1), _model(seed=2)
    path = FilesystemTransport().publish(tmp_path, 1, trained.state_dict(), trained.args)
    worker = WeightUpdateExtension()
    worker.model_runner = _FakeRunner(served)
    before = worker.arbor_weight_checksum()
    assert worker.arbor_load_dir(str(path), True, 30) > 0
    for (name, a), b in zip(served.named_parameters(), trained.parameters()):
        assert torch.equal(a, b), name
    assert worker.arbor_weight_checksum() != before


def test_nccl_receive_allocates_in_spec_order_and_yields_what_rank_0_sent(tmp_path, monkeypatch):
    """The receiving half of the NCCL path with a loopback communicator (CPU): names, dtypes, shapes, values."""
    model = _model()
    monkeypatch.setattr(NCCLTransport, "_send", lambda self, final, tensors: None)
    path = NCCLTransport("127.0.0.1", 1, 1, bucket_mb=0.05).publish(tmp_path, 1, model.state_dict(), model.args)
    expected = dict(model.state_dict())
    buckets = read_nccl_layout(path)[1]
    assert len(buckets) > 2  # several tensors per bucket, several buckets
    sent = iter([flatten([expected[name] for name, _, _ in b]) for b in buckets])
    barriers = []

    class Loopback:
        def broadcast(self, buf, what):
            assert buf.dtype == torch.uint8 and "bucket" in what
            buf.copy_(next(sent))

        def barrier(self, what):
            barriers.append(what)

    got = dict(receive_buckets(Loopback(), buckets, torch.device("cpu")))
    assert list(got) == [s[0] for s in read_nccl_spec(path)]
    assert all(torch.equal(got[k], expected[k]) for k in got)
    assert len(barriers) == 1  # the receiver confirms the whole update once
