"""The two producer styles the built-in scheduling modes share: per-step and continuous.

A per-step mode launches exactly one step's groups (ceil(oversample x groups per step), replacements for
dropped ones, parked ones resumed first) when the step starts, sees the whole queue (every group of the step is
needed, so order is irrelevant) and leaves the surplus of a full batch to be cancelled or parked. A continuous
mode keeps up to the in-flight limit generating across step boundaries but launches only groups the staleness
bound will still admit when their step comes (AReaL's rule): the outstanding groups fill the rest of this step's
batch, then the next steps', in order, up to max_off_policy_steps - slack steps ahead of the fleet's version.
The modes themselves (sync, one_step_off, async_fifo, greedy, windowed_fifo) differ by their lag, window and
slack.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

from arbor.orchestrator.scheduler import ModeSettings, RolloutQueue


class PerStepMode(abc.ABC):
    """One step's groups at a time; subclasses say the lag."""

    continuous = False
    window: int | None = None
    slack = 0

    def __init__(self, settings: ModeSettings) -> None:
        s = settings.scheduler
        if s.lag is not None:  # the registered modes are checked by the config already; this is for plugins
            raise ValueError(f"orchestrator.scheduler.lag applies to the continuous modes, not to {s.mode!r}")
        self.per_step = math.ceil(s.oversample * settings.groups_per_step)
        """Groups launched for a step (oversampled)."""
        self.max_in_flight = s.max_in_flight or settings.max_concurrent_groups or self.per_step
        self.most_in_flight = self.per_step
        self.queue_budget = max(1, settings.max_off_policy_steps) * settings.groups_per_step

    @abc.abstractmethod
    def lag(self, step: int) -> int: ...

    def admits(self, step: int, kept: int, need: int, version: int, queue: RolloutQueue, max_in_flight: int) -> bool:
        """Until the step's launches are kept, running or ready, under the in-flight limit."""
        return kept + queue.in_flight + queue.ready < self.per_step and queue.in_flight < max_in_flight

    def pick(self, ready: Sequence[int]) -> int:
        return ready[0]


class ContinuousMode:
    """Groups launched ahead under the staleness bound; subclasses say the window and the slack."""

    continuous = True

    def __init__(self, settings: ModeSettings, window: int | None, slack: int = 0) -> None:
        s, groups = settings.scheduler, settings.groups_per_step
        self.window, self.slack = window, slack
        self.ahead = settings.max_off_policy_steps - slack
        """Steps ahead of the fleet's policy version the launch rule admits."""
        self.fixed_lag = s.lag if s.lag is not None else self.ahead
        self.max_in_flight = s.max_in_flight or 2 * groups
        self.most_in_flight = (self.ahead + 1) * groups  # the staleness rule admits no more
        # A finished group waiting this many steps' batches deep is trained at the edge of the staleness bound.
        self.queue_budget = max(1, self.ahead) * groups

    def lag(self, step: int) -> int:
        return self.fixed_lag

    def admits(self, step: int, kept: int, need: int, version: int, queue: RolloutQueue, max_in_flight: int) -> bool:
        """Under the in-flight limit, while the outstanding groups fill no step beyond `ahead` of `version`."""
        return queue.in_flight < max_in_flight and step + (kept + queue.outstanding) // need - version <= self.ahead

    def pick(self, ready: Sequence[int]) -> int:
        return ready[0]
