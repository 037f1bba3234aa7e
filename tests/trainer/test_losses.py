"""Each loss of the GRPO family against a hand-computed example, the wrappers (TIS/MIS, reference KL), the
explicit per-token weights, the `ctx`-taking user-loss contract, and the KL reference inside the trainer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from arbor.config.trainer import LossConfig
from arbor.trainer.loss import (
    LossContext,
    LossOutput,
    build_loss,
    cispo,
    cross_entropy,
    gspo,
    opmd,
    ppo_clip,
    resolve_loss,
)


def _inputs():
    ratios = torch.tensor([1.0, 1.5, 0.5, 1.2, 3.0])
    logprobs = torch.log(ratios).requires_grad_(True)
    return (
        logprobs,
        torch.zeros(5),
        torch.tensor([1.0, 1.0, -1.0, 2.0, 1.0]),
        torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool),
    )


def test_ppo_clip_applies_per_token_weights():
    lp, inf, adv, mask = _inputs()
    ctx = LossContext(torch.tensor([5]), torch.tensor([2.0, 1.0, 1.0, 0.5, 9.0]))
    out = ppo_clip(lp, inf, adv, mask, LossConfig(), ctx)
    # unweighted per token: -1, -1.28, +0.8, -2.4, (masked) -> weighted: -2, -1.28, +0.8, -1.2
    assert out.loss_sum.item() == pytest.approx(-2.0 - 1.28 + 0.8 - 1.2, abs=1e-6)


def test_gspo_uses_the_geometric_mean_ratio_per_sample():
    # Two samples packed in one row plus one padding token: sample A = tokens 0-2 (token 0 is its prompt), B = 3-4.
    lp = torch.log(torch.tensor([1.0, 1.2, 1.0 / 1.2 * 1.0, 2.0, 2.0, 1.0])).requires_grad_(True)
    inf = torch.zeros(6)
    adv = torch.tensor([0.0, 1.0, 1.0, -1.0, -1.0, 0.0])
    mask = torch.tensor([0, 1, 1, 1, 1, 0], dtype=torch.bool)
    ctx = LossContext(torch.tensor([3, 2]))
    cfg = LossConfig(gspo_clip_low=0.1, gspo_clip_high=0.1)
    out = gspo(lp, inf, adv, mask, cfg, ctx)
    # A: log ratios 0.1823, -0.1823 -> s = 1, unclipped: per token -1 (x2).
    # B: s = 2, A = -1: -min(-2, -1.1) = 2 per token (x2), clipped branch is larger so this is the unclipped one.
    assert out.loss_sum.item() == pytest.approx(-2.0 + 4.0, abs=1e-5)
    assert out.metrics["clip_frac"].item() == 0
    out.loss_sum.backward()
    # A: d(-s*A)/d lp_t summed over 2 tokens, s = exp(mean) -> each lp_t gets -(1 * 1 * 2 tokens)/2 = -1.
    # B: each token's loss 2*... = -s*A with s=2, A=-1 -> grad per lp_t = 2 tokens * (s*1)/2 = 2.
    assert torch.allclose(lp.grad, torch.tensor([0.0, -1.0, -1.0, 2.0, 2.0, 0.0]), atol=1e-5)
    # With positive advantages the upper clip bites: s = 2 > 1.1 -> loss -1.1 per token, no gradient.
    lp2 = lp.detach().clone().requires_grad_(True)
    out2 = gspo(lp2, inf, adv.abs(), mask, cfg, ctx)
    assert out2.loss_sum.item() == pytest.approx(-2.0 - 2.2, abs=1e-5)
    assert out2.metrics["clip_frac"].item() == 2
    out2.loss_sum.backward()
    assert torch.allclose(lp2.grad[3:5], torch.zeros(2))


def test_cispo_keeps_gradient_through_clipped_tokens():
    lp, inf, adv, mask = _inputs()
    out = cispo(lp, inf, adv, mask, LossConfig(cispo_clip_low=0.2, cispo_clip_high=0.28))
    w = torch.tensor([1.0, 1.28, 0.8, 1.2])
    logs = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.2]))
    a = torch.tensor([1.0, 1.0, -1.0, 2.0])
    assert out.loss_sum.item() == pytest.approx(float(-(w * a * logs).sum()), abs=1e-6)
    assert out.metrics["clip_frac"].item() == 2
    out.loss_sum.backward()
    # The weight is a constant: d/d lp = -w*A, also on the clipped tokens 1 and 2 (unlike PPO).
    assert torch.allclose(lp.grad, torch.tensor([-1.0, -1.28, 0.8, -2.4, 0.0]), atol=1e-6)


def test_opmd_and_cross_entropy():
    lp, inf, adv, mask = _inputs()
    out = opmd(lp, inf, adv, mask, LossConfig(opmd_tau=1.0))
    logs = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.2]))
    assert out.loss_sum.item() == pytest.approx(
        float(-(torch.tensor([1.0, 1.0, -1.0, 2.0]) * logs).sum() / 2), abs=1e-6
    )
    out.loss_sum.backward()
    assert torch.allclose(lp.grad, torch.tensor([-0.5, -0.5, 0.5, -1.0, 0.0]))
    lp2 = torch.log(torch.tensor([0.5, 0.25, 1.0, 0.1, 0.1])).requires_grad_(True)
    ce = cross_entropy(lp2, inf, adv, mask, LossConfig())
    assert ce.loss_sum.item() == pytest.approx(math.log(2) + math.log(4) + 0 + math.log(10), abs=1e-6)


def test_tis_truncates_and_mis_masks_the_mismatch_ratio():
    # trainer logprobs vs inference: ratios 1, 1.5, 0.5, 3 (token 4 masked).
    lp = torch.log(torch.tensor([1.0, 1.5, 0.5, 3.0, 1.0])).requires_grad_(True)
    inf, adv = torch.zeros(5), torch.tensor([1.0, 1.0, -1.0, 2.0, 1.0])
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    tis = build_loss(LossConfig(mismatch_correction="tis", mismatch_cap=2.0))
    out = tis(lp, inf, adv, mask, LossConfig(mismatch_correction="tis", mismatch_cap=2.0), LossContext.single(5))
    # Inner PPO sees ratio 1 everywhere: per token -A; weights min(r, 2) = 1, 1.5, 0.5, 2.
    assert out.loss_sum.item() == pytest.approx(-1.0 - 1.5 + 0.5 - 4.0, abs=1e-6)
    assert out.metrics["mismatch_flagged"].item() == 1
    out.loss_sum.backward()
    assert torch.allclose(lp.grad, torch.tensor([-1.0, -1.5, 0.5, -4.0, 0.0]), atol=1e-6)
    cfg = LossConfig(mismatch_correction="mis", mismatch_low=0.6, mismatch_cap=2.0)
    out = build_loss(cfg)(lp, inf, adv, mask, cfg, LossContext.single(5))
    # r = 0.5 and r = 3 fall outside [0.6, 2]: only tokens 0 and 1 remain, each -A weighted by its ratio (masked
    # importance sampling: a kept token is corrected by r, not passed with weight 1).
    assert out.loss_sum.item() == pytest.approx(-1.0 * 1.0 - 1.5 * 1.0, abs=1e-6)
    assert out.metrics["mismatch_flagged"].item() == 2
    # Sequence level: one sample's geometric mean ratio = (1*1.5*0.5*3)^(1/4) = 1.0606 -> kept whole, weight 1.0606.
    cfg = LossConfig(mismatch_correction="mis", mismatch_level="sequence", mismatch_low=0.6, mismatch_cap=2.0)
    out = build_loss(cfg)(lp, inf, adv, mask, cfg, LossContext.single(5))
    assert out.loss_sum.item() == pytest.approx(2.25**0.25 * (-1.0 - 1.0 + 1.0 - 2.0), abs=1e-6)


def test_reference_kl_adds_k3_and_needs_reference_logprobs():
    lp = torch.log(torch.tensor([0.5, 0.25, 0.8])).requires_grad_(True)
    ref = torch.log(torch.tensor([0.25, 0.25, 0.4]))
    mask = torch.tensor([1, 1, 0], dtype=torch.bool)
    cfg = LossConfig(name="cross_entropy", kl_coef=0.5)
    fn = build_loss(cfg)
    ctx = LossContext(torch.tensor([3]), None, ref)
    out = fn(lp, torch.zeros(3), torch.zeros(3), mask, cfg, ctx)
    # k3 with d = ref - lp: token 0: d = log 0.5 -> 0.5 - 1 - log 0.5 = 0.19315; token 1: 0.
    k3 = 0.5 - 1 - math.log(0.5)
    assert out.loss_sum.item() == pytest.approx(math.log(2) + math.log(4) + 0.5 * k3, abs=1e-6)
    assert out.metrics["kl_ref_sum"].item() == pytest.approx(k3, abs=1e-6)
    with pytest.raises(ValueError, match="reference"):
        fn(lp, torch.zeros(3), torch.zeros(3), mask, cfg, LossContext.single(3))


def user_ctx_loss(logprobs, inference_logprobs, advantages, loss_mask, cfg, ctx=None) -> LossOutput:
    """A user loss that takes ctx: the number of samples in the row, times the plain PPO loss."""
    out = ppo_clip(logprobs, inference_logprobs, advantages, loss_mask, cfg, ctx)
    return LossOutput(out.loss_sum * len(ctx.seq_lens), {"samples": torch.tensor(float(len(ctx.seq_lens)))})


def five_arg_loss(logprobs, inference_logprobs, advantages, loss_mask, cfg) -> LossOutput:
    return ppo_clip(logprobs, inference_logprobs, advantages, loss_mask, cfg)


def test_user_losses_by_dotted_path_with_and_without_ctx():
    lp, inf, adv, mask = _inputs()
    base = ppo_clip(lp, inf, adv, mask, LossConfig()).loss_sum.item()
    user = resolve_loss("test_losses:user_ctx_loss")
    assert user is user_ctx_loss  # it takes ctx: used as is
    assert user(lp, inf, adv, mask, LossConfig(), LossContext(torch.tensor([2, 3]))).loss_sum.item() == pytest.approx(
        2 * base
    )
    legacy = resolve_loss("test_losses:five_arg_loss")
    assert legacy(lp, inf, adv, mask, LossConfig(), LossContext.single(5)).loss_sum.item() == pytest.approx(base)
    with pytest.raises(ValueError, match="cannot apply per-token loss weights"):
        legacy(lp, inf, adv, mask, LossConfig(), LossContext(torch.tensor([5]), torch.full((5,), 0.5)))
    for name in ("gspo", "cispo", "opmd", "cross_entropy"):
        assert callable(resolve_loss(name))


def test_mismatch_bounds_are_validated():
    with pytest.raises(ValueError, match="mismatch_low"):
        LossConfig(mismatch_low=3.0, mismatch_cap=2.0)


def test_trainer_with_kl_reference_and_gspo(tmp_path: Path):
    from test_trainer import read_metrics, trainer_args, write_rollouts

    from arbor.trainer.main import main as trainer_main

    write_rollouts({1: tmp_path}, 2)
    rc = trainer_main(trainer_args(tmp_path, 2, "--loss.name", "gspo", "--loss.kl-coef", "0.1", "--ckpt.interval", "5"))
    assert rc == 0
    m = read_metrics(tmp_path)
    # The reference is the initial weights: before the first update the policy equals it, so KL is 0; after, > 0.
    assert m[0]["loss/kl_ref_mean"] == pytest.approx(0.0, abs=1e-6)
    assert m[1]["loss/kl_ref_mean"] > 1e-7
    assert all(math.isfinite(r["loss"]) for r in m)
