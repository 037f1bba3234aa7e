"""Heartbeats and on-demand stack dumps, so that a stalled run says who waits on what.

Every process calls `install(output_dir, name)` once at start: it registers `faulthandler` on SIGUSR1 (all
threads, into `<output_dir>/logs/stacks/<name>.txt`) and writes `<output_dir>/heartbeats/<name>` as JSON
`{"name", "pid", "time", "doing", "stack_file"}`; `stack_file` is the stack dump's file, or null where the
platform has no SIGUSR1 (the watchdog then says why it has no stack of the process). `beat(doing)` rewrites the
heartbeat (atomically, at most a few times a second) whenever the process starts waiting on or doing something
new: "waiting for rollouts step 5", "generating step 7".
The launcher's watchdog (`arbor.launch.watchdog`) reads the files to name the waiter and signals the pids to
dump their stacks. Paths come from arbor.run_dir. Standard library only: the launcher imports this module
without torch.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from arbor.run_dir import heartbeats_dir, stacks_dir, write_text_atomic

_state: dict[str, Any] = {}


def install(output_dir: str | Path, name: str, doing: str = "starting") -> None:
    """Registers the SIGUSR1 stack dump and writes the first heartbeat of process `name`; a second call for the
    same process and run (an entry point that installed it before loading torch) only records `doing`."""
    if _state and _state["name"] == name and _state["dir"] == heartbeats_dir(output_dir):
        beat(doing)
        return
    stacks = stacks_dir(output_dir)
    stacks.mkdir(parents=True, exist_ok=True)
    # Kept open for the life of the process: faulthandler writes from a signal handler, with no allocation.
    dump_file = open(stacks / f"{name}.txt", "a")
    stack_file = None
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True, chain=False)
        stack_file = str(Path(dump_file.name).resolve())
    _state.update(
        dir=heartbeats_dir(output_dir), name=name, dump_file=dump_file, doing=None, written=0.0, stack_file=stack_file
    )
    _state["dir"].mkdir(parents=True, exist_ok=True)
    beat(doing)


def beat(doing: str, min_interval: float = 0.5) -> None:
    """Records what this process does now. Same text within `min_interval` s: skipped (cheap in hot loops)."""
    if not _state:
        return
    now = time.time()
    if doing == _state["doing"] and now - _state["written"] < min_interval:
        return
    _state["doing"], _state["written"] = doing, now
    record = {
        "name": _state["name"],
        "pid": os.getpid(),
        "time": now,
        "doing": doing,
        "stack_file": _state["stack_file"],
    }
    write_text_atomic(_state["dir"] / _state["name"], json.dumps(record), fsync=False)


def read_heartbeats(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every process's last heartbeat, sorted by name; unreadable files are skipped (a write in flight)."""
    out = []
    d = heartbeats_dir(output_dir)
    if not d.is_dir():
        return out
    for path in sorted(d.iterdir()):
        if path.name.startswith("."):
            continue
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out
