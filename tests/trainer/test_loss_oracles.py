"""Independent oracles for every loss and correction: each reference below is written from its paper's formula
as a plain loop over samples and tokens on Python/torch scalars (never calling arbor's vectorised code), and the
built loss must match its value and its gradient with respect to the logprobs within 1e-6 (float64) on random
packed rows: several samples per row, prompt tokens, padding, per-token advantages and loss weights, inference
logprobs that differ from the trainer's, and a proximal policy distinct from both; and through the model on a
prefix-tree merged row, against samples forwarded one by one."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_prefix_merge import tree_rollouts

from arbor.config.model import ModelConfig
from arbor.config.trainer import LossConfig
from arbor.models import build_model
from arbor.models.attention import position_ids_for
from arbor.orchestrator.batcher import sample_arrays
from arbor.orchestrator.prefix_tree import lexicographic_order, merge_row
from arbor.trainer.loss import LossContext, build_loss
from arbor.trainer.step import micro_batch_logprobs, packed_logprobs

F64 = torch.float64
CPU = torch.device("cpu")


def random_row(seed: int, proximal: bool) -> dict:
    """One packed row as a list of samples (the oracle's view) and as flat `[T]` tensors (the loss's view)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(rng.randint(2, 4)):
        p, c = rng.randint(1, 4), rng.randint(2, 6)
        n = p + c
        lp = [-rng.uniform(0.05, 3.0) for _ in range(n)]
        samples.append(
            {
                "mask": [False] * p + [rng.random() > 0.15 for _ in range(c)],  # some completion tokens untrained
                "lp": lp,
                "behav": [x + rng.gauss(0, 0.3) for x in lp],
                "prox": [x + rng.gauss(0, 0.1) for x in lp] if proximal else list(lp),
                "ref": [x + rng.gauss(0, 0.2) for x in lp],
                "adv": [rng.gauss(0, 1) for _ in range(n)],
                "w": [rng.uniform(0.2, 2.0) for _ in range(n)],
                "ver": [-1] * p + sorted(rng.randint(0, 5) for _ in range(c)),
            }
        )
    pad = rng.randint(0, 3)

    def flat(key: str, fill: float, dtype=F64) -> torch.Tensor:
        return torch.tensor([v for s in samples for v in s[key]] + [fill] * pad, dtype=dtype)

    row = {
        "samples": samples,
        "lp": flat("lp", -1.0).requires_grad_(True),
        "behav": flat("behav", -1.0),
        "prox": flat("prox", -1.0) if proximal else None,
        "ref": flat("ref", -1.0),
        "adv": flat("adv", 0.0),
        "mask": flat("mask", False, torch.bool),
        "ctx": None,
    }
    row["ctx"] = LossContext(
        torch.tensor([len(s["lp"]) for s in samples]),
        flat("w", 0.0),
        row["ref"],
        row["prox"],
        flat("ver", -1, torch.long),
        step=6,
    )
    return row


# --- the oracle ---------------------------------------------------------------------------------------------------


def token_loss(name: str, lp: torch.Tensor, old: float, a: float, cfg: LossConfig) -> torch.Tensor:
    """Per-token losses of the token-level papers, r = pi_theta / pi_old."""
    r = torch.exp(lp - old)
    if name == "ppo_clip":  # PPO (Schulman et al. 2017) with DAPO's asymmetric clip
        clipped = min(max(r.item(), 1 - cfg.clip_low), 1 + cfg.clip_high)
        return -r * a if r.item() * a <= clipped * a else -(r.detach() * 0 + clipped) * a
    if name == "is_mask":
        return -r * a if 1 - cfg.clip_low <= r.item() <= 1 + cfg.clip_high else r * 0
    if name == "cispo":  # MiniMax-M1: sg(clip(r)) * A * log pi
        weight = min(max(r.item(), 1 - cfg.cispo_clip_low), 1 + cfg.cispo_clip_high)
        return -weight * a * lp
    if name == "opmd":  # Trinity-RFT A.3
        return -a * lp / (1 + cfg.opmd_tau)
    if name == "cross_entropy":
        return -lp
    raise AssertionError(name)


def sample_ratio(log_ratios: list[float], kind: str) -> float:
    """log of the sequence ratio: mean (geometric mean of the ratios) or sum (their product)."""
    return sum(log_ratios) / len(log_ratios) if kind == "geometric" else sum(log_ratios)


def behaviour_weights(s: dict, cfg: LossConfig, step: int) -> list[float]:
    """Detached weights of the loss tokens of one sample, in order: mismatch correction, ratio mask, staleness."""
    idx = [t for t, m in enumerate(s["mask"]) if m]
    logs = [s["prox"][t] - s["behav"][t] for t in idx]
    out = [1.0] * len(idx)
    if cfg.mismatch_correction != "none":
        per = logs if cfg.mismatch_level == "token" else [sample_ratio(logs, cfg.mismatch_sequence)] * len(idx)
        for k, lr in enumerate(per):
            if cfg.mismatch_correction == "tis":  # min(rho, C), taken in log space
                out[k] *= math.exp(min(lr, math.log(cfg.mismatch_cap)))
            else:  # masked IS: rho inside [low, C], else 0
                inside = cfg.mismatch_low <= math.exp(min(lr, 50.0)) <= cfg.mismatch_cap
                out[k] *= math.exp(lr) if inside else 0.0
    if cfg.ratio_mask != "none":
        per = logs if cfg.ratio_mask == "token" else [sample_ratio(logs, "geometric")] * len(idx)
        for k, lr in enumerate(per):
            out[k] *= 1.0 if cfg.ratio_mask_low <= math.exp(lr) <= cfg.ratio_mask_high else 0.0
    if cfg.max_staleness is not None:
        versions = [v for v in s["ver"] if v >= 0]
        age = step - min(versions) if versions else 0
        if age > cfg.max_staleness:
            factor = 0.0 if cfg.stale_policy == "drop" else cfg.stale_decay ** (age - cfg.max_staleness)
            out = [w * factor for w in out]
    return out


def oracle(row: dict, cfg: LossConfig, lp_leaf: torch.Tensor) -> torch.Tensor:
    """The step's weighted loss sum for one row, sample by sample, token by token."""
    total = lp_leaf.new_zeros(())
    off = 0
    for s in row["samples"]:
        n = len(s["lp"])
        idx = [t for t in range(n) if s["mask"][t]]
        old = s["prox"] if cfg.decoupled else s["behav"]
        corr = behaviour_weights(s, cfg, row["ctx"].step) if build_wraps(cfg) else [1.0] * len(idx)
        if idx and cfg.name == "gspo":  # GSPO: one ratio per sample from the mean token log-ratio
            mean_log = sum(lp_leaf[off + t] - old[t] for t in idx) / len(idx)
            seq = torch.exp(mean_log)
        for k, t in enumerate(idx):
            lp, a = lp_leaf[off + t], s["adv"][t]
            if cfg.name == "gspo":
                clipped = min(max(seq.item(), 1 - cfg.gspo_clip_low), 1 + cfg.gspo_clip_high)
                f = -seq * a if seq.item() * a <= clipped * a else -(seq.detach() * 0 + clipped) * a
            else:
                f = token_loss(cfg.name, lp, old[t], a, cfg)
            total = total + s["w"][t] * corr[k] * f
            if cfg.kl_coef > 0:  # k3 = exp(d) - d - 1, d = log pi_ref - log pi_theta
                d = s["ref"][t] - lp
                total = total + cfg.kl_coef * s["w"][t] * (torch.exp(d) - d - 1)
        off += n
    return total


def build_wraps(cfg: LossConfig) -> bool:
    return cfg.decoupled or cfg.ratio_mask != "none" or cfg.max_staleness is not None


CASES = {
    "ppo_clip": dict(name="ppo_clip"),
    "dapo_clip_higher": dict(name="ppo_clip", clip_low=0.1, clip_high=0.3),
    "is_mask": dict(name="is_mask", clip_low=0.2, clip_high=0.3),
    "gspo": dict(name="gspo", gspo_clip_low=0.03, gspo_clip_high=0.04),
    "gspo_paper_band": dict(name="gspo"),
    "gspo_behaviour": dict(name="gspo", trust_region="behaviour", gspo_clip_low=0.05, gspo_clip_high=0.05),
    "cispo": dict(name="cispo", cispo_clip_low=0.2, cispo_clip_high=0.1),
    "opmd": dict(name="opmd", opmd_tau=0.5),
    "cross_entropy_kl": dict(name="cross_entropy", kl_coef=0.3),
    "ppo_kl": dict(name="ppo_clip", kl_coef=0.1),
    "tis_token": dict(mismatch_correction="tis", mismatch_cap=1.2),
    "mis_token": dict(mismatch_correction="mis", mismatch_low=0.8, mismatch_cap=1.25),
    "tis_sequence_geometric": dict(mismatch_correction="tis", mismatch_level="sequence", mismatch_cap=1.1),
    "tis_sequence_product": dict(
        mismatch_correction="tis", mismatch_level="sequence", mismatch_sequence="product", mismatch_cap=1.5
    ),
    "mis_sequence_geometric": dict(
        mismatch_correction="mis", mismatch_level="sequence", mismatch_low=0.9, mismatch_cap=1.1
    ),
    "mis_sequence_product": dict(
        mismatch_correction="mis",
        mismatch_level="sequence",
        mismatch_sequence="product",
        mismatch_low=0.5,
        mismatch_cap=2.0,
    ),
    "ratio_mask_token": dict(ratio_mask="token", ratio_mask_low=0.8, ratio_mask_high=1.2),
    "ratio_mask_sequence_tis": dict(
        ratio_mask="sequence", ratio_mask_low=0.9, ratio_mask_high=1.1, mismatch_correction="tis", mismatch_cap=1.3
    ),
    "staleness_drop": dict(max_staleness=3),
    "staleness_decay_cispo": dict(name="cispo", max_staleness=2, stale_policy="decay", stale_decay=0.5),
    "decoupled_ppo_no_correction": dict(trust_region="proximal"),
    "tis_cispo_kl": dict(name="cispo", mismatch_correction="tis", kl_coef=0.2),
}


@pytest.mark.parametrize("proximal", [False, True], ids=["one_step", "proximal"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_matches_its_oracle_in_value_and_gradient(case: str, proximal: bool) -> None:
    cfg = LossConfig(**CASES[case])
    for seed in range(6):
        row = random_row(seed * 31 + len(case), proximal)
        fn = build_loss(cfg)
        out = fn(row["lp"], row["behav"], row["adv"], row["mask"], cfg, row["ctx"])
        out.loss_sum.backward()
        leaf = row["lp"].detach().clone().requires_grad_(True)
        if not proximal:  # one optimizer step: the proximal policy is the current one
            for s, n0 in zip(row["samples"], _offsets(row["samples"])):
                s["prox"] = [leaf[n0 + t].item() for t in range(len(s["lp"]))]
        want = oracle(row, cfg, leaf)
        want.backward()
        assert out.loss_sum.item() == pytest.approx(want.item(), abs=1e-6), (case, seed)
        assert torch.allclose(row["lp"].grad, leaf.grad, atol=1e-6), (case, seed, row["lp"].grad - leaf.grad)


def _offsets(samples: list[dict]) -> list[int]:
    out, off = [], 0
    for s in samples:
        out.append(off)
        off += len(s["lp"])
    return out


def test_some_cases_actually_clip_mask_and_drop() -> None:
    """The random rows reach every branch: clipped tokens, masked ratios, dropped stale samples."""
    seen = {}
    for case, key in (
        ("ppo_clip", "clip_frac"),
        ("gspo", "clip_frac"),
        ("mis_token", "mismatch_flagged"),
        ("ratio_mask_token", "ratio_masked"),
        ("staleness_drop", "stale_tokens"),
        ("is_mask", "masked_frac"),
        ("cispo", "clip_frac"),
    ):
        cfg = LossConfig(**CASES[case])
        total = 0.0
        for seed in range(6):
            row = random_row(seed, True)
            total += (
                build_loss(cfg)(row["lp"], row["behav"], row["adv"], row["mask"], cfg, row["ctx"]).metrics[key].item()
            )
        seen[case] = total
    assert all(v > 0 for v in seen.values()), seen


def test_mis_weighs_a_kept_token_by_its_ratio_and_drops_the_rest() -> None:
    cfg = LossConfig(mismatch_correction="mis", mismatch_low=0.5, mismatch_cap=2.0)
    behav = torch.log(torch.tensor([0.5, 0.5, 0.5], dtype=F64))
    lp = torch.log(torch.tensor([0.6, 0.2, 0.95], dtype=F64)).requires_grad_(True)  # ratios 1.2, 0.4, 1.9
    mask = torch.ones(3, dtype=torch.bool)
    out = build_loss(cfg)(lp, behav, torch.ones(3, dtype=F64), mask, cfg, LossContext.single(3))
    out.loss_sum.backward()
    # One optimizer step: the inner PPO ratio is 1 with gradient d r / d lp = 1, so each token's gradient is -w.
    assert lp.grad.tolist() == pytest.approx([-1.2, 0.0, -1.9], abs=1e-12)
    assert out.metrics["mismatch_weight_sum"].item() == pytest.approx(3.1)


def test_product_sequence_ratio_is_capped_in_log_space() -> None:
    """A long sample whose product ratio overflows float64 gets the cap (tis) or is dropped (mis), never inf/nan."""
    n = 2000
    lp = torch.zeros(n, dtype=F64, requires_grad=True)
    behav = torch.full((n,), -0.5, dtype=F64)  # sum of log-ratios 1000: exp overflows
    mask = torch.ones(n, dtype=torch.bool)
    for correction, weight in (("tis", 3.0), ("mis", 0.0)):
        cfg = LossConfig(
            mismatch_correction=correction,
            mismatch_level="sequence",
            mismatch_sequence="product",
            mismatch_cap=3.0,
            mismatch_low=0.1,
        )
        out = build_loss(cfg)(lp, behav, torch.ones(n, dtype=F64), mask, cfg, LossContext.single(n))
        assert out.loss_sum.item() == pytest.approx(-weight * n)
        assert math.isfinite(out.metrics["mismatch_weight_sum"].item())


def test_staleness_counts_from_the_first_token_of_each_sample() -> None:
    """Age = step - version of the sample's first generated token: a sample begun at version 1 and finished at 5
    is 5 steps old at step 6, though its last tokens are 1 step old."""
    cfg = LossConfig(max_staleness=3)
    ctx = LossContext(torch.tensor([3, 3]), policy_versions=torch.tensor([-1, 1, 5, -1, 4, 5]), step=6)
    lp = torch.zeros(6, dtype=F64, requires_grad=True)
    mask = torch.tensor([False, True, True, False, True, True])
    out = build_loss(cfg)(lp, torch.zeros(6, dtype=F64), torch.ones(6, dtype=F64), mask, cfg, ctx)
    out.loss_sum.backward()
    assert lp.grad.tolist() == [0.0, 0.0, 0.0, 0.0, -1.0, -1.0]
    assert out.metrics["stale_tokens"].item() == 2


def test_config_refuses_a_doubled_behaviour_correction() -> None:
    with pytest.raises(ValueError, match="trust_region"):
        LossConfig(trust_region="behaviour", mismatch_correction="tis")
    with pytest.raises(ValueError, match="ratio_mask_low"):
        LossConfig(ratio_mask_low=2.0, ratio_mask_high=1.5)
    assert LossConfig(name="gspo").decoupled and not LossConfig().decoupled
    assert LossConfig(mismatch_correction="mis").decoupled


@pytest.mark.parametrize("case", ["gspo", "tis_sequence_product", "mis_token"])
def test_prefix_merged_row_matches_the_oracle_on_samples_forwarded_alone(case: str) -> None:
    """A prefix-tree merged row (shared prompts, identical samples, a sample that is another's prefix) trained
    through the real forward and the built loss gives the oracle's loss and parameter gradients, the oracle
    scoring each sample by its own forward and the per-sample formulas."""
    cfg = LossConfig(**CASES[case])
    model = build_model(ModelConfig(name="qwen3-test")).double()
    rollouts = tree_rollouts(2)
    arrays = [sample_arrays(r) for r in rollouts]
    ordered = [arrays[i] for i in lexicographic_order(arrays)]
    merged = merge_row(ordered).torch()
    assert merged.merged
    lp, _ = micro_batch_logprobs(model, merged, 0.8, CPU, with_entropy=False)
    ctx = LossContext(merged.seq_lens, merged.loss_weights.double(), policy_versions=merged.policy_versions, step=0)
    got = build_loss(cfg)(
        lp, merged.inference_logprobs.double(), merged.advantages.double(), merged.loss_mask, cfg, ctx
    ).loss_sum
    got.backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    alone = []
    for s in ordered:
        ids = torch.as_tensor(s["input_ids"])
        alone.append(
            packed_logprobs(model, ids, position_ids_for([len(ids)], len(ids))[0], [len(ids)], 0.8, CPU, False)[0]
        )
    flat = torch.cat(alone)
    row = {"samples": [], "ctx": ctx}
    for s, sample_lp in zip(ordered, alone):
        values = sample_lp.tolist()
        row["samples"].append(
            {
                "mask": s["loss_mask"].tolist(),
                "lp": values,
                "prox": values,
                "behav": s["inference_logprobs"].tolist(),
                "adv": s["advantages"].tolist(),
                "w": s["loss_weights"].tolist(),
                "ver": s["policy_versions"].tolist(),
                "ref": values,
            }
        )
    want = oracle(row, cfg, flat)
    want.backward()
    # The logprobs are float32 whatever the model's dtype (the trainer scores in fp32), so the merged forward and
    # the per-sample forwards agree to float32 rounding: 1e-6 relative.
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(got_grads[name], p.grad, atol=1e-6, rtol=1e-5), name
