"""Trainer checkpoints on 2 gloo ranks (torchrun, CPU): a flipped or truncated shard is found before anything
loads (the ranks share the files out), said in one line, set aside, and training goes on from the previous
checkpoint; a full disk on one rank's checkpoint write stops every rank with one line, leaves no step marked
complete, and a resume continues from the last complete one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer import read_metrics, trainer_args, write_rollouts

from arbor.run_dir import (
    DONE,
    STOP_PREFIX,
    checkpoint_dir,
    checkpoints_root,
    damaged_checkpoints,
    latest_checkpoint,
)

pytestmark = pytest.mark.slow  # torchrun, 2 ranks

HERE = Path(__file__).parent


def torchrun(args: list[str], **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(HERE / "ckpt_fault_check.py"), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=300)


def two_ranks(out: Path, steps: int, *extra: str) -> list[str]:
    return trainer_args(out, steps, "--parallel.nproc", "2", "--ckpt.interval", "1", "--ckpt.keep", "3", *extra)


def stop_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(STOP_PREFIX)]


def test_damaged_and_truncated_shards_are_set_aside_and_training_goes_on_from_the_previous_step(tmp_path: Path):
    out = tmp_path / "run"
    write_rollouts({2: out}, steps=3)
    proc = torchrun(two_ranks(out, 2))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert latest_checkpoint(out) == 2

    shard = checkpoint_dir(out, 2) / "__0_0.distcp"  # 4 KiB inverted in the middle, same size
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4096] = bytes(b ^ 0xFF for b in data[mid : mid + 4096])
    shard.write_bytes(data)
    proc = torchrun(two_ranks(out, 2, "--resume"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = [ln for ln in proc.stderr.splitlines() if "is damaged" in ln]
    assert len(said) == 1 and "checkpoint step 2" in said[0] and "__0_0.distcp" in said[0], proc.stderr[-2000:]
    assert (checkpoints_root(out) / "step_2.damaged" / "trainer" / "__0_0.distcp").exists()
    assert "resumed from checkpoint step 1" in proc.stderr and latest_checkpoint(out) == 2  # step 1 retrained

    shard = checkpoint_dir(out, 2) / "__1_0.distcp"  # the new step 2, cut in half
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = torchrun(two_ranks(out, 3, "--resume"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "truncated" in proc.stderr and "resumed from checkpoint step 1" in proc.stderr
    assert damaged_checkpoints(out) == 2 and latest_checkpoint(out) == 3
    rows = read_metrics(out)
    assert rows[-1]["step"] == 2 and rows[-1]["ckpt/damaged"] == 2


def test_on_damage_fail_stops_on_one_line(tmp_path: Path):
    out = tmp_path / "run"
    write_rollouts({2: out}, steps=1)
    assert torchrun(two_ranks(out, 1)).returncode == 0
    (checkpoint_dir(out, 1) / ".metadata").unlink()
    proc = torchrun(two_ranks(out, 1, "--resume", "--ckpt.on-damage", "fail"))
    assert proc.returncode != 0
    lines = stop_lines(proc.stderr)
    assert len(lines) == 1 and "checkpoint step 1 is damaged" in lines[0] and ".metadata is missing" in lines[0]
    assert "Traceback" not in "\n".join(ln for ln in proc.stderr.splitlines() if "arbor" in ln and "[" not in ln)


def test_a_full_disk_at_a_checkpoint_stops_every_rank_in_one_line_and_resume_goes_on(tmp_path: Path):
    out = tmp_path / "run"
    write_rollouts({2: out}, steps=3)
    proc = torchrun(two_ranks(out, 3), ENOSPC_AT_CHECKPOINT="2")
    assert proc.returncode != 0
    lines = stop_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-4000:]  # rank 0 says it, for both ranks
    assert lines[0].startswith(STOP_PREFIX + "disk full: writing ") and "step_2/trainer" in lines[0]
    assert "needed" in lines[0] and any(unit in lines[0] for unit in ("KiB", "MiB"))
    assert latest_checkpoint(out) == 1 and not (checkpoint_dir(out, 2) / DONE).exists()  # nothing marked complete

    proc = torchrun(two_ranks(out, 3, "--resume"))  # space freed
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from checkpoint step 1" in proc.stderr and latest_checkpoint(out) == 3
    # step 1's row was out before its checkpoint failed; `rl` truncates the trainer's file on a resume, alone it
    # keeps both attempts' rows
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 1, 2]
