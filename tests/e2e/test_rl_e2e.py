"""End-to-end `rl` runs on CPU: the real processes, HTTP API, files and configs, with a tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import latest_checkpoint

pytestmark = pytest.mark.slow

TINY = [
    "--model.name",
    "qwen3-test",
    "--seq-len",
    "48",
    "--orchestrator.batch-size",
    "16",
    "--orchestrator.group-size",
    "4",
    "--orchestrator.sampling.max-tokens",
    "8",
    "--orchestrator.environment.args",
    "{ min_len = 2, max_len = 5, num_tasks = 200 }",
    "--trainer.num-threads",
    "1",
    "--inference.num-threads",
    "1",
    "--inference.max-batch-size",
    "32",
]


def _rl(out: Path, *extra: str, **kw) -> subprocess.Popen:
    argv = [sys.executable, "-m", "arbor.launch.rl", "--output-dir", str(out), *TINY, *extra]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_sync_run_with_warmup_and_two_trainer_ranks_stays_on_policy(tmp_path):
    """SFT warm-up, then synchronous RL with the trainer under torchrun (2 ranks, FSDP2 over gloo)."""
    out = tmp_path / "run"
    rc, stdout, stderr = _finish(
        _rl(
            out,
            "--max-steps",
            "3",
            "--orchestrator.scheduler.mode",
            "sync",
            "--sft.steps",
            "5",
            "--sft.batch-size",
            "8",
            "--trainer.parallel.nproc",
            "2",
        )
    )
    assert rc == 0, stderr + stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for key in ("reward/mean", "loss", "tokens/s", "rollouts/s", "staleness/max", "mismatch_kl"):
            assert key in r, key
        assert r["staleness/max"] == 0
        assert r["mismatch_kl"] < 1e-3
    assert "step    3/3" in stdout
    for name in ("sft", "inference", "trainer", "orchestrator"):
        assert (out / "logs" / f"{name}.log").exists()
    assert (out / "sft" / "config.json").exists()
    assert (out / "broadcasts" / "step_3" / "STABLE").exists()
    assert sorted(p.name for p in (out / "rollouts" / "step_2").iterdir()) == [
        "rank_0.safetensors",
        "rank_1.safetensors",
    ]
    assert (out / "checkpoints" / "step_3" / "trainer" / "DONE").exists()


def test_a_failed_run_resumes_by_itself_and_a_killed_one_by_hand_with_no_step_missing_or_repeated(tmp_path):
    """`max_restarts`: a dead trainer makes `rl` resume the run itself; then the launcher and everything in its
    session are killed with no clean-up, and `--resume` goes on. Every step is in the metrics exactly once."""
    out = tmp_path / "run"
    args = ("--max-steps", "30", "--trainer.ckpt.interval", "2", "--max-restarts", "1")
    proc = _rl(out, *args)
    _wait_for(
        lambda: latest_checkpoint(out) is not None and len(read_jsonl(out / "metrics.jsonl")) >= 3,
        180,
        "a checkpoint and three steps",
    )
    trainers = subprocess.run(["pgrep", "-f", f"arbor.trainer.main @ {out}"], capture_output=True, text=True).stdout
    assert len(trainers.split()) == 1, trainers
    killed = trainers.split()[0]
    os.kill(int(killed), signal.SIGKILL)

    def resumed() -> bool:  # a new trainer, and steps past the kill (rows the dead one had written come first)
        now = subprocess.run(["pgrep", "-f", f"arbor.trainer.main @ {out}"], capture_output=True, text=True).stdout
        return bool(set(now.split()) - {killed}) and len(read_jsonl(out / "metrics.jsonl")) >= 8

    _wait_for(lambda: resumed() or proc.poll() is not None, 180, "the resumed attempt's steps")
    assert proc.poll() is None, proc.communicate()[1]
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and everything in its session, no clean-up
    _, stderr = proc.communicate()
    assert "trainer exited with code -9" in stderr and "rl: restart 1/1: resuming from the last checkpoint" in stderr
    rc, stdout, stderr = _finish(_rl(out, *args, "--resume"))
    assert rc == 0, stderr + stdout
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
    assert steps == list(range(30)), steps


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_2" / "trainer").mkdir(parents=True)
    (out / "checkpoints" / "step_2" / "trainer" / "DONE").write_text("")
    rc, _, stderr = _finish(_rl(out, "--max-steps", "2"), timeout=30)
    assert rc != 0 and "--resume" in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_killed_or_frozen_lone_inference_server_is_restarted_with_the_runs_weights(tmp_path, fault):
    """The orchestrator's requests wait for the restarted server, which gets the policy the run serves before
    it answers one of them; no step is lost. A frozen server (SIGSTOP: alive, silent) is first killed once it has
    not answered /health for `inference.liveness_timeout` seconds."""
    out = tmp_path / "run"
    steps = 20
    proc = _rl(out, "--max-steps", str(steps), "--inference.liveness-timeout", "3")
    _wait_for(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 3, 180, "three steps")
    pids = subprocess.run(
        ["pgrep", "-f", f"arbor.inference.server @ {out}"], capture_output=True, text=True
    ).stdout.split()
    assert len(pids) == 1, pids
    os.kill(int(pids[0]), signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    rc, stdout, stderr = _finish(proc, timeout=300)
    assert rc == 0, stderr + stdout
    assert ("inference stopped answering /health for" in stderr) == (fault == "frozen"), stderr
    assert "inference exited with code -9; restarting it" in stderr
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))
    assert rows[-1]["client/reconnects"] >= 1 and rows[0]["client/reconnects"] == 0
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "came back at policy version 0: loaded version" in log, log[-3000:]
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, "processes outlived the launcher"


def test_dead_inference_server_without_restarts_stops_the_run_naming_it(tmp_path):
    out = tmp_path / "run"
    proc = _rl(out, "--max-steps", "200", "--inference.restart-dead-replicas", "false")
    _wait_for(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 1, 180, "the first step")
    pids = subprocess.run(
        ["pgrep", "-f", f"arbor.inference.server @ {out}"], capture_output=True, text=True
    ).stdout.split()
    assert pids, "inference process not found"
    t0 = time.monotonic()
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    rc, _, stderr = _finish(proc, timeout=90)
    assert time.monotonic() - t0 < 60
    assert rc != 0
    assert "inference exited" in stderr and str(out / "logs" / "inference.log") in stderr
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, "processes outlived the launcher"


def test_max_minutes_ends_the_run_with_a_checkpoint_and_resume_goes_on(tmp_path):
    """A fraction of a minute's budget ends a 500-step run early and cleanly: exit 0, a checkpoint of the last
    trained step, every row stamped with `time` and `elapsed_s`; a resume with a larger budget goes on from the
    checkpoint, its clock continuing from the last row kept."""
    import json

    out = tmp_path / "run"
    rc, stdout, stderr = _finish(
        _rl(out, "--max-steps", "500", "--max-minutes", "0.1", "--trainer.ckpt.interval", "1000")
    )
    assert rc == 0, stderr + stdout
    stopped = json.loads((out / "stopped.json").read_text())
    at = stopped["step"]
    assert 0 < at < 500 and latest_checkpoint(out) == at
    assert f"stopped at step {at}/500 by max_minutes" in stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(at))
    assert all(isinstance(r["time"], float) and r["elapsed_s"] >= 0 for r in rows)
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)
    assert rows[-1]["elapsed_s"] >= 6.0  # the step that ended past the budget (0.1 min) is the last one
    assert all("elapsed_s" in r and "time" in r for r in read_jsonl(out / "metrics" / "orchestrator.jsonl"))

    rc, stdout, stderr = _finish(_rl(out, "--max-steps", str(at + 2), "--resume"))
    assert rc == 0, stderr + stdout
    assert not (out / "stopped.json").exists() and "by max_minutes" not in stdout
    resumed = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(at + 2))
    assert resumed[at]["elapsed_s"] > rows[-1]["elapsed_s"]  # goes on from the last row, downtime not counted
    assert resumed[at]["time"] > rows[-1]["time"]


HANGING_ENV = '''
import asyncio, time
from arbor.environments.reverse_text import ReverseTextEnv


class HangingEnv(ReverseTextEnv):
    """Scoring every third task never returns: a verifier stuck in a loop in a worker thread."""

    async def score(self, task, completion):
        if task["id"] % 3 == 0:
            await asyncio.to_thread(time.sleep, 3600)
        return await super().score(task, completion)
'''


def test_a_run_whose_environment_never_returns_still_ends(tmp_path):
    """The stuck calls time out (`environment.timeout`, scored 0) and their threads, which Python cannot stop, no
    longer keep the orchestrator, and with it `rl`, from exiting after the last step (arbor.runloop)."""
    (tmp_path / "hanging_env.py").write_text(HANGING_ENV)
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = tmp_path / "run"
    rc, stdout, stderr = _finish(
        _rl(
            out,
            "--max-steps",
            "2",
            "--orchestrator.environment.id",
            "hanging_env:HangingEnv",
            "--orchestrator.environment.timeout",
            "1",
            "--orchestrator.environment.retries",
            "0",
            env=env,
        ),
        timeout=180,
    )
    assert rc == 0, stderr + stdout
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]
    assert "worker thread(s) still running" in (out / "logs" / "orchestrator.log").read_text()
