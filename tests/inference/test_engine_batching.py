"""The local engine's batched forwards: requests admitted together are prefilled in one left-padded forward, and
a weight update recomputes every running sequence's cache in batched forwards (`inference.kv_after_update =
"recompute"`) or keeps what the older weights computed (`"keep"`, vLLM's behaviour). Checked on the dense, MoE
(logprobs and router-replay routes) and DSA test models against references that run one sequence at a time:
full forwards of the new weights (recompute), and the older weights' cache of the prefix continued by the new
weights (keep)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_inference import slow_down

from arbor.config.model import ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.models import build_model, build_tokenizer
from arbor.models.hf import save_checkpoint_dir

SEQ_LEN = 64
PROMPTS = ("reverse this text please", "ab", "hello, batched world")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def models(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model at version 0 and a perturbed copy (version 1), eval mode."""
    old = build_model(ModelConfig(name=name))
    old.init_weights(0, std=0.3)
    new = copy.deepcopy(old)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return old.eval(), new.eval()


def generate_across_update(name: str, tmp_path: Path, recompute: bool):
    """Three prompts of different lengths, two samples each, admitted together; version 1 lands mid-generation."""
    old, new = models(name)
    save_checkpoint_dir(new.state_dict(), new.args, tmp_path / "v1")
    tok = build_tokenizer(ModelConfig(name=name))
    prompts = [tok.encode(p) for p in PROMPTS]
    served = copy.deepcopy(old)
    slow_down(served, 0.004)
    engine = Engine(served, tok, seq_len=SEQ_LEN, max_batch_size=8, seed=0, recompute_on_update=recompute).start()
    try:
        engine.pause().result()
        futures = [
            engine.submit(p, SamplingParams(max_tokens=24, temperature=1.0, n=2, seed=i)) for i, p in enumerate(prompts)
        ]
        engine.resume().result()
        deadline = time.monotonic() + 60
        while engine.stats().generated_tokens < 6 * 6:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert engine.update_weights(tmp_path / "v1", 1).result(timeout=60) == 1
        outputs = [f.result(timeout=120) for f in futures]
        assert engine.stats().max_decode_batch == 6
    finally:
        engine.stop()
    samples = []  # (prompt, completion, index of its first version-1 token): every sample straddles the update
    for p, out in zip(prompts, outputs):
        for c in out.completions:
            k = c.policy_versions.index(1)
            assert 0 < k < len(c.token_ids) and c.policy_versions == [0] * k + [1] * (len(c.token_ids) - k)
            samples.append((p, c, k))
    return old, new, tok.vocab_size, samples


@pytest.mark.parametrize("name", ["qwen3-test", "qwen3-moe-test", "dsa-test"])
def test_update_recomputes_every_running_sequence(tmp_path: Path, name: str) -> None:
    old, new, V, samples = generate_across_update(name, tmp_path, recompute=True)
    for p, c, k in samples:
        ids = p + c.token_ids
        with torch.no_grad():
            lp_new = torch.log_softmax(new(torch.tensor([ids]))[0].float()[:, :V], -1)
            lp_old = torch.log_softmax(old(torch.tensor([ids]))[0].float()[:, :V], -1)
        pos = torch.arange(len(p) - 1, len(ids) - 1)
        want = torch.where(torch.arange(len(c.token_ids)) < k, lp_old[pos, c.token_ids], lp_new[pos, c.token_ids])
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=2e-5, rtol=0)
        assert (c.routed_experts is not None) == ("moe" in name)
        if c.routed_experts is not None:  # MoE: every fed position re-routed by the new weights
            fed = len(ids) - 1
            assert np.array_equal(_routes(new, ids)[:fed], c.routed_experts[:fed])


def _routes(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        model(torch.tensor([ids]))
    return model.last_routed_experts[0].numpy()


@pytest.mark.parametrize("name", ["qwen3-test", "qwen3-moe-test", "dsa-test"])
def test_update_keeps_the_older_cache_when_asked(tmp_path: Path, name: str) -> None:
    old, new, V, samples = generate_across_update(name, tmp_path, recompute=False)
    for p, c, k in samples:
        # reference: the older weights cache every position before the newest token at the update, the new
        # weights then write that token and every later one and predict from them
        kv = new.make_kv_cache(1, SEQ_LEN)
        slot = torch.tensor([0])
        before = p + c.token_ids[: k - 1]
        after = c.token_ids[k - 1 : -1]
        with torch.no_grad():
            old(torch.tensor([before]), torch.arange(len(before))[None], kv_cache=kv, cache_slots=slot)
            old_routes = getattr(old, "last_routed_experts", None)  # MoE only
            logits = new(
                torch.tensor([after]),
                torch.arange(len(before), len(before) + len(after))[None],
                kv_cache=kv,
                cache_slots=slot,
                logits_to_keep=0,
            )[0].float()
        want = torch.log_softmax(logits[:, :V], -1)[torch.arange(len(after)), c.token_ids[k:]]
        torch.testing.assert_close(torch.tensor(c.logprobs[k:]), want, atol=2e-5, rtol=0)
        assert (c.routed_experts is not None) == ("moe" in name)
        if c.routed_experts is not None:  # MoE: the kept prefix keeps the older routes, the rest the new ones
            kept, fed = len(before), len(before) + len(after)
            assert np.array_equal(old_routes[0].numpy(), c.routed_experts[:kept])
            assert np.array_equal(new.last_routed_experts[0].numpy(), c.routed_experts[kept:fed])
        with torch.no_grad():
            full = torch.log_softmax(new(torch.tensor([p + c.token_ids]))[0].float()[:, :V], -1)
        fresh = full[torch.arange(len(p) + k - 1, len(p) + len(c.token_ids) - 1), c.token_ids[k:]]
        assert not torch.allclose(torch.tensor(c.logprobs[k:]), fresh, atol=1e-3), "the kept cache matters"


def test_failed_batched_prefill_falls_back_to_one_request_at_a_time() -> None:
    old, _ = models("qwen3-test")
    tok = build_tokenizer(ModelConfig(name="qwen3-test"))
    engine = Engine(copy.deepcopy(old), tok, seq_len=SEQ_LEN, max_batch_size=8, seed=0)

    def broken(requests):
        raise RuntimeError("batched forward failed")

    engine.runner.prefill_many = broken
    engine.start()
    try:
        engine.pause().result()
        futures = [engine.submit(tok.encode(p), SamplingParams(max_tokens=8, temperature=0)) for p in PROMPTS]
        engine.resume().result()
        outputs = [f.result(timeout=60) for f in futures]
    finally:
        engine.stop()
    for p, out in zip(PROMPTS, outputs):  # the same greedy continuation as a lone full forward
        ids = tok.encode(p)
        with torch.no_grad():
            for t in out.completions[0].token_ids:
                assert t == int(old(torch.tensor([ids]))[0, -1, : tok.vocab_size].argmax())
                ids.append(t)
