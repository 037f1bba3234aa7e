"""A LoRA adapter on the language-model head (`lm_head` named in `model.lora.target_modules`): only when named,
base + scaled low-rank product on the output projection (the tied embeddings unchanged), the trainer's head path
and the engine's adapter slots computing the same thing, and the tied head refused where an adapter is merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_lora_engine import PROMPT, engine, random_adapter

from arbor.config.loader import load_config
from arbor.config.model import LoRAConfig, ModelConfig
from arbor.config.rl import RLConfig
from arbor.inference.engine.params import SamplingParams
from arbor.launch.preflight import PreflightError, check_lora_head
from arbor.models import build_model
from arbor.models.lora import apply_lora, check_mergeable, lora_parameters, lora_targets, merged_state
from arbor.models.lora_peft import peft_tensors, target_leaves

HEAD_TARGETS = ["q_proj", "down_proj", "lm_head"]


def test_the_head_is_a_target_only_when_named() -> None:
    model = build_model(ModelConfig(name="qwen3-test"))
    assert "lm_head" not in lora_targets(model, list(LoRAConfig().target_modules))
    assert "lm_head" not in lora_targets(model, [".*"])  # a regular expression never picks the head up
    assert set(lora_targets(model, ["lm_head"])) == {"lm_head"}


def test_head_adapter_is_base_plus_scaled_product_on_the_output_only() -> None:
    """The forward's logits are `x W^T + s (x A^T) B^T` on the final hidden states x; the embeddings (tied to the
    head's weight) are unchanged, and the trainer's head path (`head_fn` gets the effective weight) agrees."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="qwen3-test"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embeddings = model.model.embed_tokens.weight.detach().clone()
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, target_modules=["lm_head"]), 0)
    with torch.no_grad():
        model.lm_head.lora_B.normal_(0, 0.3)
    ids = torch.tensor([PROMPT + [10, 11, 12]])
    with torch.no_grad():
        logits = model(ids)
        x = model(ids, head_fn=lambda h, w: h)  # the final hidden states
        via_weight = model(ids, head_fn=lambda h, w: h @ w.T)
    head = model.lm_head
    want = x @ embeddings.T + 2.0 * (x @ head.lora_A.T) @ head.lora_B.T
    assert (logits - want).abs().max().item() < 1e-6
    assert (via_weight - want).abs().max().item() < 1e-5
    assert torch.equal(model.model.embed_tokens.weight, embeddings)


def test_the_trainer_head_path_trains_the_head_adapter() -> None:
    model = build_model(ModelConfig(name="qwen3-test"))
    apply_lora(model, LoRAConfig(rank=4, target_modules=HEAD_TARGETS), 0)
    ids = torch.tensor([PROMPT + [10, 11, 12]])

    def head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # the sequence's logprob through the weight
        return torch.log_softmax(h @ w.T, -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum()

    loss = model(ids, head_fn=head)
    loss.backward()
    grads = {n: p.grad for n, p in lora_parameters(model)}
    assert grads["lm_head.lora_B"].abs().max().item() > 0  # B starts at zero: its gradient is A's projection of x
    assert model.lm_head.weight.grad is None


def test_peft_layout_names_the_head() -> None:
    model = build_model(ModelConfig(name="qwen3-test"))
    apply_lora(model, LoRAConfig(rank=2, target_modules=HEAD_TARGETS), 0)
    adapters = dict(lora_parameters(model))
    assert "lm_head" in target_leaves(adapters)
    peft = set(peft_tensors(adapters))
    assert {"base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"} <= peft


def test_engine_serves_a_head_adapter_as_the_adapted_model(tmp_path: Path) -> None:
    """The engine's slots on the head (rows for the adapter and for the base in one batch) give the adapted
    model's tokens and logprobs."""
    name = "qwen3-test"
    model, path = random_adapter(name, tmp_path / "a", seed=3, targets=HEAD_TARGETS)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    with torch.inference_mode():
        served = engine(build_model(ModelConfig(name=name)), name)
        try:
            served.load_adapter("a", path, 2).result()
            futures = {k: served.submit(PROMPT, greedy, adapter=k) for k in ("a", None)}
            got = {k: f.result().completions[0] for k, f in futures.items()}
        finally:
            served.stop()
        ref = engine(model, name)  # the adapted (unmerged) model itself
        try:
            want = ref.submit(PROMPT, greedy).result().completions[0]
        finally:
            ref.stop()
    assert got["a"].token_ids == want.token_ids and got["a"].token_ids != got[None].token_ids
    assert max(abs(x - y) for x, y in zip(got["a"].logprobs, want.logprobs)) < 1e-5


def test_a_tied_head_adapter_is_refused_where_it_would_be_merged() -> None:
    model = build_model(ModelConfig(name="qwen3-test"))
    apply_lora(model, LoRAConfig(rank=2, target_modules=HEAD_TARGETS), 0)
    with pytest.raises(ValueError, match="tied to its embeddings"):
        check_mergeable(model)
    with pytest.raises(ValueError, match="tied to its embeddings"):
        merged_state(model)
    args = ["--model.name", "qwen3-test", "--model.lora.target-modules", '["q_proj", "lm_head"]', "--sft.steps", "5"]
    with pytest.raises(PreflightError, match="sft.adapter"):
        check_lora_head(load_config(RLConfig, args))
    check_lora_head(load_config(RLConfig, args + ["--sft.adapter", "false"]))  # full-weight warm-up: nothing merged
    check_lora_head(load_config(RLConfig, args[:4]))  # no warm-up
