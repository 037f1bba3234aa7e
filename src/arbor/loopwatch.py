"""Names the code that blocks a process's event loop, while it blocks.

Blocking code run on the event loop (an environment's `time.sleep`, `requests.get`, `subprocess.run` or
CPU-bound verifier called from `async def`, without `asyncio.to_thread`) stops every rollout, the weight sync
and the gateway until it returns, and an environment's timeout cannot cancel it (arbor.environments.guard): the
run only looks slow. `LoopWatch` makes it visible. A task on the loop stamps the time every `INTERVAL`
seconds; a daemon thread that finds the stamp older than `threshold` takes the loop thread's stack
(`sys._current_frames`) and logs where the loop is stuck: the innermost frames outside the standard library,
with the line being run. Each place is logged once (a scorer that blocks on every call would otherwise log on
every call); every stall is summed into `blocked`, which the orchestrator reports per step as
`time/loop_blocked`.

A thread cannot preempt C code that holds the GIL, so such a stall is named when the GIL is released, late; a
stall in `time.sleep`, socket I/O or Python code is named within `INTERVAL` of crossing the threshold.
"""

from __future__ import annotations

import asyncio
import linecache
import logging
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType

log = logging.getLogger("arbor.loopwatch")

INTERVAL = 0.1
"""Seconds between two stamps of the loop, and between two looks of the watching thread."""
STDLIB = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib"))


class LoopWatch:
    """Use as `async with LoopWatch(threshold) as watch:` on the loop to watch; `take()` gives the seconds the loop
    was blocked since the last call."""

    def __init__(self, threshold: float = 1.0) -> None:
        self.threshold = threshold
        self.blocked = 0.0
        """Seconds the loop was blocked beyond its stamping interval, in stalls longer than `threshold`."""
        self._taken = 0.0
        self._stamp = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._named: set[str] = set()
        """Places already logged."""
        self._seen = False
        """The watching thread has seen the current stall."""
        self._logged = False
        """... and logged it (a new place)."""
        self._stop = threading.Event()
        self._stamping: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._watch, name="arbor-loopwatch", daemon=True)

    async def __aenter__(self) -> "LoopWatch":
        self._loop_thread = threading.get_ident()
        self._stamp = time.monotonic()
        self._stamping = asyncio.create_task(self._stamp_loop())
        self._thread.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._stamping is not None:
            self._stamping.cancel()
            await asyncio.gather(self._stamping, return_exceptions=True)

    def take(self) -> float:
        """Seconds blocked since the last `take`."""
        out, self._taken = self.blocked - self._taken, self.blocked
        return out

    async def _stamp_loop(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            now = time.monotonic()
            gap = now - self._stamp - INTERVAL
            self._stamp = now
            if gap > self.threshold:
                self.blocked += gap
                if self._logged:
                    log.warning("the event loop ran again after %.1fs blocked", gap)
            self._seen = self._logged = False

    def _watch(self) -> None:
        while not self._stop.wait(INTERVAL):
            lag = time.monotonic() - self._stamp - INTERVAL
            if lag <= self.threshold or self._seen:
                continue
            self._seen = True
            where = place(sys._current_frames().get(self._loop_thread))
            if where in self._named:
                continue
            self._named.add(where)
            self._logged = True
            log.warning(
                "the event loop has been blocked for %.1fs at %s: nothing else runs meanwhile (rollouts, "
                "weight updates, the gateway); blocking work in a coroutine (time.sleep, requests, "
                "subprocess.run, CPU-bound scoring) belongs in asyncio.to_thread or an async client (logged "
                "once per place; every stall counts in time/loop_blocked)",
                lag,
                where,
            )


def place(frame: FrameType | None, depth: int = 3) -> str:
    """Where `frame` is: its innermost `depth` frames outside the standard library, outermost first, and the
    line the innermost is running."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    own = [f for f in frames if not str(Path(f.f_code.co_filename).resolve()).startswith(STDLIB)] or frames[:1]
    if not own:
        return "an unknown place"
    chain = " -> ".join(f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})" for f in reversed(own[:depth]))
    line = linecache.getline(own[0].f_code.co_filename, own[0].f_lineno).strip()
    return f"{chain}" + (f": `{line}`" if line else "")
