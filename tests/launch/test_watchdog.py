"""The hang watchdog: an environment that blocks forever -> stack dumps of every process and a non-zero exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arbor.monitor.heartbeat import beat, install, read_heartbeats

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parents[1]
TINY = [
    "--model.name",
    "qwen3-test",
    "--seq-len",
    "48",
    "--orchestrator.batch-size",
    "8",
    "--orchestrator.group-size",
    "4",
    "--orchestrator.sampling.max-tokens",
    "8",
    "--trainer.num-threads",
    "1",
    "--inference.num-threads",
    "1",
    "--inference.max-batch-size",
    "16",
]


def test_heartbeat_records_pid_and_what_the_process_does(tmp_path):
    install(tmp_path, "unit")
    beat("waiting for rollouts step 5")
    (hb,) = read_heartbeats(tmp_path)
    assert hb["name"] == "unit" and hb["pid"] == os.getpid() and hb["doing"] == "waiting for rollouts step 5"
    assert (tmp_path / "logs" / "stacks" / "unit.txt").exists()


def test_hang_dumps_every_stack_and_stops_within_stall_timeout(tmp_path):
    out, stall = tmp_path / "run", 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    argv = [
        sys.executable,
        "-m",
        "arbor.launch.rl",
        "--output-dir",
        str(out),
        *TINY,
        "--max-steps",
        "3",
        "--orchestrator.environment.id",
        "hang_env:hanging",
        "--orchestrator.environment.timeout",
        "3600",
        "--orchestrator.environment.args",
        "{ min_len = 2, max_len = 5, num_tasks = 50 }",
        "--stall-timeout",
        str(stall),
    ]
    t0 = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - t0
    assert res.returncode == 3, res.stderr + res.stdout
    for name in ("inference", "orchestrator", "trainer_rank0"):
        text = _stack(out, name)
        # faulthandler: "Thread 0x..." / "Current thread"; py-spy: "Thread <tid> (idle|active...)"
        assert re.search(r"Thread 0x|Current thread|^Thread \d+ \((idle|active)", text, re.M), (name, text)
    # The orchestrator's dump shows where it hangs; the message names who waits on what.
    assert "hang_env.py" in _stack(out, "orchestrator")
    # ... and its log said so long before the watchdog fired (arbor.loopwatch), naming the line.
    log = (out / "logs" / "orchestrator.log").read_text()
    assert re.search(
        r"the event loop has been blocked for 1\.\ds at .*score \(.*hang_env\.py:\d+\): "
        r"`time\.sleep\(3600\)",
        log,
    ), log[-2000:]
    assert "orchestrator" in res.stderr and "generating and scoring step 0" in res.stderr
    assert "trainer_rank0" in res.stderr and "waiting for rollouts step 0" in res.stderr
    # stall_timeout + 30 s, plus up to 30 s for the inference server's start-up (the clock starts after it).
    assert elapsed < stall + 30 + 30, elapsed
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, "processes outlived the launcher"


def _stack(out: Path, name: str) -> str:
    """A process's dump: py-spy's when py-spy is on PATH (the watchdog prefers it), else faulthandler's."""
    stacks = out / "logs" / "stacks"
    spy = stacks / f"{name}.py-spy.txt"
    return (spy if spy.exists() else stacks / f"{name}.txt").read_text()


def _sleeper(out: Path, name: str) -> subprocess.Popen:
    code = (
        f"import time; from arbor.monitor.heartbeat import install, beat; install({str(out)!r}, {name!r}); "
        f"beat('waiting for nothing'); print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_stall_detection_and_faulthandler_dump(tmp_path, monkeypatch):
    from arbor.launch.watchdog import Watchdog

    monkeypatch.setenv("PATH", "/nonexistent")  # no py-spy: the SIGUSR1/faulthandler path
    proc = _sleeper(tmp_path, "sleeper")
    try:
        dog = Watchdog(tmp_path, stall_timeout=0.3)
        assert not dog.stalled(0)
        time.sleep(0.4)
        assert dog.stalled(0) and not dog.stalled(1)  # progress resets the clock
        (path,) = dog.dump_stacks()
        assert path.name == "sleeper.txt"
        assert 'File "<string>", line 1' in path.read_text()
        assert proc.poll() is None, "SIGUSR1 must not kill a process that registered the dump"
        assert "sleeper (pid" in dog.diagnosis() and "waiting for nothing" in dog.diagnosis()
    finally:
        proc.kill()
        proc.wait()


def test_py_spy_is_used_when_on_path(tmp_path, monkeypatch):
    from arbor.launch.watchdog import Watchdog

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "py-spy"
    fake.write_text('#!/bin/sh\necho "Thread 1 (idle): MainThread (py-spy $1 $2 $3)"\n')
    fake.chmod(0o755)
    proc = _sleeper(tmp_path, "sleeper")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    try:
        (path,) = Watchdog(tmp_path, 1.0).dump_stacks()
        assert path.name == "sleeper.py-spy.txt"
        assert f"py-spy dump --pid {proc.pid}" in path.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_a_second_install_of_the_same_process_only_records_what_it_does(tmp_path):
    """An entry point installs its heartbeat before loading torch; the server installs it again: one stack file
    and one signal registration, the newer `doing`."""
    from arbor.monitor import heartbeat

    install(tmp_path, "twice", "loading the engine")
    dump_file = heartbeat._state["dump_file"]
    install(tmp_path, "twice", "serving")
    assert heartbeat._state["dump_file"] is dump_file
    [record] = [b for b in read_heartbeats(tmp_path) if b["name"] == "twice"]
    assert record["doing"] == "serving" and record["pid"] == os.getpid()
