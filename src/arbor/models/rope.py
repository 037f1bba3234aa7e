"""Rotary position embeddings shared by arbor's decoders: the inverse frequencies of each RoPE type a checkpoint's
`rope_parameters` (or older `rope_scaling`) can name, and the module that turns position ids into cos/sin.

Types (arbor.models.args.ROPE_TYPES): "default"; "linear" (positions divided by `factor`); "llama3" (Llama 3.1:
wavelengths past `original_max_position_embeddings / low_freq_factor` divided by `factor`, a smooth blend up to
`/ high_freq_factor`); "yarn" (YaRN: frequencies whose wavelength exceeds the original context interpolated, a
linear ramp between the `beta_fast` / `beta_slow` correction dimensions, cos/sin times an attention factor). The
formulas are the published ones that transformers' `modeling_rope_utils` implements (checked against it in
tests/models/test_llama.py). With `partial_rotary_factor < 1` the frequencies cover the first
`int(head_dim * factor)` dimensions of a head, and `apply_rope` leaves the rest as they are (GLM-4.5, MiniMax-M2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def _yarn(
    inv_freq: torch.Tensor, dim: int, theta: float, p: dict[str, Any], max_pos: int
) -> tuple[torch.Tensor, float]:
    original = int(p.get("original_max_position_embeddings") or max_pos)
    factor = float(p.get("factor") or max_pos / original)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep  # keep = 1: high frequencies, unchanged
    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = yarn_get_mscale(factor, m) / yarn_get_mscale(factor, m_all) if m and m_all else yarn_get_mscale(factor)
    return inv_freq, float(attn)


def rope_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `[dim / 2]` in fp32, factor on cos/sin) of RoPE over `dim` rotated dimensions;
    `scaling` is None (default RoPE) or the checkpoint's parameters with their `rope_type`."""
    inv_freq = default_inv_freq(dim, theta)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"rope_type {kind!r}: arbor implements default, linear, llama3 and yarn")


class RotaryEmbedding(nn.Module):
    """Position ids `[B, T]` -> (cos, sin) `[B, T, rotary_dim]` in fp32 (the frequencies twice, halves layout),
    times the YaRN attention factor where there is one."""

    def __init__(
        self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position_embeddings: int = 0
    ) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(rotary_dim, theta, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """Keeps `inv_freq` fp32 through `model.to(bfloat16)`: rounded to bf16 (up to 2^-8 relative), position x
        frequency drifts by up to ~0.1 rad at position 60, and the local engine (built in `model.dtype`) then
        rotated differently from the trainer (fp32 masters under FSDP2): all of dsa-tiny's bf16 step-0
        `mismatch_kl` (5e-4, issue 41) and part of the dense models' (5e-5). Devices still move; a meta tensor
        stays as cast."""
        freq = self.inv_freq
        out = super()._apply(fn, recurse)
        lowered = self.inv_freq.dtype in (torch.float16, torch.bfloat16)
        if lowered and freq.dtype == torch.float32 and not freq.is_meta and not self.inv_freq.is_meta:
            self.inv_freq = freq.to(self.inv_freq.device)
        return out

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()  # [B, T, D]
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves of `x [B, H, T, D]` (cos/sin broadcast over the heads); when `cos` covers fewer than D
    dimensions (partial rotary), on those first dimensions only."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
