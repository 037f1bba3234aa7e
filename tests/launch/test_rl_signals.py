"""`rl`'s exit status after a signal: SIGTERM (a scheduler's stop, `kill`) exits 143 = 128 + 15, SIGINT (Ctrl-C)
130 = 128 + 2, each after stopping every process. `rl` runs its real `main` in a subprocess, with the fleet's
start-up replaced by a wait that the signal interrupts (nothing heavy starts)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import os, signal, sys, time
from arbor.launch import rl, supervise

def wait_healthy(*args, **kwargs):  # in place of inference start-up: the signal arrives here
    os.kill(os.getpid(), signal.{sig})
    for _ in range(300):  # short sleeps, as rl's waits: a signal landing on another thread wakes no long sleep
        time.sleep(0.1)
    raise AssertionError("the signal did not stop rl")

rl.Servers.start = lambda self, name: None
supervise.wait_healthy = wait_healthy
sys.exit(rl.main(["--output-dir", {out!r}, "--model.name", "qwen3-test"]))
"""


@pytest.mark.parametrize("sig, code, said", [("SIGTERM", 143, "terminated (SIGTERM)"), ("SIGINT", 130, "interrupted")])
def test_a_signal_stops_rl_with_128_plus_its_number(tmp_path: Path, sig: str, code: int, said: str) -> None:
    assert code == 128 + getattr(signal, sig)
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(sig=sig, out=str(tmp_path / "run"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == code, res.stderr
    assert f"rl: {said}; stopping every process" in res.stderr
    assert (tmp_path / "run" / "timings.jsonl").exists()  # the shutdown ran to its end
