"""Policy losses behind one typed protocol, a registry of built-ins, and loading a user loss by dotted path.

A loss sees one packed micro-batch as flat per-token tensors and returns the SUM of its per-token loss over
the loss tokens; the RL loop divides by the step's global loss-token count, so every built-in is a token-level
mean over the whole step (DAPO-style normalisation), independent of how samples were packed or sharded.

Metric convention: every value in `LossOutput.metrics` is a 0-d tensor. A key ending in `_max` (`_min`) is
reduced by maximum (minimum) over micro-batches and ranks; any other key is a SUM over loss tokens that the loop
divides by the step's loss-token count (so `clip_frac` reports the fraction of clipped tokens), renaming a
trailing `_sum` to `_mean`. The loop logs them as `loss/<key>` (`loss/clip_frac`, `loss/ratio_mean`, ...).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Protocol, runtime_checkable

import torch

from arbor.config.trainer import LossConfig


@dataclasses.dataclass
class LossOutput:
    loss_sum: torch.Tensor
    """Sum of the per-token loss over loss tokens (0-d, differentiable)."""
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """0-d tensors: sums over loss tokens, or `*_max` / `*_min` extrema (see the module docstring)."""


@runtime_checkable
class LossFn(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        inference_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        cfg: LossConfig,
    ) -> LossOutput:
        """All tensors are `[T]` for one packed row; `logprobs` carries the gradient, `loss_mask` is bool."""
        ...


def _ratio_stats(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    # Masked-out tokens get +-inf so that they never win a max/min; a row with no loss token reports -inf/inf,
    # which the loop's cross-micro-batch reduction then ignores (no host sync needed here).
    r = ratio.detach()
    inf = torch.full_like(r, float("inf"))
    return {
        "ratio_sum": torch.where(mask, r, torch.zeros_like(r)).sum(),
        "ratio_max": torch.where(mask, r, -inf).max(),
        "ratio_min": torch.where(mask, r, inf).min(),
    }


def ppo_clip(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
) -> LossOutput:
    """Token-level PPO clip: `-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)`, r = exp(logprobs - inference)."""
    mask = loss_mask.bool()
    ratio = torch.exp(logprobs - inference_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss_sum = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()
    # A token is "clipped" when the clipped branch is the smaller one, i.e. it passes no gradient.
    is_clipped = (clipped < unclipped) & mask
    return LossOutput(loss_sum, {"clip_frac": is_clipped.sum().to(logprobs.dtype), **_ratio_stats(ratio, mask)})


def is_mask(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
) -> LossOutput:
    """Importance-sampling with a trust-region mask: `-r*A` on tokens whose r lies in [1-clip_low, 1+clip_high],
    other tokens dropped (they still count in the normaliser); the gradient flows only through r."""
    mask = loss_mask.bool()
    ratio = torch.exp(logprobs - inference_logprobs)
    r = ratio.detach()
    keep = (r >= 1.0 - cfg.clip_low) & (r <= 1.0 + cfg.clip_high) & mask
    per_token = -ratio * advantages
    loss_sum = torch.where(keep, per_token, torch.zeros_like(per_token)).sum()
    masked = mask & ~keep
    return LossOutput(loss_sum, {"masked_frac": masked.sum().to(logprobs.dtype), **_ratio_stats(ratio, mask)})


LOSSES: dict[str, Callable[..., LossOutput]] = {"ppo_clip": ppo_clip, "is_mask": is_mask}


def resolve_loss(name: str) -> LossFn:
    """A built-in loss by name, or a user function `package.module:function` with the LossFn signature."""
    if name in LOSSES:
        return LOSSES[name]
    if ":" not in name and "." not in name:
        raise ValueError(f"unknown loss {name!r}: use one of {sorted(LOSSES)} or a dotted path 'module:function'")
    from arbor.environments.base import load_object

    fn = load_object(name)
    if not callable(fn):
        raise TypeError(f"loss {name!r} is not callable")
    try:
        inspect.signature(fn).bind(None, None, None, None, None)
    except TypeError as e:
        raise TypeError(
            f"loss {name!r} must accept (logprobs, inference_logprobs, advantages, loss_mask, cfg): {e}"
        ) from None
    except ValueError:  # builtins without a signature: trust the caller
        pass
    return fn
