"""A continuous-producer scheduling mode end to end: windowed FIFO with groups launched ahead, sequence
normalisation, CISPO, zero-advantage filtering, the curriculum sampler, periodic eval, and the
throughput-matching figures in metrics.jsonl."""

from __future__ import annotations

import pytest
from test_rl_e2e import _finish, _rl

from arbor.monitor.metrics import read_jsonl

pytestmark = pytest.mark.slow


def test_windowed_fifo_run_with_lookahead(tmp_path):
    out = tmp_path / "run"
    rc, stdout, stderr = _finish(
        _rl(
            out,
            "--max-steps",
            "4",
            "--orchestrator.scheduler.mode",
            "windowed_fifo",
            "--orchestrator.scheduler.window",
            "2",
            "--orchestrator.scheduler.max-in-flight",
            "6",
            "--orchestrator.max-off-policy-steps",
            "2",
            "--orchestrator.batching.normalization",
            "sequence",
            "--trainer.loss.name",
            "cispo",
            "--orchestrator.filters.drop-zero-advantage",
            "true",
            "--orchestrator.curriculum.enabled",
            "true",
            "--orchestrator.filters.solve-threshold",
            "0.5",
            "--orchestrator.eval.interval",
            "2",
            "--orchestrator.eval.num-tasks",
            "3",
            "--orchestrator.eval.k",
            "2",
            "--orchestrator.eval.max-tokens",
            "8",
        )
    )
    assert rc == 0, stderr + stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["staleness/max"] <= 2
        assert sum(v for k, v in r.items() if k.startswith("staleness/hist_")) == 16  # every rollout counted once
        assert 0 < r["accepted/frac"] <= 1 and 0 <= r["time/wait_ratio"] <= 1
        assert sum(r[f"batch/{p}_frac"] for p in ("easy", "normal", "hard")) == pytest.approx(1.0)
        assert r["filtered/zero_advantage"] >= 0
    # Groups were launched ahead of the batch: after step 0 the queue head is past step 0's 4 groups, with
    # more in flight or finished.
    assert rows[0]["scheduler/head"] >= 4
    assert any(r["scheduler/in_flight"] + r["scheduler/ready"] > 0 for r in rows[:-1])
    # Periodic eval at steps 0 and 2 only.
    assert [r["step"] for r in rows if "eval/reverse_text/avg@2" in r] == [0, 2]
    assert all(0 <= r["eval/reverse_text/pass@2"] <= 1 for r in rows if "eval/reverse_text/pass@2" in r)
    assert sum(r["throughput/produced_rollouts_per_s"] for r in rows[1:]) > 0
    assert all(r["throughput/consumed_rollouts_per_s"] > 0 for r in rows[1:])


def test_between_steps_weight_updates_sample_each_batch_from_one_policy_and_a_seeded_run_repeats(tmp_path):
    """`weight_updates = "between_steps"` on one_step_off: the fleet loads exactly the policy a step waits for
    before its groups launch, so every sample of step N >= 1 is exactly one version old, and a second run with
    the same seed samples the same batches. With one slot group at a time (max_batch_size = group_size) the
    default in-flight updates land mid-batch here (policy staleness 0.54..0.75 per step, measured 2026-12-02
    on the quick start), so the rewards would depend on timing."""
    flags = ["--max-steps", "5", "--inference.max-batch-size", "4", "--orchestrator.scheduler.mode", "one_step_off"]
    flags += ["--orchestrator.scheduler.weight-updates", "between_steps"]
    runs = []
    for name in ("a", "b"):
        rc, stdout, stderr = _finish(_rl(tmp_path / name, *flags))
        assert rc == 0, stderr + stdout
        runs.append(read_jsonl(tmp_path / name / "metrics.jsonl"))
    a, b = runs
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert [r["policy_staleness/mean"] for r in a[1:]] == [1.0] * 4
    assert [r["policy_staleness/max"] for r in a[1:]] == [1] * 4
    assert [r["weights/updates"] for r in a] == [0, 0, 1, 2, 3]  # one load per step, never the trainer's newest
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
    assert [r["completion_len/mean"] for r in a] == [r["completion_len/mean"] for r in b]
    # The same samples train the same update: the losses agree to the engine's last bits of logprob.
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5, abs=1e-9)
