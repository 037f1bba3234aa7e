"""Router replay (R3): the engine reports the experts it routed every token to; the payload travels through
the wire encoding, the rollout and the batcher unchanged; the trainer routes exactly as the engine did, and
its mismatch against the inference logprobs is no larger than without replay (every MoE family's test preset)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.models import build_model
from arbor.models.tokenizer import ByteTokenizer
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.rollout import Rollout
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import micro_batch_logprobs
from arbor.transport.batch import StepBatch
from arbor.transport.expert_routes import decode_routes, encode_routes


def _generate(model, prompts, n=3, max_tokens=12):
    with Engine(copy.deepcopy(model), ByteTokenizer(), seq_len=64, max_batch_size=8, seed=0) as engine:
        futures = [
            engine.submit(p, SamplingParams(max_tokens=max_tokens, temperature=1.0, n=n, seed=i))
            for i, p in enumerate(prompts)
        ]
        outs = [f.result(timeout=120) for f in futures]
    rollouts = []
    for prompt, out in zip(prompts, outs):
        for c in out.completions:
            payload = encode_routes(c.routed_experts)  # what the server puts in the choice
            rollouts.append(
                Rollout(
                    0,
                    prompt,
                    c.token_ids,
                    c.logprobs,
                    c.policy_versions,
                    c.text,
                    c.finish_reason,
                    advantage=1.0,
                    routed_experts=decode_routes(payload),
                )
            )
    return rollouts


def _mismatch_kl(model, batch: StepBatch, replay: bool, state: ParallelState) -> tuple[float, list[torch.Tensor]]:
    total, tokens, routes = 0.0, 0, []
    with torch.no_grad():
        for mb in batch.micro_batches:
            lp, _ = micro_batch_logprobs(model, mb, 1.0, torch.device("cpu"), False, router_replay=replay, state=state)
            d = (lp - mb.inference_logprobs).double()[mb.loss_mask]
            total += float((torch.expm1(d) - d).sum())
            tokens += int(mb.loss_mask.sum())
            routes.append(model.last_routed_experts[0])
    return total / tokens, routes


MOE_PRESETS = ["qwen3-moe-test", "glm4-moe-test", "minimax-m2-test"]


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_engine_routes_replayed_by_trainer_and_mismatch_not_larger(name):
    model = build_model(ModelConfig(name=name))
    tok = ByteTokenizer()
    prompts = [tok.encode("reverse: abcdef"), tok.encode("hello world, moe")]
    rollouts = _generate(model, prompts)
    L, k = len(model.args.moe_layers), model.args.num_experts_per_tok
    for r in rollouts:
        assert r.routed_experts.shape == (r.num_tokens, L, k) and r.routed_experts.dtype == np.uint8
        # The same weights route every token the engine fed to the model the same way (fp32, no replay).
        with torch.no_grad():
            model(torch.tensor([r.prompt_ids + r.completion_ids]))
        fed = r.num_tokens - 1
        assert np.array_equal(model.last_routed_experts[0, :fed].numpy(), r.routed_experts[:fed])

    (batch,) = build_step_batches(rollouts, step=0, ranks=1, micro_batch_tokens=128, temperature=1.0, pad_id=0)
    assert all(mb.routed_experts is not None for mb in batch.micro_batches)
    batch = StepBatch.from_tensors(*batch.to_tensors()).torch()  # through the rollout file format

    # A trainer whose router differs slightly from inference's (as bf16 kernels vs fp32 would make it).
    trainer = copy.deepcopy(model)
    state = ParallelState(vocab=tok.vocab_size)  # as `parallelize` prepares it: scored over the ids sampled
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in (layer for layer in trainer.model.layers if layer.is_moe):
            w = layer.mlp.gate.weight
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=gen))
    kl_free, routes_free = _mismatch_kl(trainer, batch, False, state)
    kl_replay, routes_replay = _mismatch_kl(trainer, batch, True, state)
    for mb, got in zip(batch.micro_batches, routes_replay, strict=True):
        assert torch.equal(got.to(torch.long), mb.routed_experts.to(torch.long))  # every token, every MoE layer
    flipped = sum(
        int((a.to(torch.long) != mb.routed_experts.to(torch.long)).any(-1).sum())
        for a, mb in zip(routes_free, batch.micro_batches)
    )
    assert flipped > 0, "the perturbed router should route some tokens differently without replay"
    assert kl_replay <= kl_free
    assert kl_replay < kl_free


def test_routes_payload_roundtrip_and_errors():
    arr = np.random.default_rng(0).integers(0, 300, (5, 2, 3)).astype(np.int16)
    assert np.array_equal(decode_routes(encode_routes(arr)), arr)
    with pytest.raises(ValueError, match="routed_experts payload is malformed"):
        decode_routes({"dtype": "float32", "shape": [1], "data": ""})


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_engine_loads_published_moe_weights(tmp_path, name):
    from arbor.models.hf import save_checkpoint_dir

    model = build_model(ModelConfig(name=name))
    other = build_model(ModelConfig(name=name, init_seed=5))
    save_checkpoint_dir(other.state_dict(), other.args, tmp_path, ByteTokenizer())  # per-expert names on disk
    with Engine(model, ByteTokenizer(), seq_len=32, max_batch_size=2) as engine:
        assert engine.update_weights(tmp_path, 1).result(timeout=60) == 1
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
