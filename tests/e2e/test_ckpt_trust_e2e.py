"""`rl --resume` on damaged run directories (the hostile operator of issue 39), trainer on 2 gloo ranks: 8 steps
with a checkpoint every 4, then each kind of damage, then `--resume --max-steps 12`. A damaged checkpoint is said
in one line, set aside and never loaded; the run trains on from step 4 and metrics.jsonl holds every step exactly
once (5..7 retrained once). Damaged broadcasts cost nothing: a resume republishes from the verified checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
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


def _invert_middle(path: Path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(data)


def _damage(out: Path, case: str) -> str:
    """Damages the copy `out` as `case` says; returns the file a resume must name ("" when none is damaged)."""
    shard = checkpoint_dir(out, 8) / "__0_0.distcp"
    if case == "flipped_shard":
        _invert_middle(shard)
        return "__0_0.distcp"
    if case == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return "__0_0.distcp"
    if case == "orchestrator_state":
        _invert_middle(orchestrator_state_path(out, 8), 8)
        return "orchestrator.json"
    for weights in broadcasts_root(out).glob("step_*/*.safetensors"):
        _invert_middle(weights)
    return ""


@pytest.mark.parametrize("case", ["flipped_shard", "truncated_shard", "orchestrator_state", "broadcasts"])
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
