"""arbor.run_dir: the output directory's layout, atomic writes, step listings and retention."""

from __future__ import annotations

import subprocess
import sys

import pytest

from arbor import run_dir


def _checkpoint(out, step, done=True, state=True):
    d = run_dir.checkpoint_dir(out, step)
    d.mkdir(parents=True)
    if done:
        (d / run_dir.DONE).write_text(str(step))
    if state:
        run_dir.orchestrator_state_path(out, step).write_text("{}")


def _publish(out, step, stable=True):
    d = run_dir.broadcast_dir(out, step)
    d.mkdir(parents=True)
    if stable:
        (d / run_dir.STABLE).write_text(str(step))


def test_layout(tmp_path):
    out = tmp_path
    assert run_dir.checkpoint_dir(out, 3) == out / "checkpoints" / "step_3" / "trainer"
    assert run_dir.orchestrator_state_path(out, 3) == out / "checkpoints" / "step_3" / "orchestrator.json"
    assert run_dir.broadcast_dir(out, 2) == out / "broadcasts" / "step_2"
    assert run_dir.rollout_rank_file(out, 4, 1) == out / "rollouts" / "step_4" / "rank_1.safetensors"
    assert run_dir.all_metrics_paths(out) == [
        out / "metrics.jsonl",
        out / "metrics" / "trainer.jsonl",
        out / "metrics" / "orchestrator.jsonl",
    ]
    assert run_dir.process_metrics_path(out, "sft") == out / "metrics" / "sft.jsonl"
    assert run_dir.stacks_dir(out) == out / "logs" / "stacks"
    assert run_dir.heartbeats_dir(out) == out / "heartbeats"
    assert run_dir.gateway_url_path(out) == out / "gateway_url"
    assert run_dir.broadcast_staging_dir(out, 2).parent == out / "broadcasts"


def test_write_atomic_leaves_whole_file_or_none(tmp_path):
    path = tmp_path / "a" / "b.txt"
    run_dir.write_text_atomic(path, "one")
    run_dir.write_text_atomic(path, "two", fsync=False)
    assert path.read_text() == "two"

    def broken(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_dir.write_atomic(path, broken)
    assert path.read_text() == "two"  # the old version survives a failed write
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.txt"]  # no temporary file left behind


def test_checkpoint_listing_needs_done(tmp_path):
    assert run_dir.latest_checkpoint(tmp_path) is None and run_dir.trainer_steps(tmp_path) == []
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 6, done=False)  # killed mid-save
    run_dir.orchestrator_state_path(tmp_path, 8).parent.mkdir(parents=True)  # orchestrator state only
    run_dir.orchestrator_state_path(tmp_path, 8).write_text("{}")
    assert run_dir.trainer_steps(tmp_path) == [2, 4, 6]
    assert run_dir.completed_checkpoints(tmp_path) == [2, 4]
    assert run_dir.latest_checkpoint(tmp_path) == 4


def test_published_steps_need_stable(tmp_path):
    _publish(tmp_path, 1)
    _publish(tmp_path, 3)
    _publish(tmp_path, 5, stable=False)  # still being written
    run_dir.broadcast_staging_dir(tmp_path, 7).mkdir()
    (run_dir.broadcast_staging_dir(tmp_path, 7) / run_dir.STABLE).write_text("7")  # renamed into place next
    assert run_dir.published_steps(tmp_path) == [1, 3]
    assert run_dir.latest_published(tmp_path) == 3
    run_dir.prune_published(tmp_path, keep=1)
    assert run_dir.published_steps(tmp_path) == [3]
    run_dir.prune_published(tmp_path, keep=0)  # 0 keeps everything
    assert run_dir.published_steps(tmp_path) == [3]


def test_checkpoint_and_state_retention_share_step_directories(tmp_path):
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step)
    run_dir.prune_checkpoints(tmp_path, keep=1)
    assert run_dir.trainer_steps(tmp_path) == [3]
    # The orchestrator's states outlive the trainer's pruning: their step directories stay.
    assert run_dir.orchestrator_state_path(tmp_path, 1).exists()
    run_dir.prune_orchestrator_states(tmp_path, below_step=3)
    assert not run_dir.checkpoint_step_dir(tmp_path, 1).exists()
    assert not run_dir.checkpoint_step_dir(tmp_path, 2).exists()
    assert run_dir.orchestrator_state_path(tmp_path, 3).exists() and run_dir.latest_checkpoint(tmp_path) == 3


def test_clear_after_removes_what_a_restart_redoes(tmp_path):
    for step in (0, 1, 2):
        run_dir.rollout_rank_file(tmp_path, step, 0).parent.mkdir(parents=True)
        _publish(tmp_path, step)
    run_dir.heartbeats_dir(tmp_path).mkdir()
    (run_dir.heartbeats_dir(tmp_path) / "trainer_rank0").write_text("{}")
    run_dir.clear_after(tmp_path, 1)
    assert run_dir.rollout_steps(tmp_path) == [0]
    assert run_dir.published_steps(tmp_path) == []  # never trusted: the trainer republishes from its checkpoint
    assert not run_dir.heartbeats_dir(tmp_path).exists()
    run_dir.clear_after(tmp_path, 0)
    assert run_dir.rollout_steps(tmp_path) == []


@pytest.mark.slow
def test_stays_light():
    code = "import sys, arbor.run_dir; assert 'torch' not in sys.modules and 'arbor.trainer' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prune_rollouts_keeps_the_newest_trained_steps_and_every_untrained_one(tmp_path):
    for step in range(6):
        run_dir.rollout_rank_file(tmp_path, step, 0).parent.mkdir(parents=True)
    run_dir.prune_rollouts(tmp_path, keep=2, trained=3)  # steps 4 and 5 are written ahead, not trained yet
    assert run_dir.rollout_steps(tmp_path) == [2, 3, 4, 5]
    run_dir.prune_rollouts(tmp_path, keep=2, trained=0)
    assert run_dir.rollout_steps(tmp_path) == [2, 3, 4, 5]
