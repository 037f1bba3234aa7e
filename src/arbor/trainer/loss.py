"""Policy losses behind one typed protocol (`LossFn`), the wrappers that apply to any loss (the decoupled off-policy
objective with its behaviour corrections, KL to a reference model), and loading a user loss by dotted path.

A loss returns the SUM of its per-token loss times `ctx.loss_weights` over the loss tokens; the loop divides by the
step's loss-token count. The built-ins are listed in arbor.registry.LOSSES; their formulas, the off-policy
objective, the top-k distillation estimator and the metric convention: docs/training.md, "Losses".
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from arbor.config.trainer import LossConfig
from arbor.registry import LOSSES
from arbor.trainer.off_policy import mismatch_weights, ratio_mask_weights, sample_age, staleness_weights


@dataclasses.dataclass
class LossOutput:
    loss_sum: torch.Tensor
    """Weighted sum of the per-token loss over loss tokens (0-d, differentiable)."""
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """0-d tensors: sums over loss tokens, or `*_max` / `*_min` extrema (see the module docstring)."""


@dataclasses.dataclass
class LossContext:
    """Per-row facts beyond the per-token tensors. All tensors live on the loss's device."""

    seq_lens: torch.Tensor
    """`[S]` lengths of the packed samples, in order; their sum may be below the row length (padding)."""
    loss_weights: torch.Tensor | None = None
    """`[T]` per-token multipliers of the loss (normalisation, importance weights); None means all ones."""
    ref_logprobs: torch.Tensor | None = None
    """`[T]` logprobs under the frozen reference model (present when `kl_coef > 0`)."""
    proximal_logprobs: torch.Tensor | None = None
    """`[T]` the proximal policy's logprobs (no gradient); None: the current logprobs, detached."""
    policy_versions: torch.Tensor | None = None
    """`[T]` the policy version that sampled each token (-1: none); needed by `loss.max_staleness`."""
    step: int = 0
    """The step being trained (the age of a sample is `step` minus its first token's version)."""
    teacher_logprobs: torch.Tensor | None = None
    """`[T]` a distillation teacher's logprobs of the tokens (present with `[orchestrator.teacher]`)."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """`[T, k]` the teacher's logprobs of its k most likely tokens where each token is predicted (with
    `orchestrator.teacher.top_k`); `student_topk_logprobs` and `sampled_in_topk` come with it."""
    student_topk_logprobs: torch.Tensor | None = None
    """`[T, k]` the policy's logprobs (with gradient) of the teacher's top-k tokens."""
    sampled_in_topk: torch.Tensor | None = None
    """`[T]` bool: whether the sampled token is one of the teacher's top-k."""

    @classmethod
    def single(cls, n: int, device: torch.device | str = "cpu") -> "LossContext":
        """A row holding one sample of `n` tokens."""
        return cls(torch.tensor([n], device=device))

    def sample_index(self, n: int) -> torch.Tensor:
        """`[n]` index of the sample each token belongs to; padding tokens get index S (one past the last)."""
        lens = self.seq_lens.to(torch.long)
        idx = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
        pad = torch.full((n - idx.numel(),), lens.numel(), dtype=torch.long, device=lens.device)
        return torch.cat([idx, pad])

    def segment_sum(self, x: torch.Tensor) -> torch.Tensor:
        """`[S + 1]` per-sample sums of the per-token `x` (the last entry collects padding)."""
        idx = self.sample_index(x.shape[0]).to(x.device)
        return torch.zeros(self.seq_lens.numel() + 1, dtype=x.dtype, device=x.device).index_add(0, idx, x)

    def weights(self, like: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(like) if self.loss_weights is None else self.loss_weights.to(like.dtype)


@runtime_checkable
class LossFn(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        inference_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        cfg: LossConfig,
        ctx: LossContext | None = None,
    ) -> LossOutput:
        """All tensors are `[T]` for one packed row; `logprobs` carries the gradient, `loss_mask` is bool.
        `ctx` None means one sample spanning the row with unit weights."""
        ...


def _ctx(ctx: LossContext | None, like: torch.Tensor) -> LossContext:
    return ctx if ctx is not None else LossContext.single(like.shape[0], like.device)


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    """Weighted sum over loss tokens; masked tokens contribute exactly zero (even if their value is inf/nan)."""
    weighted = per_token * ctx.weights(per_token)
    return torch.where(mask, weighted, torch.zeros_like(weighted)).sum()


def _count(flags: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return flags.sum().to(dtype)


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


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate `-min(r*A, clip(r, 1-low, 1+high)*A)` per token, and which tokens it clipped
    (the clipped branch is the smaller one, so the token passes no gradient)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped) & mask


def ppo_clip(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
    """Token-level PPO clip: `-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)`, r = exp(logprobs - inference)."""
    ctx, mask = _ctx(ctx, logprobs), loss_mask.bool()
    ratio = torch.exp(logprobs - inference_logprobs)
    per_token, is_clipped = _clipped_surrogate(ratio, advantages, cfg.clip_low, cfg.clip_high, mask)
    return LossOutput(
        _reduce(per_token, mask, ctx), {"clip_frac": _count(is_clipped, logprobs.dtype), **_ratio_stats(ratio, mask)}
    )


def is_mask(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
    """Importance-sampling with a trust-region mask: `-r*A` on tokens whose r lies in [1-clip_low, 1+clip_high],
    other tokens dropped (they still count in the normaliser); the gradient flows only through r."""
    ctx, mask = _ctx(ctx, logprobs), loss_mask.bool()
    ratio = torch.exp(logprobs - inference_logprobs)
    r = ratio.detach()
    keep = (r >= 1.0 - cfg.clip_low) & (r <= 1.0 + cfg.clip_high) & mask
    per_token = -ratio * advantages
    loss_sum = _reduce(per_token, keep, ctx)
    masked = mask & ~keep
    return LossOutput(loss_sum, {"masked_frac": _count(masked, logprobs.dtype), **_ratio_stats(ratio, mask)})


def gspo(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
    """GSPO: the sample's ratio s = exp(mean over its loss tokens of (logprobs - old)), clipped to
    [1-gspo_clip_low, 1+gspo_clip_high]; each loss token carries `-min(s*A_t, clip(s)*A_t)`. `build_loss` passes
    the proximal logprobs as old (`LossConfig.decoupled`): the band is meant for one update."""
    ctx, mask = _ctx(ctx, logprobs), loss_mask.bool()
    m = mask.to(logprobs.dtype)
    log_r = torch.where(mask, logprobs - inference_logprobs, torch.zeros_like(logprobs))
    seq_log = ctx.segment_sum(log_r) / ctx.segment_sum(m).clamp(min=1.0)
    s = torch.exp(seq_log)[ctx.sample_index(logprobs.shape[0]).to(logprobs.device)]
    per_token, is_clipped = _clipped_surrogate(s, advantages, cfg.gspo_clip_low, cfg.gspo_clip_high, mask)
    return LossOutput(
        _reduce(per_token, mask, ctx), {"clip_frac": _count(is_clipped, logprobs.dtype), **_ratio_stats(s, mask)}
    )


def cispo(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
    """CISPO: `-sg(clip(r, 1-cispo_clip_low, 1+cispo_clip_high)) * A * logprobs`; every token keeps a gradient
    (the clip bounds the weight, it never drops the token as PPO's clip does)."""
    ctx, mask = _ctx(ctx, logprobs), loss_mask.bool()
    ratio = torch.exp(logprobs - inference_logprobs).detach()
    weight = ratio.clamp(1.0 - cfg.cispo_clip_low, 1.0 + cfg.cispo_clip_high)
    per_token = -weight * advantages * logprobs
    is_clipped = (weight != ratio) & mask
    return LossOutput(
        _reduce(per_token, mask, ctx), {"clip_frac": _count(is_clipped, logprobs.dtype), **_ratio_stats(ratio, mask)}
    )


def opmd(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
    """OPMD (Trinity-RFT appendix A.3): `-A * logprobs / (1 + opmd_tau)`, A the group-mean-baselined reward;
    valid off-policy by its mirror-descent derivation, so it takes no importance ratio."""
    ctx, mask = _ctx(ctx, logprobs), loss_mask.bool()
    per_token = -advantages * logprobs / (1.0 + cfg.opmd_tau)
    ratio = torch.exp(logprobs - inference_logprobs)
    return LossOutput(_reduce(per_token, mask, ctx), _ratio_stats(ratio, mask))


def cross_entropy(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
    """Supervised cross-entropy `-logprobs` on the loss tokens (SFT); advantages and inference logprobs unused."""
    ctx, mask = _ctx(ctx, logprobs), loss_mask.bool()
    return LossOutput(_reduce(-logprobs, mask, ctx))


def reverse_kl_to_teacher(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, cfg: LossConfig, ctx: LossContext
) -> LossOutput:
    """`distill_coef` times the per-token reverse KL(pi_theta || pi_teacher) on the policy's own samples.

    The estimator is k1 = log pi_theta - log pi_teacher, used as a score-function (REINFORCE) term: the value per
    token is k1 and its gradient `sg(k1) * grad log pi_theta`, the per-token (no credit to later tokens) gradient
    of the reverse KL, as on-policy distillation does (Agarwal et al. 2024, GKD; Thinking Machines 2025). Why k1
    and not k3 = exp(-k1) + k1 - 1: on samples of pi_theta, differentiating k3 through log pi_theta gives
    `(1 - pi_teacher / pi_theta) grad log pi_theta`, whose expectation is the gradient of the FORWARD KL
    (mode-covering), and differentiating k1 directly gives `grad log pi_theta`, zero in expectation; only k1
    with its value held as a weight follows the reverse KL (mode-seeking). Both are reported: `reverse_kl` (k1,
    unbiased, a token may be negative) and `reverse_kl_k3` (non-negative, lower variance). The samples are
    taken as the policy's own: with an async lag the behaviour gap is what `mismatch_kl` shows, and a mismatch
    correction (under `with_off_policy`) weighs this term's tokens as it weighs the policy loss's. With the
    teacher's top-k in `ctx` the sum over those k tokens is taken exactly (`_topk_reverse_kl`, the module
    docstring's top-k estimator) and `reverse_kl` reports that estimate; `reverse_kl_k3` stays the sampled
    token's."""
    if ctx.teacher_logprobs is None:
        if bool(loss_mask.any()):
            raise ValueError(
                "loss.distill_weight > 0 (or loss.name = 'distill') needs the teacher's logprobs in the "
                "batch: set [orchestrator.teacher] (or rl's [teacher])"
            )
        return LossOutput(logprobs.sum() * 0.0)  # an empty padding row: nothing to distil
    mask = loss_mask.bool()
    teacher = ctx.teacher_logprobs.to(logprobs.dtype)
    k1 = torch.where(mask, logprobs - teacher, torch.zeros_like(logprobs)).detach()
    per_token = k1 * (logprobs - logprobs.detach()) + k1  # value k1, gradient k1 * grad log pi_theta
    k3 = torch.expm1(-k1) + k1
    metrics = {"distill/reverse_kl_k3_sum": torch.where(mask, k3, torch.zeros_like(k3)).sum()}
    if ctx.teacher_topk_logprobs is not None:
        per_token, topk_metrics = _topk_reverse_kl(per_token, mask, ctx)
        metrics.update(topk_metrics)
    metrics["distill/reverse_kl_sum"] = torch.where(mask, per_token, torch.zeros_like(per_token)).sum().detach()
    return LossOutput(cfg.distill_coef * _reduce(per_token, mask, ctx), metrics)


def _topk_reverse_kl(
    sampled_term: torch.Tensor, mask: torch.Tensor, ctx: LossContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The top-k estimator (module docstring): the sampled-token term kept where the sample is outside the
    teacher's top-k, plus the exact sum over the top-k of `p(i) sg(k1(i))`; with the student's mass on the
    top-k and the teacher's as figures."""
    student = ctx.student_topk_logprobs
    if student is None or ctx.sampled_in_topk is None:
        raise ValueError("LossContext.teacher_topk_logprobs needs student_topk_logprobs and sampled_in_topk")
    keep = mask[:, None]
    student = torch.where(keep, student, torch.zeros_like(student))
    teacher = torch.where(keep, ctx.teacher_topk_logprobs.to(student.dtype), torch.zeros_like(student))
    p = student.exp()
    exact = (p * (student - teacher).detach()).sum(-1)
    tail = torch.where(ctx.sampled_in_topk, torch.zeros_like(sampled_term), sampled_term)
    zero = torch.zeros_like(exact)
    return tail + exact, {
        "distill/student_topk_mass_sum": torch.where(mask, p.detach().sum(-1), zero).sum(),
        "distill/teacher_topk_mass_sum": torch.where(mask, teacher.exp().sum(-1), zero).sum(),
    }


def distill(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
    """Pure on-policy distillation: the reverse KL to the teacher alone (`reverse_kl_to_teacher`); advantages
    and rewards unused."""
    return reverse_kl_to_teacher(logprobs, loss_mask, cfg, _ctx(ctx, logprobs))


def with_distill(inner: LossFn) -> LossFn:
    """Adds the reverse KL to the teacher (`reverse_kl_to_teacher`, weight `distill_weight`) to any loss."""

    def distilled(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
        ctx = _ctx(ctx, logprobs)
        out = inner(logprobs, inference_logprobs, advantages, loss_mask, cfg, ctx)
        term = reverse_kl_to_teacher(logprobs, loss_mask, cfg, ctx)
        out.loss_sum = out.loss_sum + term.loss_sum
        out.metrics.update(term.metrics)
        return out

    distilled.__name__ = f"{getattr(inner, '__name__', 'loss')}+distill"
    return distilled


def with_off_policy(inner: LossFn) -> LossFn:
    """Wraps any loss in the decoupled objective (see the module docstring): the inner loss's ratio is taken
    against the proximal policy when `cfg.decoupled`, else against the behaviour policy, and the behaviour
    correction, ratio mask and staleness weights (detached) multiply `ctx.loss_weights`."""

    def off_policy(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
        ctx, mask = _ctx(ctx, logprobs), loss_mask.bool()
        proximal = logprobs.detach() if ctx.proximal_logprobs is None else ctx.proximal_logprobs.to(logprobs.dtype)
        log_r = torch.where(mask, proximal - inference_logprobs, torch.zeros_like(logprobs))
        w, metrics = torch.ones_like(log_r), {}
        if cfg.mismatch_correction != "none":
            c, m = mismatch_weights(log_r, mask, cfg, ctx)
            w, metrics = w * c, {**metrics, **m}
        if cfg.ratio_mask != "none":
            c, m = ratio_mask_weights(log_r, mask, cfg, ctx)
            w, metrics = w * c, {**metrics, **m}
        if cfg.max_staleness is not None:
            if ctx.policy_versions is None:
                raise ValueError("loss.max_staleness needs the tokens' policy versions in LossContext.policy_versions")
            age = sample_age(ctx.policy_versions.to(logprobs.device), ctx.step, ctx)
            c, m = staleness_weights(age, mask, cfg, logprobs.dtype)
            w, metrics = w * c, {**metrics, **m}
        old = proximal if cfg.decoupled else inference_logprobs
        inner_ctx = dataclasses.replace(ctx, loss_weights=ctx.weights(logprobs) * w)
        out = inner(logprobs, old, advantages, loss_mask, cfg, inner_ctx)
        out.metrics.update(metrics)
        return out

    off_policy.__name__ = f"{getattr(inner, '__name__', 'loss')}+off_policy"
    return off_policy


def with_reference_kl(inner: LossFn) -> LossFn:
    """Adds `kl_coef * k3` per loss token, k3 = exp(ref - lp) - (ref - lp) - 1 (an unbiased, non-negative
    estimator of KL(policy || reference) whose gradient pulls the policy toward the reference)."""

    def regularised(logprobs, inference_logprobs, advantages, loss_mask, cfg: LossConfig, ctx=None) -> LossOutput:
        if ctx is None or ctx.ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs the reference model's logprobs in LossContext.ref_logprobs")
        mask = loss_mask.bool()
        out = inner(logprobs, inference_logprobs, advantages, loss_mask, cfg, ctx)
        d = torch.where(mask, ctx.ref_logprobs - logprobs, torch.zeros_like(logprobs))
        k3 = torch.expm1(d) - d
        out.loss_sum = out.loss_sum + cfg.kl_coef * _reduce(k3, mask, ctx)
        out.metrics["kl_ref_sum"] = torch.where(mask, k3, torch.zeros_like(k3)).sum().detach()
        return out

    regularised.__name__ = f"{getattr(inner, '__name__', 'loss')}+kl"
    return regularised


def accepts_ctx(fn: Callable) -> bool:
    """Whether a loss takes the optional `ctx` argument (built-ins do; a five-argument user loss does not)."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:
        return False
    return "ctx" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _legacy(fn: Callable) -> LossFn:
    """Adapts a five-argument user loss: it cannot apply per-token weights, so non-unit weights are an error."""

    def adapted(logprobs, inference_logprobs, advantages, loss_mask, cfg, ctx=None) -> LossOutput:
        if ctx is not None and ctx.loss_weights is not None and not bool((ctx.loss_weights == 1).all()):
            raise ValueError(
                f"loss {getattr(fn, '__name__', fn)!r} takes no `ctx` argument, so it cannot apply per-token loss "
                "weights (sequence/group normalisation or mismatch correction): add `ctx=None` to its signature"
            )
        return fn(logprobs, inference_logprobs, advantages, loss_mask, cfg)

    adapted.__name__ = getattr(fn, "__name__", "loss")
    adapted.__wrapped__ = fn  # type: ignore[attr-defined]
    return adapted


def resolve_loss(name: str) -> LossFn:
    """A built-in loss by name, or a user function `package.module:function` with the LossFn signature (the
    `ctx` argument optional)."""
    fn = LOSSES.load(name)
    if name in LOSSES.members:
        return fn
    if not callable(fn):
        raise TypeError(f"loss {name!r} is not callable")
    try:
        inspect.signature(fn).bind(None, None, None, None, None)
    except TypeError as e:
        raise TypeError(
            f"loss {name!r} must accept (logprobs, inference_logprobs, advantages, loss_mask, cfg[, ctx]): {e}"
        ) from None
    except ValueError:  # builtins without a signature: trust the caller
        return fn
    return fn if accepts_ctx(fn) else _legacy(fn)


def build_loss(cfg: LossConfig) -> LossFn:
    """The configured loss with its wrappers: the distillation term innermost (so a mismatch correction weighs
    it too), then the off-policy objective (unless the loss is the coupled objective with no weight to apply:
    then it sees the behaviour logprobs directly), then the reference KL."""
    fn = resolve_loss(cfg.name)
    if cfg.name != "distill" and cfg.distill_coef > 0:
        fn = with_distill(fn)
    if cfg.decoupled or cfg.ratio_mask != "none" or cfg.max_staleness is not None:
        fn = with_off_policy(fn)
    if cfg.kl_coef > 0:
        fn = with_reference_kl(fn)
    return fn
