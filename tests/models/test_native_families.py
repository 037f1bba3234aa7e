"""The native families beside Qwen3: Llama, Qwen2, Mistral, GLM-4.5-MoE and MiniMax-M2 against transformers' own
modelling code on tiny random checkpoints it writes locally (nothing downloaded): logits on plain and packed rows
(<= 1e-4, fp32), the checkpoint arbor publishes reloading in transformers with the same logits, KV-cache decoding
equal to the full forward, router replay reproducing the recorded routes; RoPE scaling (linear, llama3, YaRN) and
the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.args import ModelArgs
from arbor.models.attention import packed_causal_mask, position_ids_for
from arbor.models.hf import save_checkpoint_dir

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500_000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "linear-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10_000.0, factor=4.0)),
    ),
    "qwen2-yarn": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1_000_000.0, factor=4.0, original_max_position_embeddings=64
            )
        ),
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "glm4-moe": (
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        dict(
            MOE,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
        ),
    ),
    "minimax-m2": (
        transformers.MiniMaxM2Config,
        transformers.MiniMaxM2ForCausalLM,
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24, rotary_dim=8),
    ),
}


def _random_checkpoint(path: Path, case: str) -> transformers.PreTrainedModel:
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**SMALL, **extra})).eval()
    with torch.no_grad():  # every weight random (norms around 1, biases too), not transformers' zeros and ones
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_on_plain_and_packed_rows_and_the_published_checkpoint_reloads(tmp_path, case):
    hf = _random_checkpoint(tmp_path / "hf", case)
    model = build_model(ModelConfig(name=str(tmp_path / "hf"))).eval()
    assert model.args.architecture == CASES[case][1].__name__
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=gen)
    lens = [13, 20, 7]
    row = torch.randint(0, SMALL["vocab_size"], (1, sum(lens)), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-4)
        packed = model(row, position_ids_for(lens), packed_causal_mask(lens))[0]
        alone = torch.cat([hf(s[None]).logits[0] for s in row[0].split(lens)])
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-4)

    out = tmp_path / "published"
    save_checkpoint_dir(model.state_dict(), model.args, out)
    again = type(hf).from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)
    reread = build_model(ModelConfig(name=str(out)))
    assert reread.args == model.args
    assert all(torch.equal(a, b) for a, b in zip(reread.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("name", ["llama-test", "glm4-moe-test", "minimax-m2-test"])
def test_kv_cache_decoding_equals_the_full_forward(name):
    model = build_model(ModelConfig(name=name)).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = model.make_kv_cache(num_slots=2, max_len=32)
    slot = torch.tensor([1])
    with torch.no_grad():
        full = model(ids)[0]
        pre = model(ids[:, :8], torch.arange(8)[None], kv_cache=cache, cache_slots=slot)[0]
        steps = [model(ids[:, t : t + 1], torch.tensor([[t]]), kv_cache=cache, cache_slots=slot)[0, 0] for t in (8, 9)]
    torch.testing.assert_close(pre, full[:8], rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.stack(steps), full[8:10], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["glm4-moe-test", "minimax-m2-test"])
def test_router_replay_reproduces_the_recorded_routes(name):
    model = build_model(ModelConfig(name=name)).eval()
    other = build_model(ModelConfig(name=name, init_seed=7)).eval()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        routes = model.last_routed_experts
        assert routes.shape == (1, 16, len(model.args.moe_layers), 2)
        torch.testing.assert_close(model(ids, routed_experts=routes), logits, rtol=0, atol=0)
        other(ids, routed_experts=routes)  # another model's router would choose otherwise; replay forces the routes
    assert torch.equal(other.last_routed_experts, routes)
    assert model.aux_loss is None


def test_rope_types_arbor_lacks_and_sliding_windows_are_refused_in_one_line(tmp_path):
    """By the native families (`model.impl = "native"`; "auto" builds such checkpoints on the transformers path,
    tests/models/test_hf_causal.py)."""
    config = transformers.LlamaConfig(**SMALL, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0))
    config.save_pretrained(str(tmp_path / "dynamic"))
    with pytest.raises(ValueError, match=r"^rope_type 'dynamic': arbor implements default, linear, llama3, yarn$"):
        ModelArgs.from_dir(tmp_path / "dynamic", "native")
    transformers.MistralConfig(**SMALL, sliding_window=64).save_pretrained(str(tmp_path / "window"))
    with pytest.raises(ValueError, match=r"^sliding_window = 64: arbor's native MistralForCausalLM attends"):
        ModelArgs.from_dir(tmp_path / "window", "native")
    raw = json.loads((tmp_path / "window" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^hidden_act 'gelu': arbor's decoders implement silu \(SwiGLU\)$"):
        ModelArgs.from_hf_config({**raw, "hidden_act": "gelu"})
