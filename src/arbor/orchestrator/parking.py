"""Partial-rollout moves on the generation queue: parking the surplus, resuming it, and moving stragglers.

Every group generates through a resumable `GroupHandle` (arbor.orchestrator.partial), so the scheduler can
abort a group (its tokens kept, its environment coroutine suspended) and resume it later at the queue's tail.

- Per-step modes, batch full (`surplus`): the groups still generating are cancelled or, with partial rollouts,
  aborted and parked; a group already resumed max_resumes times keeps running into the next step.
- Per-step modes, next step (`unpark`): parked groups are resumed first, oldest first, at the queue's tail;
  one whose oldest token is already too stale for the step is dropped (counted) instead.
- Continuous modes with a window, when the loop is about to wait (`move_stragglers`): a window member running
  longer than straggler_factor x the median of recent group durations leaves its position (the head advances)
  and either continues at the tail (`straggler_action = "resume"`: abort + immediate resume; dropped when too
  stale; a group resumed max_resumes times stays) or is cancelled and its task launched again as a new group at
  the tail (`"retry"`, arbor.orchestrator.tasks; given up after max_resumes retries).
  benchmarks/scheduler_sim.py models that rule.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import statistics
import time
from collections.abc import Iterable

from arbor.config.orchestrator import PartialConfig
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.partial import GroupHandle, PartialRollouts
from arbor.orchestrator.scheduler import RolloutQueue
from arbor.orchestrator.tasks import TaskSource

STRAGGLER_MIN_FINISHED, STRAGGLER_RECENT = 8, 1024
"""The straggler rule's median is over the last STRAGGLER_RECENT finished groups, once MIN_FINISHED have. A long
memory on purpose: while the window waits, launches pause and the last groups to finish are the slow ones, so a
median of only the last few dozen climbs exactly when the rule is needed (the window then stalls for longer)."""


@dataclasses.dataclass(eq=False)
class Flight:
    """One group's generation: its queue position, task and resumable handle."""

    pos: int
    task: asyncio.Task
    handle: GroupHandle
    since: float
    """When it took its current position (launch, or relaunch at the tail)."""
    started: float
    version: int
    """Policy version the fleet served at launch: no token of it is older."""
    parked: bool = False

    @property
    def oldest(self) -> int:
        v = self.handle.oldest_version
        return self.version if v is None else min(v, self.version)


@dataclasses.dataclass(frozen=True)
class ParkingSettings:
    """What the partial-rollout moves read of the orchestrator config (arbor.orchestrator.main hands it out)."""

    partial: PartialConfig
    group_size: int
    """Rollouts a dropped group counts for in dropped/stale."""
    max_off_policy_steps: int
    """A parked or moved group with a token older than this at the step is dropped, not resumed."""


class Parking:
    """The moves above, on `queue`; the generation pool passes its flights and its partial-rollout controller."""

    def __init__(
        self, settings: ParkingSettings, queue: RolloutQueue[asyncio.Task], source: TaskSource, counts: Counts
    ) -> None:
        self.settings, self.queue, self.source, self.counts = settings, queue, source, counts
        self.parked: list[Flight] = []
        """Per-step modes: surplus groups aborted at batch fill, oldest first."""
        self.durations: collections.deque[float] = collections.deque(maxlen=STRAGGLER_RECENT)
        """Launch-to-finish seconds of the recent finished groups (the straggler rule's median)."""

    def finished(self, flight: Flight, seconds: float | None) -> None:
        """A group's generation ended (seconds: None when it was cancelled)."""
        if flight in self.parked:
            self.parked.remove(flight)
        if seconds is not None:
            self.durations.append(seconds)

    def unpark(self, step: int) -> bool:
        """Resumes the oldest parked group at the queue's tail (True), dropping parked groups whose oldest token
        is already too stale for this step; False when none is left."""
        while self.parked:
            f = self.parked.pop(0)
            if f.task.done():
                continue
            if step - f.oldest > self.settings.max_off_policy_steps:
                self.counts.dropped_stale += self.settings.group_size
                f.task.cancel()
                continue
            self._requeue(f, "resumed")
            return True
        return False

    async def surplus(self, flights: Iterable[Flight], partial: PartialRollouts) -> None:
        """Per-step modes, batch full: groups still generating are cancelled, or parked for the next step (partial
        rollouts); a group already resumed max_resumes times keeps running into the next step."""
        cfg = self.settings
        running = [f for f in flights if not f.parked and not f.task.done()]
        if not running:
            return
        if not cfg.partial.enabled:
            for f in running:
                f.task.cancel()
            self.counts.partial["cancelled"] += len(running)
            return
        park = [f for f in running if f.handle.resumes < cfg.partial.max_resumes]
        for f in park:
            self.queue.discard(f.pos)
            f.parked = True
        self.parked.extend(park)
        await partial.abort([f.handle for f in park])
        self.counts.partial["parked"] += len(park)

    async def move_stragglers(self, step: int, flights: dict[int, Flight], partial: PartialRollouts) -> float | None:
        """Takes window members running longer than straggler_factor x the recent median group duration out of
        their positions and continues them at the tail (resume; too stale ones are dropped) or relaunches their
        tasks there (retry). Returns when the next window member becomes a straggler (None: never, as things
        stand; now: some moved, look at the queue again at once)."""
        cfg, q = self.settings, self.queue
        if q.window is None or len(self.durations) < STRAGGLER_MIN_FINISHED:
            return None
        retry = cfg.partial.straggler_action == "retry"
        limit = cfg.partial.straggler_factor * statistics.median(self.durations)
        now, due, movers = time.monotonic(), [], []
        for key, f in flights.items():
            if f.parked or f.task.done() or not q.head <= f.pos < q.head + q.window:
                continue
            if not retry and f.handle.resumes >= cfg.partial.max_resumes:
                continue
            if now - f.since > limit:
                movers.append((key, f))
            else:
                due.append(f.since + limit)
        if not movers:
            return min(due) if due else None
        for _, f in movers:
            q.discard(f.pos)
            f.parked = True  # until relaunched below; a finish in between is handled by the pool's callback
        await partial.abort([f.handle for _, f in movers])
        for key, f in movers:
            if f.task.done():
                continue
            if retry:
                self._retry(key, f)
            elif step - f.oldest > cfg.max_off_policy_steps:  # its tokens can never be trained
                self.counts.dropped_stale += cfg.group_size
                f.task.cancel()
            else:
                self._requeue(f, "moved")
        return time.monotonic()

    def _retry(self, key: int, f: Flight) -> None:
        """straggler_action = "retry": cancels the group (its tokens are discarded) and queues its task to be
        launched again, first, at the queue's tail with a new sampling seed, unless it was retried max_resumes
        times already: then it is given up."""
        queued = self.source.retry_group(key)
        f.task.cancel()
        self.counts.partial["retried" if queued else "given_up"] += 1

    def _requeue(self, f: Flight, event: str) -> None:
        """Continues a parked or moved group at the queue's tail."""
        f.parked, f.pos, f.since = False, self.queue.launch(), time.monotonic()
        f.handle.resume()
        self.counts.partial[event] += 1
