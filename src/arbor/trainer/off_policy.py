"""The behaviour side of the decoupled off-policy objective (see arbor.trainer.loss): per-token weights, with no
gradient, that correct for the gap between the policy that sampled the tokens (the inference engine's, of some
older version) and the proximal policy that the loss's trust region is measured against.

All functions take flat per-token `[T]` tensors of one packed row and a `segments` object with the
`LossContext` segment helpers (`seq_lens`, `sample_index`, `segment_sum`), and return `[T]` weights plus 0-d
metric sums over loss tokens:
- `mismatch_weights`: TIS (Ionides' truncated IS, as "Your efficient RL framework secretly brings you
  off-policy RL training", Yao et al. 2025) `w = min(rho, C)`; MIS (masked IS: IcePop, Ling team 2025; verl's
  mask mode) `w = rho * 1{low <= rho <= C}`, per token or per sample with rho the sample's geometric-mean
  ratio `exp(mean_t log rho_t)` or its product `exp(sum_t log rho_t)` (the unbiased sequence ratio), computed
  in log space so that a long sample's ratio never overflows.
- `ratio_mask_weights`: rejection of outliers, `1{low <= rho_t <= high}` per token or
  `1{low <= exp(mean_t log rho_t) <= high}` per sample (verl's token and geometric rejection sampling).
- `staleness_weights`: a sample whose age (the training step minus its first token's policy version, queue time
  included) exceeds the bound is dropped, or weighted `decay^(age - bound)`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from arbor.config.trainer import LossConfig


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def sequence_log_ratio(log_r: torch.Tensor, mask: torch.Tensor, segments: Any, kind: str) -> torch.Tensor:
    """`[T]` log of each token's sample ratio: the mean ("geometric") or sum ("product") of the sample's token
    log-ratios over its loss tokens; `log_r` must be 0 off the loss mask."""
    total = segments.segment_sum(log_r)
    if kind == "geometric":
        total = total / segments.segment_sum(mask.to(log_r.dtype)).clamp(min=1.0)
    return total[segments.sample_index(log_r.shape[0]).to(log_r.device)]


def mismatch_weights(
    log_r: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, segments: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TIS or MIS weights from the behaviour log-ratios `log_r` (0 off the loss mask), see the module docstring."""
    if cfg.mismatch_level == "sequence":
        log_r = sequence_log_ratio(log_r, mask, segments, cfg.mismatch_sequence)
    log_cap = _log(cfg.mismatch_cap)
    if cfg.mismatch_correction == "tis":
        w = torch.exp(log_r.clamp(max=log_cap))
        flagged = (log_r > log_cap) & mask
    else:
        keep = (log_r >= _log(cfg.mismatch_low)) & (log_r <= log_cap)
        # exp only where kept: a dropped product ratio may be huge, and inf * 0 would be nan.
        w = torch.where(keep, torch.exp(log_r.clamp(max=log_cap)), torch.zeros_like(log_r))
        flagged = ~keep & mask
    zero = torch.zeros_like(w)
    return w, {
        "mismatch_weight_sum": torch.where(mask, w, zero).sum(),
        "mismatch_flagged": flagged.sum().to(w.dtype),
    }


def ratio_mask_weights(
    log_r: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, segments: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """1 where the token's (or its sample's geometric-mean) behaviour ratio lies within the ratio_mask bounds."""
    if cfg.ratio_mask == "sequence":
        log_r = sequence_log_ratio(log_r, mask, segments, "geometric")
    keep = (log_r >= _log(cfg.ratio_mask_low)) & (log_r <= _log(cfg.ratio_mask_high))
    return keep.to(log_r.dtype), {"ratio_masked": (~keep & mask).sum().to(log_r.dtype)}


def sample_age(policy_versions: torch.Tensor, step: int, segments: Any) -> torch.Tensor:
    """`[T]` age in steps of each token's sample: `step` minus the smallest policy version among the sample's
    tokens (its first generated token's; versions rise along a rollout). Tokens without a version (-1: prompt,
    environment text) are ignored; a sample with none has age 0."""
    n = policy_versions.shape[0]
    idx = segments.sample_index(n).to(policy_versions.device)
    v = policy_versions.to(torch.long)
    big = torch.iinfo(torch.long).max
    first = torch.full((segments.seq_lens.numel() + 1,), big, dtype=torch.long, device=v.device)
    first = first.scatter_reduce(0, idx, torch.where(v >= 0, v, torch.full_like(v, big)), reduce="amin")
    age = torch.where(first == big, torch.zeros_like(first), step - first)
    return age[idx]


def staleness_weights(
    age: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """1 up to `max_staleness`; beyond it 0 ("drop") or `stale_decay ** (age - max_staleness)` ("decay")."""
    bound = cfg.max_staleness
    over = (age > bound).to(dtype) * (age - bound).to(dtype)
    if cfg.stale_policy == "drop":
        w = (age <= bound).to(dtype)
    else:
        w = torch.pow(torch.tensor(cfg.stale_decay, dtype=dtype, device=age.device), over)
    return w, {"stale_tokens": ((age > bound) & mask).sum().to(dtype)}
