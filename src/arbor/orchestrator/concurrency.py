"""Live throughput matching: the in-flight limit of the generation pool, adapted after every step.

The generator (the inference fleet, fed by the groups in flight) produces rollouts and the trainer consumes them.
When the trainer waits for rollouts, generation is the bottleneck and more groups in flight let the fleet batch
more (up to what the scheduler mode can use); when finished groups queue up beyond the staleness budget the
generator runs ahead of the trainer and its surplus ages toward stale drops, so fewer groups are launched. Neither
condition: the limit stays, so a matched run does not oscillate.

`ConcurrencyController` is pure (no clock, no asyncio): `decide` takes one step's figures and returns the limit
for the next admissions; the tests feed it figures. The orchestrator feeds it the trainer's newest
`throughput/trainer_wait_frac` (time waiting for rollouts over the step's time), and only once per trainer row,
so that a figure is never acted on twice. `IdleClock` measures the generator-idle fraction: the share of wall time
no group was in flight (the fleet then has no request of this run to serve).
"""

from __future__ import annotations

import dataclasses
import math

from arbor.orchestrator.scheduler import ModeSettings, SchedulingMode

WAIT_THRESHOLD = 0.1
"""Trainer-wait fraction above which generation counts as the bottleneck: below it the wait is the fixed cost of
reading a batch file, which more concurrency cannot remove."""


@dataclasses.dataclass
class ConcurrencyController:
    """The in-flight limit within [low, high]; `budget` is how many finished groups may wait in the queue after a
    batch is taken before the generator counts as running ahead."""

    limit: int
    low: int
    high: int
    budget: int
    enabled: bool = True

    @classmethod
    def for_mode(cls, mode: SchedulingMode, settings: ModeSettings) -> "ConcurrencyController":
        """Bounds from the mode (its default limit, the most it can use, its queue budget) unless
        `[orchestrator.scheduler]` sets them; off when the in-flight limit is set by hand."""
        s = settings.scheduler
        by_hand = s.max_in_flight is not None or settings.max_concurrent_groups is not None
        high = s.adaptive_max or max(mode.most_in_flight, mode.max_in_flight)
        low = min(s.adaptive_min, high)
        enabled = s.adaptive and not by_hand
        start = min(max(mode.max_in_flight, low), high) if enabled else mode.max_in_flight
        return cls(start, low, high, mode.queue_budget, enabled=enabled)

    def decide(self, trainer_wait_frac: float | None, queue_depth: int, dropped_stale: int) -> int:
        """The limit after a step whose batch left `queue_depth` finished groups waiting and dropped
        `dropped_stale` stale ones; `trainer_wait_frac` is None when no new trainer figure arrived since the
        last decision (the queue's figures still count)."""
        if not self.enabled:
            return self.limit
        stride = max(1, math.ceil(self.limit / 4))  # a quarter per step: a few steps from one bound to the other
        if queue_depth > self.budget or dropped_stale > 0:
            self.limit = max(self.low, self.limit - stride)
        elif trainer_wait_frac is not None and trainer_wait_frac > WAIT_THRESHOLD:
            self.limit = min(self.high, self.limit + stride)
        return self.limit


class IdleClock:
    """Seconds with no group in flight, between two `lap`s; times are passed in (monotonic seconds)."""

    def __init__(self, now: float) -> None:
        self._idle_since: float | None = now  # nothing is in flight before the first launch
        self._idle = 0.0
        self._lap = now

    def busy(self, now: float) -> None:
        """A group was launched."""
        if self._idle_since is not None:
            self._idle += now - self._idle_since
            self._idle_since = None

    def idle(self, now: float) -> None:
        """The last group in flight finished."""
        if self._idle_since is None:
            self._idle_since = now

    def lap(self, now: float) -> float:
        """The idle fraction of the time since the previous lap (0 when no time passed); starts a new lap."""
        idle = self._idle + (now - self._idle_since if self._idle_since is not None else 0.0)
        span, self._lap, self._idle = now - self._lap, now, 0.0
        if self._idle_since is not None:
            self._idle_since = now
        return min(idle / span, 1.0) if span > 0 else 0.0
