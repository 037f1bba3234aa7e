"""The launcher's hang watchdog: no finished step within `stall_timeout` -> stack dumps, a diagnosis, a stop.

Progress is the step count in metrics.jsonl (a step is done when both halves of its metrics are merged). When
it has not grown for `stall_timeout` seconds, every process that wrote a heartbeat (`arbor.monitor.heartbeat`)
gets its Python stacks written under `<output_dir>/logs/stacks/`: with `py-spy dump` when py-spy is on PATH
(works even when the interpreter is stuck in C code), otherwise by SIGUSR1, on which each process registered
`faulthandler` at start. The diagnosis lists each process's last heartbeat, which says what it waited on.

A process whose stack could not be taken is never counted as dumped: `missing` names it with the reason (it
exited, py-spy failed and the signal could not be sent, it registered no dump handler, or its stack file stayed
missing or empty), and `stacks_summary` says both, for the launcher's error message.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from arbor.monitor.heartbeat import read_heartbeats
from arbor.run_dir import stacks_dir


class Watchdog:
    def __init__(self, output_dir: Path, stall_timeout: float) -> None:
        self.output_dir, self.stall_timeout = output_dir, stall_timeout
        self.steps_seen = -1
        self.since = time.monotonic()
        self.missing: dict[str, str] = {}
        """Set by `dump_stacks`: each process ("name (pid N)") whose stack it could not take -> why not."""

    def stalled(self, steps_done: int) -> bool:
        """True once `steps_done` has not grown for `stall_timeout` seconds."""
        now = time.monotonic()
        if steps_done != self.steps_seen:
            self.steps_seen, self.since = steps_done, now
        return now - self.since > self.stall_timeout

    def dump_stacks(self, wait: float = 5.0) -> list[Path]:
        """Writes the stacks of every heartbeating process; returns the files written. Each process whose stack
        could not be taken is in `self.missing` (name -> reason) afterwards."""
        out = stacks_dir(self.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        py_spy = shutil.which("py-spy")
        self.missing = {}
        written: list[Path] = []
        pending: dict[str, tuple[Path, int, str]] = {}  # name -> (stack file, its size before, py-spy's failure)
        for hb in read_heartbeats(self.output_dir):
            pid, name = int(hb["pid"]), f"{hb['name']} (pid {hb['pid']})"
            if not _alive(pid):
                self.missing[name] = "it exited before its stack could be taken"
                continue
            spy_failure = ""
            if py_spy:
                path = out / f"{hb['name']}.py-spy.txt"
                spy_failure = _py_spy_dump(py_spy, pid, path)
                if not spy_failure:
                    written.append(path)
                    continue
            if "stack_file" in hb and hb["stack_file"] is None:
                self.missing[name] = f"{spy_failure}it registered no SIGUSR1 stack dump (no SIGUSR1 on this platform)"
                continue
            path = Path(hb.get("stack_file") or out / f"{hb['name']}.txt")  # faulthandler appends here on SIGUSR1
            try:
                pending[name] = (path, path.stat().st_size if path.exists() else 0, spy_failure)
                os.kill(pid, signal.SIGUSR1)
            except OSError as e:  # it exited in between, or is not ours to signal
                del pending[name]
                self.missing[name] = f"{spy_failure}SIGUSR1 could not be sent ({e.strerror or e})"
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            for name, (path, size, _) in list(pending.items()):
                if path.exists() and path.stat().st_size > size:
                    written.append(path)
                    del pending[name]
            time.sleep(0.1)
        for name, (path, size, spy_failure) in pending.items():
            state = "is missing" if not path.exists() else "is empty" if path.stat().st_size == 0 else "did not grow"
            self.missing[name] = f"{spy_failure}its stack file {path} {state} {wait:.0f}s after SIGUSR1"
        return written

    def stacks_summary(self, written: list[Path]) -> str:
        """What `dump_stacks` got: how many stacks and where, and each process without one, with the reason."""
        text = f"stacks of {len(written)} processes in {stacks_dir(self.output_dir)}"
        if self.missing:
            text += "; no stack of " + "; ".join(f"{name}: {why}" for name, why in self.missing.items())
        return text

    def diagnosis(self) -> str:
        """One line per process: what it was doing at its last heartbeat, and how long ago."""
        now = time.time()
        lines = []
        for hb in read_heartbeats(self.output_dir):
            state = "" if _alive(int(hb["pid"])) else " (exited)"
            lines.append(
                f"  {hb['name']} (pid {hb['pid']}{state}): {hb['doing']}, last heartbeat {now - hb['time']:.0f}s ago"
            )
        return "\n".join(lines) or "  no process wrote a heartbeat"


def _py_spy_dump(py_spy: str, pid: int, path: Path) -> str:
    """Dumps `pid`'s stacks with py-spy into `path`; returns "" on success, else why not (as a clause that the
    faulthandler fallback's reason follows)."""
    try:
        res = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "py-spy timed out after 60s, and "
    if res.returncode != 0:
        lines = (res.stderr or res.stdout).strip().splitlines()
        return f"py-spy failed (exit {res.returncode}: {lines[-1] if lines else 'no output'}), and "
    if not res.stdout.strip():
        return "py-spy printed no stack, and "
    path.write_text(res.stdout)
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
