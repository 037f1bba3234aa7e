"""Mini-batch updates (`trainer.mini_batches`, `trainer.epochs`): k = 2 mini-batches on a batch equal two
sequential single-step batches on its halves; the normaliser is exact per mini-batch under sequence
normalisation; the proximal policy is the one before the first optimizer step; a k the batch cannot hold is
refused naming the key."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_trainer import TEST_MODEL, make_micro_batch, read_metrics, trainer_args
from test_trainer_dist import assert_same_weights, run_torchrun

from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.config.trainer import LossConfig, OptimConfig
from arbor.models import build_model
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.rollout import Rollout
from arbor.run_dir import broadcast_dir
from arbor.trainer.loss import LossOutput, build_loss, ppo_clip
from arbor.trainer.main import main as trainer_main
from arbor.trainer.optim import build_optimizer
from arbor.trainer.step import micro_batch_logprobs, mini_batch_normalisers, split_mini_batches, train_step
from arbor.transport.batch import StepBatch
from arbor.transport.files import write_step

CPU = torch.device("cpu")
LAYOUT = [[10, 12], [8, 9, 5], [14, 6], [7, 7, 7]]


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(TEST_MODEL)
    gen = torch.Generator().manual_seed(seed)
    mbs = [make_micro_batch(model, gen, lens) for lens in LAYOUT]
    return model, mbs


def _batch(mbs, step: int = 0) -> StepBatch:
    total = sum(int(m.loss_mask.sum()) for m in mbs)
    samples = sum(len(m.seq_lens) for m in mbs)
    return StepBatch(step, list(mbs), total, samples, 1.0)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo", "opmd"])
def test_two_mini_batches_equal_two_sequential_steps_on_the_halves(loss: str) -> None:
    cfg = LossConfig(name=loss)
    fn = build_loss(cfg)
    model_a, mbs = _setup()
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = build_optimizer(model_a, OptimConfig(lr=1e-2)), build_optimizer(model_b, OptimConfig(lr=1e-2))
    figures = train_step(model_a, opt_a, _batch(mbs), fn, cfg, 1.0, CPU, mini_batches=2)
    for half in (mbs[:2], mbs[2:]):
        train_step(model_b, opt_b, _batch(half), fn, cfg, 1.0, CPU)
    before = _params(_setup()[0])
    moved = sum(float((a - b).abs().sum()) for a, b in zip(_params(model_a), before))
    assert moved > 0
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
    assert figures["loss_tokens"] == _batch(mbs).loss_tokens_total


def test_sequence_normalisation_is_exact_per_mini_batch() -> None:
    """Weights written for the whole step (sample i's tokens N / (S * n_i)) give, per mini-batch, the mean over
    its own samples of each sample's token mean."""
    _, mbs = _setup()
    total = sum(int(m.loss_mask.sum()) for m in mbs)
    n_samples = sum(len(m.seq_lens) for m in mbs)
    weighted = []
    for m in mbs:
        w = torch.zeros_like(m.loss_weights)
        off = 0
        for n in m.seq_lens.tolist():
            trained = m.loss_mask[off : off + n]
            w[off : off + n] = trained.float() * total / (n_samples * max(int(trained.sum()), 1))
            off += n
        weighted.append(dataclasses.replace(m, loss_weights=w))
    batch = _batch(weighted)
    groups = split_mini_batches(len(mbs), 2, 0)
    norms = mini_batch_normalisers(batch, groups, 1.0)
    gen = torch.Generator().manual_seed(1)
    for group, norm in zip(groups, norms):
        # Any per-token loss: the mini-batch's weighted sum over its normaliser is the mean over its samples of
        # each sample's mean over its trained tokens.
        loss_sum, sample_means = 0.0, []
        for i in group:
            m = weighted[i]
            values = torch.randn(m.loss_weights.shape, generator=gen, dtype=torch.float64)
            loss_sum += float((m.loss_weights.double() * values * m.loss_mask).sum())
            off = 0
            for n in m.seq_lens.tolist():
                trained = m.loss_mask[off : off + n]
                if trained.any():
                    sample_means.append(float(values[off : off + n][trained].mean()))
                off += n
        assert loss_sum / norm == pytest.approx(sum(sample_means) / len(sample_means), abs=1e-6)
    assert mini_batch_normalisers(batch, [range(4)], 1.0) == [float(total)]


def test_proximal_logprobs_are_the_policy_before_the_first_step() -> None:
    """With two optimizer steps each micro-batch's loss sees proximal logprobs equal to its rows' logprobs under
    the initial weights, though the second mini-batch is trained after one update."""
    model, mbs = _setup()
    seen: list[torch.Tensor] = []

    def spy(logprobs, inference_logprobs, advantages, loss_mask, cfg, ctx=None) -> LossOutput:
        seen.append(ctx.proximal_logprobs.clone())
        return ppo_clip(logprobs, inference_logprobs, advantages, loss_mask, cfg, ctx)

    initial = copy.deepcopy(model)
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    train_step(model, opt, _batch(mbs), spy, LossConfig(), 1.0, CPU, mini_batches=2, epochs=2)
    assert len(seen) == 2 * len(mbs)
    with torch.no_grad():
        want = [micro_batch_logprobs(initial, mb, 1.0, CPU, False)[0] for mb in mbs]
    for k, got in enumerate(seen):
        assert torch.allclose(got, want[k % len(mbs)], atol=1e-6)


def test_a_mini_batch_count_the_batch_cannot_hold_is_refused() -> None:
    # A step that holds fewer micro-batches than mini-batches takes one step per micro-batch (never a crash
    # mid-run); a config whose batch cannot hold them is refused up front.
    assert split_mini_batches(4, 5, 3) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert split_mini_batches(5, 2, 0) == [range(0, 2), range(2, 5)]
    with pytest.raises((ValueError, ConfigError), match="trainer.mini_batches"):
        load_config(RLConfig, ["--trainer.mini-batches", "65", "--orchestrator.batch-size", "64"], env={})


def test_gspo_defaults_to_sequence_normalisation_under_rl_and_can_be_overridden() -> None:
    cfg = load_config(RLConfig, ["--trainer.loss.name", "gspo"], env={})
    assert cfg.orchestrator.batching.normalization == "sequence"
    cfg = load_config(
        RLConfig, ["--trainer.loss.name", "gspo", "--orchestrator.batching.normalization", "token"], env={}
    )
    assert cfg.orchestrator.batching.normalization == "token"
    assert load_config(RLConfig, [], env={}).orchestrator.batching.normalization == "token"


@pytest.mark.slow
def test_two_rank_mini_batches_match_one_rank(tmp_path) -> None:
    """2 FSDP ranks with 2 mini-batches each equal 1 rank holding the same mini-batches: the per-mini-batch
        normaliser is summed over ranks. Rank r holds micro-batches (r, r + 2), so mini-batch j is micro-batches
    (2j, 2j + 1) over the two ranks, as on one rank holding all four in order."""
    one, two = tmp_path / "one", tmp_path / "two"
    model, _ = _setup()
    gen = torch.Generator().manual_seed(5)
    for step in range(2):
        mbs = [make_micro_batch(model, gen, lens) for lens in LAYOUT]
        total, samples = _batch(mbs).loss_tokens_total, _batch(mbs).num_samples_total
        write_step(one, step, [StepBatch(step, mbs, total, samples, 1.0)])
        write_step(two, step, [StepBatch(step, [mbs[r], mbs[r + 2]], total, samples, 1.0) for r in range(2)])
    assert trainer_main(trainer_args(one, 2, "--mini-batches", "2")) == 0
    run_torchrun(2, trainer_args(two, 2, "--parallel.nproc", "2", "--mini-batches", "2"))
    for r1, r2 in zip(read_metrics(one), read_metrics(two), strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
        assert r1["mismatch_kl"] == pytest.approx(r2["mismatch_kl"], abs=1e-6)
    for version in (1, 2):
        assert_same_weights(broadcast_dir(one, version), broadcast_dir(two, version), atol=1e-5)


def _rollout(prompt: list[int], completion: list[int]) -> Rollout:
    n = len(completion)
    return Rollout(0, prompt, completion, [-0.5] * n, [0] * n, "x", "stop", 1.0)


def test_the_batcher_packs_a_micro_batch_per_mini_batch_where_the_samples_allow() -> None:
    """With prefix merging a whole step often fits one row: `rl` sets `batching.min_micro_batches` from
    `trainer.mini_batches` and the batcher shrinks the row budget until every rank holds that many."""
    cfg = load_config(RLConfig, ["--trainer.mini-batches", "2"], env={})
    assert cfg.orchestrator.batching.min_micro_batches == 2
    prompt = list(range(40))
    rollouts = [_rollout(prompt, [50 + i, 60 + i]) for i in range(8)]
    for merge in (True, False):
        (one,) = build_step_batches(rollouts, 0, 1, 4096, 1.0, 0, prefix_merge=merge)
        assert len(one.micro_batches) == 1
        (two,) = build_step_batches(rollouts, 0, 1, 4096, 1.0, 0, prefix_merge=merge, min_micro_batches=2)
        assert len(two.micro_batches) >= 2
        assert sum(int(mb.loss_mask.sum()) for mb in two.micro_batches) == sum(
            int(mb.loss_mask.sum()) for mb in one.micro_batches
        )
    few = build_step_batches(rollouts[:1], 0, 1, 4096, 1.0, 0, min_micro_batches=2)
    assert len(few[0].micro_batches) == 1  # one sample: one row, no endless halving


def test_a_non_finite_gradient_skips_its_update_and_is_counted() -> None:
    """One NaN advantage would reach every weight through the optimizer: that mini-batch's update is skipped
    (and counted), the other mini-batch's is taken."""
    cfg = LossConfig(name="ppo_clip")
    model, mbs = _setup()
    poisoned = dataclasses.replace(mbs[0], advantages=mbs[0].advantages.clone())
    poisoned.advantages[poisoned.loss_mask.nonzero()[0]] = float("nan")
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    before = _params(model)
    figures = train_step(model, opt, _batch([poisoned, *mbs[1:]]), build_loss(cfg), cfg, 1.0, CPU, mini_batches=2)
    assert figures["skipped_updates"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the clean half trained
    clean = train_step(model, opt, _batch(mbs), build_loss(cfg), cfg, 1.0, CPU)
    assert clean["skipped_updates"] == 0
