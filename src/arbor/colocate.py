"""The turns of a colocated run (`inference.colocate`): trainer and inference engine share one device and take it
in turn, handing it over through files in the run directory.

    orchestrator                                 trainer
    generate step N (engine awake)               offloaded (params, optimizer state on the host; no grads)
    ... step N+1 needs version N+1 - lag:
    engine /sleep (weights, KV cache released)
    write colocate/train_K  ───────────────────► onload, train step K, publish K+1, offload
                            ◄─────────────────── write colocate/generated_K
    engine /wake_up, load version K+1 in place
    generate step N+1

Every wait is bounded and checks that its partner is alive (a dead side ends the wait in one line naming the file
that never came, never a hang), and each side says in its heartbeat what it waits for. The launcher starts the
engine only once the trainer has built and offloaded its state (`colocate/ready`), so that the engine's memory
profile sees the device as the generate phase will. Standard library only: trainer and orchestrator import it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import time
from collections.abc import Callable
from pathlib import Path

from arbor.run_dir import PathLike, colocate_dir, poll_interval, write_text_atomic


class TurnTimeout(TimeoutError):
    """A turn file did not appear within its bound: one line naming the file and the side that should write it."""


def train_turn(output_dir: PathLike, step: int) -> Path:
    """Written by the orchestrator once the engine sleeps: the trainer may train `step`."""
    return colocate_dir(output_dir) / f"train_{step}"


def generate_turn(output_dir: PathLike, step: int) -> Path:
    """Written by the trainer once step `step` is trained, published and its state offloaded: the engine may wake."""
    return colocate_dir(output_dir) / f"generated_{step}"


def ready_path(output_dir: PathLike) -> Path:
    """Written by the trainer once its model is built (and, on a resume, republished) and offloaded."""
    return colocate_dir(output_dir) / "ready"


def turns_log(output_dir: PathLike) -> Path:
    """One JSON line per hand-over, appended by the orchestrator: the step and both sides' figures of its phases."""
    return colocate_dir(output_dir) / "turns.jsonl"


def hand_over(path: Path, **figures: float) -> None:
    """Writes one turn file (atomically; `figures`, e.g. the side's memory at the hand-over, as its JSON body)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"time": time.time(), **figures}))


def _look(path: Path, start: float, timeout: float, writer: str, alive: Callable[[], bool]) -> float | None:
    """None once `path` exists; else how long to sleep before the next look. TurnTimeout past `timeout` seconds
    since `start`, RuntimeError as soon as `alive()` turns False."""
    if path.exists():
        return None
    waited = time.monotonic() - start
    if waited > timeout:
        raise TurnTimeout(f"colocated run: {writer} did not hand the device over within {timeout:.0f}s ({path})")
    if not alive():
        raise RuntimeError(f"colocated run: stopped while waiting for {writer} ({path})")
    return poll_interval(waited)


def wait_turn(path: Path, timeout: float, writer: str, alive: Callable[[], bool] = lambda: True) -> dict[str, float]:
    """Blocks until `path` exists (looking as often as `arbor.run_dir.poll_interval` says); returns its figures.
    TurnTimeout after `timeout` seconds, RuntimeError as soon as `alive()` turns False."""
    start = time.monotonic()
    while (pause := _look(path, start, timeout, writer, alive)) is not None:
        time.sleep(pause)
    return json.loads(path.read_text() or "{}")


async def wait_turn_async(path: Path, timeout: float, writer: str, alive: Callable[[], bool] = lambda: True) -> dict:
    """`wait_turn` for an event loop: sleeps between looks instead of blocking the loop."""
    start = time.monotonic()
    while (pause := _look(path, start, timeout, writer, alive)) is not None:
        await asyncio.sleep(pause)
    return json.loads(path.read_text() or "{}")


def host_memory() -> dict[str, float]:
    """This process's resident memory now and its peak since the last `reset_peak` (Linux: VmRSS, VmHWM), in
    bytes; empty where /proc is not there. What a colocated run records at each hand-over, so that the memory of
    each phase is measured, not assumed."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.partition(":") for line in lines)
    kb = {k: float(v.split()[0]) * 1024 for k, _, v in fields if k in ("VmRSS", "VmHWM")}
    return {"rss_bytes": kb.get("VmRSS", 0.0), "peak_rss_bytes": kb.get("VmHWM", 0.0)}


def reset_peak() -> None:
    """Restarts the peak (`VmHWM`) from the current resident size (Linux >= 4.0: `clear_refs` 5); a no-op elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def return_freed_memory() -> None:
    """Hands the memory freed by a release back to the system (glibc's `malloc_trim`): without it the allocator
    keeps freed pages of the heap for later use, and a sleeping engine or an offloaded trainer would go on holding
    them. A no-op where glibc is not the C library."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(ctypes.c_size_t(0))
