"""`rl --resume` on damaged run directories (the hostile operator of issue 39), trainer on 2 gloo ranks: 8 steps
with a checkpoint every 4, then each kind of damage, then `--resume --max-steps 12`. A damaged checkpoint is said
in one line, set aside and never loaded; the run trains on from step 4 and metrics.jsonl holds every step exactly
once (5..7 retrained once). Damaged broadcasts cost nothing: a resume republishes from the verified checkpoint.
Mid-run, a broadcast the fleet refuses is published again by the trainer and the run goes on; refused again, the
run stops on one line naming the file and the checksums."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from damage import invert_middle
from test_rl_e2e import _finish, _rl

from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import (
    broadcasts_root,
    checkpoint_dir,
    checkpoints_root,
    latest_checkpoint,
    metrics_path,
    orchestrator_state_path,
)

pytestmark = pytest.mark.slow

RUN = ("--trainer.ckpt.interval", "4", "--trainer.parallel.nproc", "2", "--trainer.ckpt.keep", "2")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "base"
    rc, stdout, stderr = _finish(_rl(out, "--max-steps", "8", *RUN))
    assert rc == 0, stderr + stdout
    assert latest_checkpoint(out) == 8 and (checkpoint_dir(out, 4) / "DONE").exists()
    return out


def _damage(out: Path, case: str) -> str:
    """Damages the copy `out` as `case` says; returns the file a resume must name ("" when none is damaged)."""
    shard = checkpoint_dir(out, 8) / "__0_0.distcp"
    if case == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return "__0_0.distcp"
    if case == "orchestrator_state":
        invert_middle(orchestrator_state_path(out, 8), 8)
        return "orchestrator.json"
    for weights in broadcasts_root(out).glob("step_*/*.safetensors"):
        invert_middle(weights)
    return ""


# A flipped shard takes the truncated one's path here (each kind of damage is told apart in one line by
# tests/core/test_checkpoint_manifest.py, and set aside by the trainer itself in tests/trainer/test_checkpoint_trust.py)
@pytest.mark.parametrize("case", ["truncated_shard", "orchestrator_state", "broadcasts"])
def test_a_damaged_run_resumes_from_its_last_intact_state_with_each_step_once(base_run: Path, tmp_path, case):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    named = _damage(out, case)
    rc, stdout, stderr = _finish(_rl(out, "--max-steps", "12", "--resume", *RUN))
    assert rc == 0, stderr + stdout
    said = [ln for ln in stderr.splitlines() if "is damaged" in ln]
    rows = read_jsonl(metrics_path(out))
    assert [r["step"] for r in rows] == list(range(12)), [r["step"] for r in rows]
    if not named:  # broadcasts are never trusted: the trainer republished step 8 from its checkpoint
        assert said == [] and not any(".damaged" in p.name for p in checkpoints_root(out).iterdir())
        assert "Traceback" not in stderr
        return
    assert len(said) == 1 and "checkpoint step 8" in said[0] and named in said[0], stderr
    assert (checkpoints_root(out) / "step_8.damaged").is_dir()  # kept aside, not deleted
    assert [r["ckpt/damaged"] for r in rows[4:]] == [1] * 8  # the retrained steps 4..11 count it
    assert latest_checkpoint(out) == 12


FAULTS = Path(__file__).parent.parent / "faults"


def test_a_broadcast_damaged_mid_run_is_published_again_and_one_damaged_twice_stops_the_run_in_one_line(tmp_path):
    """Version 2 is damaged once (published again, the run goes on), version 3 twice (one line, the run stops);
    `--resume` then finishes the run with every step once. Synchronous, so that step N's rollouts need version N
    itself: the trainer, waiting for them, must answer. The trainer damages the versions itself
    (tests/faults/sitecustomize.py), between their manifest and their `STABLE`."""
    out = tmp_path / "run"
    path = [str(FAULTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "CORRUPT_BROADCAST": "2:1,3:2"}
    run = ("--max-steps", "4", "--orchestrator.scheduler.mode", "sync", "--trainer.parallel.nproc", "2")
    run += ("--trainer.ckpt.interval", "1")
    rc, stdout, stderr = _finish(_rl(out, *run, env=env))
    assert rc == 1, stderr + stdout
    said = [ln for ln in stderr.splitlines() if "refused" in ln]
    assert len(said) == 1 and "weight update 3 refused twice (the second time after a fresh publish)" in said[0]
    assert "step_3/model.safetensors: crc32 " in said[0] and "does not match the manifest" in said[0], said
    assert "Traceback" not in stderr
    trainer = (out / "logs" / "trainer.log").read_text()
    assert "the fleet refused weights version 2 (" in trainer and "publishing version 2 again" in trainer
    rows = read_jsonl(metrics_path(out))
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["weights/republished"] for r in rows] == [0, 0, 1]
    assert rows[2]["weights/refused"] == 1

    rc, stdout, stderr = _finish(_rl(out, *run, "--resume"))  # the trainer republishes version 3 from step 3
    assert rc == 0, stderr + stdout
    assert [r["step"] for r in read_jsonl(metrics_path(out))] == [0, 1, 2, 3]
