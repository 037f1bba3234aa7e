"""Parameters of a Qwen-VL vision tower from its `vision_config` (no torch): what `rl plan` adds to the decoder's
count for a vision-language model, whose tower is held in memory, trained (or frozen) and published beside it.

Exact for the towers arbor's vision-language path serves (arbor.models.hf_vision), counted as transformers builds
them: Qwen2-VL (LayerNorm blocks, a `mlp_ratio` MLP), Qwen2.5-VL (RMSNorm blocks, a gated MLP with biases) and
Qwen3-VL (LayerNorm blocks, learned position embeddings, deepstack mergers). Every tower has a 3-D patch embedding,
blocks of attention (`qkv`, `proj`, both with biases) and an MLP, and a merger of `spatial_merge_size**2` patches
into one decoder token.
"""

from __future__ import annotations

from typing import Any

TOWERS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
"""The checkpoints' `model_type`s whose tower is counted here."""


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def vision_tower_params(config: dict[str, Any]) -> int | None:
    """Parameters of the vision tower of a checkpoint `config` (config.json's contents); None when the config has
    no `vision_config` or its `model_type` is not one of `TOWERS`."""
    vc = config.get("vision_config")
    kind = config.get("model_type")
    if not isinstance(vc, dict) or kind not in TOWERS:
        return None
    qwen2 = kind == "qwen2_vl"
    h = int(vc["embed_dim"] if qwen2 else vc["hidden_size"])
    inter = int(h * vc.get("mlp_ratio", 4)) if qwen2 else int(vc["intermediate_size"])
    out = int(vc.get("hidden_size", h) if qwen2 else vc["out_hidden_size"])
    merged = h * int(vc.get("spatial_merge_size", 2)) ** 2
    patch = int(vc.get("in_channels", 3)) * int(vc.get("temporal_patch_size", 2)) * int(vc.get("patch_size", 14)) ** 2
    layer_norm = kind != "qwen2_5_vl"  # LayerNorm (weight and bias) except Qwen2.5-VL's RMSNorm (weight)
    norm = 2 * h if layer_norm else h
    gated = kind == "qwen2_5_vl"
    mlp = 2 * _linear(h, inter) + _linear(inter, h) if gated else _linear(h, inter) + _linear(inter, h)
    block = 2 * norm + _linear(h, 3 * h) + _linear(h, h) + mlp
    merger = norm + _linear(merged, merged) + _linear(merged, out)
    total = patch * h + int(vc["depth"]) * block + merger
    if kind.startswith("qwen3_vl"):
        total += h  # the patch embedding's bias
        total += int(vc.get("num_position_embeddings", 0)) * h
        deepstack = len(vc.get("deepstack_visual_indexes") or [])
        total += deepstack * (2 * merged + _linear(merged, merged) + _linear(merged, out))  # post-shuffle norms
    return total
