"""The launcher's hang watchdog: no finished step within `stall_timeout` -> stack dumps, a diagnosis, a stop.

Progress is the step count in metrics.jsonl (a step is done when both halves of its metrics are merged). When
it has not grown for `stall_timeout` seconds, every process that wrote a heartbeat (`arbor.monitor.heartbeat`)
gets its Python stacks written under `<output_dir>/logs/stacks/`: with `py-spy dump` when py-spy is on PATH
(works even when the interpreter is stuck in C code), otherwise by SIGUSR1, on which each process registered
`faulthandler` at start. The diagnosis lists each process's last heartbeat, which says what it waited on.
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

    def stalled(self, steps_done: int) -> bool:
        """True once `steps_done` has not grown for `stall_timeout` seconds."""
        now = time.monotonic()
        if steps_done != self.steps_seen:
            self.steps_seen, self.since = steps_done, now
        return now - self.since > self.stall_timeout

    def dump_stacks(self, wait: float = 5.0) -> list[Path]:
        """Writes the stacks of every heartbeating process; returns the files written."""
        out = stacks_dir(self.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        py_spy = shutil.which("py-spy")
        written: list[Path] = []
        pending: dict[Path, int] = {}
        for hb in read_heartbeats(self.output_dir):
            pid, name = int(hb["pid"]), hb["name"]
            if not _alive(pid):
                continue
            if py_spy:
                path = out / f"{name}.py-spy.txt"
                res = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
                if res.returncode == 0:
                    path.write_text(res.stdout)
                    written.append(path)
                    continue
            path = out / f"{name}.txt"  # faulthandler appends here on SIGUSR1
            pending[path] = path.stat().st_size if path.exists() else 0
            os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            for path, size in list(pending.items()):
                if path.exists() and path.stat().st_size > size:
                    written.append(path)
                    del pending[path]
            time.sleep(0.1)
        return written

    def diagnosis(self) -> str:
        """One line per process: what it was doing at its last heartbeat, and how long ago."""
        now = time.time()
        lines = []
        for hb in read_heartbeats(self.output_dir):
            state = "" if _alive(int(hb["pid"])) else " (exited)"
            lines.append(f"  {hb['name']} (pid {hb['pid']}{state}): {hb['doing']}, last heartbeat {now - hb['time']:.0f}s ago")
        return "\n".join(lines) or "  no process wrote a heartbeat"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
