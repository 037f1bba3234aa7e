"""The tiny model of a `rl --twin` (arbor.launch.twin) for a native family: the real checkpoint's args with only
the sizes shrunk (`shrink_native`: biases, norms, RoPE scaling, routing, shared experts, MTP kept), or, where its
config.json is not on this machine, the structure `KNOWN_MODELS` records for the checkpoints `configs/models/`
names. DeepSeek sparse attention keeps its own tiny shape (`dsa-tiny`). No torch here: planning stays light.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arbor.models.args import DSAArgs, ModelArgs
from arbor.models.family import family_for
from arbor.models.presets import BYTE_VOCAB, PRESETS

TWIN_SEQ_LEN = 1024
"""Longest twin sequence; shorter configs keep theirs, longer ones shrink to it (and their lengths with it)."""

KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architecture": "Qwen2_5_VLForConditionalGeneration",
        "tie_word_embeddings": True,
        "vision": True,
    },
    "Qwen/Qwen3-0.6B": {"architecture": "Qwen3ForCausalLM", "tie_word_embeddings": True},
    "Qwen/Qwen3-4B": {"architecture": "Qwen3ForCausalLM", "tie_word_embeddings": True},
    "Qwen/Qwen3-30B-A3B": {
        "architecture": "Qwen3MoeForCausalLM",
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
    },
    "Qwen/Qwen3-235B-A22B": {
        "architecture": "Qwen3MoeForCausalLM",
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
    },
    "deepseek-ai/DeepSeek-V3.2": {
        "architecture": "DeepseekV32ForCausalLM",
        "tie_word_embeddings": False,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
    "zai-org/GLM-5": {
        "architecture": "GlmMoeDsaForCausalLM",
        "tie_word_embeddings": False,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "indexer_rope_interleave": True,
    },
}
"""The structure of the checkpoints `configs/models/` names, from their published `config.json`s: what a twin
keeps when that file is not on this machine (offline, or never downloaded)."""


QWEN3_KEEP = ("tie_word_embeddings", "mtp_depth")
QWEN3_MOE_KEEP = ("tie_word_embeddings", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step")
DSA_KEEP = (
    "tie_word_embeddings",
    "num_experts_per_tok",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "rope_interleave",
    "indexer_rope_interleave",
)
"""Per family, the structural fields a twin copies from the real model (the rest of its shape is tiny)."""


def fact_of(real: ModelArgs | DSAArgs | dict[str, Any] | None, key: str, default: Any = None) -> Any:
    if real is None:
        return default
    if isinstance(real, dict):
        return real.get(key, default)
    return getattr(real, key, default)


def tiny_args(real: ModelArgs | DSAArgs | dict[str, Any] | None, seq_len: int) -> ModelArgs | DSAArgs:
    """A tiny model of `real`'s family and structure (byte vocabulary, 64 hidden, heads of 32: a size vLLM's CPU
    build serves); `real` is an args object, a `KNOWN_MODELS` entry or None (dense Qwen3)."""
    arch = fact_of(real, "architecture", "Qwen3ForCausalLM")
    top_k = fact_of(real, "num_experts_per_tok", 2)
    positions = max(min(seq_len, TWIN_SEQ_LEN), 64)
    if family_for(arch).dsa:
        keep = {k: fact_of(real, k) for k in DSA_KEEP if fact_of(real, k) is not None}
        experts = fact_of(real, "n_routed_experts", 0)
        group = keep.get("n_group", 1) if experts else 1
        dense = min(fact_of(real, "first_k_dense_replace", 0), 1)
        base = PRESETS["dsa-tiny"]
        q_lora = None if real is not None and fact_of(real, "q_lora_rank", 1) is None else 32
        return dataclasses.replace(
            base,
            **{**keep, "n_group": group, "topk_group": min(keep.get("topk_group", 1), group)},
            architecture=arch,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=dense + 1 if experts else 2,
            q_lora_rank=q_lora,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=32,
            index_n_heads=2,
            index_topk=16,
            max_position_embeddings=positions,
            n_routed_experts=_tiny_experts(experts, top_k, group),
            moe_intermediate_size=32 if experts else 0,
            first_k_dense_replace=dense,
        )
    if isinstance(real, ModelArgs):  # a native checkpoint's own args: every structural field kept
        return shrink_native(real, positions)
    base = ModelArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        max_position_embeddings=positions,
        architecture=arch,
    )
    if arch == "Qwen3MoeForCausalLM":
        keep = {k: fact_of(real, k) for k in QWEN3_MOE_KEEP if fact_of(real, k) is not None}
        shared = 32 if fact_of(real, "shared_expert_intermediate_size", 0) else 0
        experts = _tiny_experts(fact_of(real, "num_experts", 8), top_k, 1)
        return dataclasses.replace(
            base,
            **keep,
            num_experts=experts,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=shared,
            decoder_sparse_step=min(keep.get("decoder_sparse_step", 1), 2),
        )
    keep = {k: fact_of(real, k) for k in QWEN3_KEEP if fact_of(real, k) is not None}
    return dataclasses.replace(base, **keep)


def shrink_native(real: ModelArgs, positions: int) -> ModelArgs:
    """`real` (any native family's args: Llama, Qwen2 / 3, GLM-4.5 MoE, MiniMax-M2) at a tiny size, every other
    field as the checkpoint has it (biases, q/k norms, RoPE scaling and partial rotary, routing, shared experts,
    MTP, tied head); a MoE model keeps a dense first layer where it has dense layers, then a MoE one."""
    groups = getattr(real, "n_group", 1)
    experts = _tiny_experts(real.num_experts, real.num_experts_per_tok, groups)
    one_size = experts and real.intermediate_size == real.moe_intermediate_size  # MiniMax-M2's config names one
    sizes: dict[str, Any] = dict(
        vocab_size=BYTE_VOCAB,
        hidden_size=64,
        intermediate_size=32 if one_size else 128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2 if real.num_key_value_heads < real.num_attention_heads else 4,
        head_dim=32,
        max_position_embeddings=positions,
        num_experts=experts,
        moe_intermediate_size=32 if experts else 0,
        shared_expert_intermediate_size=32 if real.shared_expert_intermediate_size else 0,
        decoder_sparse_step=min(real.decoder_sparse_step, 2),
        mlp_only_layers=tuple(i for i in real.mlp_only_layers if i < 1),
    )
    if experts:
        sizes["num_experts_per_tok"] = min(real.num_experts_per_tok, experts)
    if hasattr(real, "first_k_dense_replace"):
        sizes["first_k_dense_replace"] = min(real.first_k_dense_replace, 1)
        sizes["topk_group"] = min(real.topk_group, groups)
    return dataclasses.replace(real, **sizes)


def _tiny_experts(real: int, top_k: int, groups: int) -> int:
    """Experts of the tiny model: twice the top-k (at most the real count), a multiple of the groups and of 2
    (so that ep = 2 splits them)."""
    if not real:
        return 0
    n = min(real, max(2 * top_k, 2 * groups, 4))
    step = groups if groups % 2 == 0 else 2 * groups
    return -(-n // step) * step


def describe(args: ModelArgs | DSAArgs) -> str:
    """One phrase: architecture, layers, width, experts and routing, DSA, MTP, tied head."""
    parts = [args.architecture, f"{args.num_hidden_layers} layers", f"hidden {args.hidden_size}"]
    if args.is_moe:
        parts.append(f"{args.num_experts} experts top-{args.num_experts_per_tok}")
        if getattr(args, "n_shared_experts", 0) or getattr(args, "shared_expert_intermediate_size", 0):
            parts.append("shared expert")
        if getattr(args, "n_group", 1) > 1:
            parts.append(f"{args.n_group} groups top-{args.topk_group}")
    if getattr(args, "is_dsa", False):
        parts.append(f"sparse attention top-{args.index_topk}")
    if getattr(args, "mtp_depth", 0):
        parts.append(f"MTP depth {args.mtp_depth}")
    parts.append("tied head" if args.tie_word_embeddings else "untied head")
    return ", ".join(parts)
