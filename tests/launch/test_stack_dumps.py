"""Watchdog honesty: a process whose stack could not be taken is named, with the reason, and never counted as
dumped (an exited process, a stack file that stays missing or empty, no dump handler, a failing py-spy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arbor.launch.watchdog import Watchdog
from arbor.run_dir import heartbeats_dir


@pytest.fixture
def deaf():
    """A live process that ignores SIGUSR1, so no stack ever comes from it."""
    code = (
        "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc.pid
    proc.kill()
    proc.wait()


def _heartbeat(out: Path, name: str, pid: int, **extra) -> None:
    heartbeats_dir(out).mkdir(parents=True, exist_ok=True)
    record = {"name": name, "pid": pid, "time": time.time(), "doing": "waiting", **extra}
    (heartbeats_dir(out) / name).write_text(json.dumps(record))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_each_process_without_a_stack_is_named_with_the_reason(tmp_path, monkeypatch, deaf):
    monkeypatch.setenv("PATH", "/nonexistent")  # no py-spy: the SIGUSR1/faulthandler path
    empty = tmp_path / "empty.txt"
    empty.touch()
    _heartbeat(tmp_path, "empty", deaf, stack_file=str(empty))
    _heartbeat(tmp_path, "nofile", deaf, stack_file=str(tmp_path / "never.txt"))
    _heartbeat(tmp_path, "nohandler", deaf, stack_file=None)
    _heartbeat(tmp_path, "gone", _dead_pid())
    dog = Watchdog(tmp_path, 1.0)
    assert dog.dump_stacks(wait=1.0) == []
    assert dog.missing == {
        f"empty (pid {deaf})": f"its stack file {empty} is empty 1s after SIGUSR1",
        f"nofile (pid {deaf})": f"its stack file {tmp_path / 'never.txt'} is missing 1s after SIGUSR1",
        f"nohandler (pid {deaf})": "it registered no SIGUSR1 stack dump (no SIGUSR1 on this platform)",
        f"gone (pid {_pid_of(tmp_path, 'gone')})": "it exited before its stack could be taken",
    }
    summary = dog.stacks_summary([])
    assert summary.startswith(f"stacks of 0 processes in {tmp_path / 'logs' / 'stacks'}; no stack of ")
    assert f"empty (pid {deaf}): its stack file {empty} is empty" in summary


def _pid_of(out: Path, name: str) -> int:
    return json.loads((heartbeats_dir(out) / name).read_text())["pid"]


@pytest.mark.slow
def test_a_failing_py_spy_is_part_of_the_reason(tmp_path, monkeypatch, deaf):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "py-spy"
    fake.write_text('#!/bin/sh\necho "Permission denied (os error 1)" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    empty = tmp_path / "empty.txt"
    empty.touch()
    _heartbeat(tmp_path, "worker", deaf, stack_file=str(empty))
    dog = Watchdog(tmp_path, 1.0)
    assert dog.dump_stacks(wait=1.0) == []
    assert dog.missing == {
        f"worker (pid {deaf})": "py-spy failed (exit 1: Permission denied (os error 1)), and its "
        f"stack file {empty} is empty 1s after SIGUSR1"
    }


def test_the_summary_counts_only_stacks_taken(tmp_path):
    dog = Watchdog(tmp_path, 1.0)
    assert dog.stacks_summary([tmp_path / "a.txt"]) == f"stacks of 1 processes in {tmp_path / 'logs' / 'stacks'}"
