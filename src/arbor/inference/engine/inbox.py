"""The hand-off between the local engine's callers (any thread) and its engine thread: queued requests, control
commands, remembered abort ids and the stop/failure state, all behind one condition variable.

Callers add work (`submit`, `command`); the engine thread waits for it (`wait_for_work`), takes requests in
order as slots free up (`next_admissible`) and drains everything when it stops (`close`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import random
import threading
from collections.abc import Callable
from typing import Any

from arbor.inference.engine.params import EngineUnavailable, SamplingParams
from arbor.inference.engine.requests import EngineStats, Request, resolve

ABORT_MEMORY = 65536
"""Aborted request ids an engine remembers (for requests that arrive after their abort)."""


@dataclasses.dataclass
class Command:
    """A control command for the engine thread ("pause", "resume", "abort", "update", "load_lora" or
    "unload_lora"), resolved by it."""

    kind: str
    args: tuple[Any, ...]
    future: concurrent.futures.Future


class Inbox:
    """Thread-safe queues into the engine thread; `seed` seeds the requests that bring none (reproducible per run)."""

    def __init__(self, seed: int) -> None:
        self.cv = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()
        self.commands: collections.deque[Command] = collections.deque()
        self.stopping = False
        self.dead: BaseException | None = None
        self._seeds = random.Random(seed)
        # Ids aborted recently: a request that reaches the engine after its abort (it was still in transit)
        # finishes at once instead of running to the end. Bounded: only the newest ABORT_MEMORY are kept.
        self._aborted_ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    # ---- caller side ----

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None,
        adapter: str | None = None,
        images: dict | None = None,
    ) -> Request:
        """Queues a request (resolved at once, empty, if its id was aborted already)."""
        with self.cv:
            self.raise_if_stopped()
            seed = params.seed if params.seed is not None else self._seeds.randrange(2**62)
            req = Request(prompt, params, seed, request_id, adapter, images)
            if request_id is not None and request_id in self._aborted_ids:
                resolve(req.future, req.aborted_output())
                return req
            self.waiting.append(req)
            self.cv.notify_all()
        return req

    def command(self, kind: str, *args: Any) -> concurrent.futures.Future:
        cmd = Command(kind, args, concurrent.futures.Future())
        with self.cv:
            self.raise_if_stopped()
            self.commands.append(cmd)
            self.cv.notify_all()
        return cmd.future

    def remember_aborted(self, ids: frozenset[str]) -> None:
        with self.cv:
            for rid in ids:
                self._aborted_ids[rid] = None
                self._aborted_ids.move_to_end(rid)
            while len(self._aborted_ids) > ABORT_MEMORY:
                self._aborted_ids.popitem(last=False)

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()

    def raise_if_stopped(self) -> None:
        if self.dead is not None:
            raise EngineUnavailable(f"inference engine failed: {self.dead!r}")
        if self.stopping:
            raise EngineUnavailable("inference engine stopped")

    def snapshot(self, stats: EngineStats) -> EngineStats:
        """A copy of the engine thread's `stats` with the number of queued samples filled in."""
        with self.cv:
            s = dataclasses.replace(stats)
            s.waiting = sum(r.params.n for r in self.waiting)
            return s

    # ---- engine thread ----

    def wait_for_work(self, paused: bool, running: bool) -> list[Command] | None:
        """Blocks until there is something to do; returns the pending commands, or None once stopping."""
        with self.cv:
            while not (self.stopping or self.commands or (not paused and (running or self.waiting))):
                self.cv.wait(timeout=1.0)
            if self.stopping:
                return None
            commands = list(self.commands)
            self.commands.clear()
            return commands

    def next_admissible(self, free_slots: int) -> Request | None:
        """Pops the head of the queue (skipping abandoned requests) if its samples fit in `free_slots`."""
        with self.cv:
            while self.waiting and self.waiting[0].abandoned:
                self.waiting.popleft()
            if not self.waiting or self.waiting[0].params.n > free_slots:
                return None
            return self.waiting.popleft()

    def take_waiting(self, hit: Callable[[Request], bool]) -> list[Request]:
        """Removes and returns the queued requests that `hit` selects."""
        with self.cv:
            taken = [r for r in self.waiting if hit(r)]
            self.waiting = collections.deque(r for r in self.waiting if not hit(r))
            return taken

    def close(self) -> tuple[list[Request], list[Command]]:
        """Marks the inbox stopped and empties it; returns what was queued."""
        with self.cv:
            self.stopping = True
            requests, commands = list(self.waiting), list(self.commands)
            self.waiting.clear()
            self.commands.clear()
            return requests, commands
