"""Which finished rollout groups may enter the next batch, and how far generation may run ahead of training.

`RolloutQueue` is the pure part (no asyncio, no clock): groups enter the generation queue at increasing
positions as they are launched, finish in any order, and `take` hands out finished ones under a window rule:
only positions in [H, H + W) are visible, any finished group inside the window is taken at once, none outside it
ever is, and the head H advances only as the group at H is consumed (MiniMax Forge's windowed FIFO). W = 1 is
strict FIFO; W = None is greedy (first finished, first out). Scripted completion orders in the tests pin this.

`SchedulePolicy` maps `[orchestrator.scheduler]` to the loop's two knobs: the policy lag a step waits for
(weights version >= step - lag before the step's groups are launched or taken) and whether generation is a
continuous producer (groups launched ahead, up to `max_in_flight`, across step boundaries) or per-step (exactly
one step's groups launched when the step starts, as the walking skeleton did):
- `sync`: lag = step mod sync_interval (every sync_interval-th step waits for fully on-policy weights), per-step.
- `one_step_off`: lag 1, per-step (the default).
- `async`: lag `scheduler.lag` (default max_off_policy_steps), continuous, strict FIFO order.
- `greedy`: the same lag, continuous, first finished first out.
- `windowed_fifo`: lag `scheduler.lag` (default max_off_policy_steps - slack), continuous, window W, where
  slack = ceil(W / groups per step) (at most max_off_policy_steps): a group overtaken by the whole window is
  trained that many steps later than the admission rule planned, so the loop launches only up to
  max_off_policy_steps - slack steps ahead and the window's waits never turn into stale drops (which would skew
  the batch mix toward easy, fast tasks).
Every mode drops (and counts) a group with a token older than max_off_policy_steps when it is taken.
Oversampling (per-step modes) and partial rollouts (aborting stragglers out of the window) are applied by the
generation pool (arbor.orchestrator.generation, arbor.orchestrator.parking) on top of this queue: a moved group
is `discard`ed at its old position and `launch`ed again at the tail.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Generic, TypeVar

from arbor.config.orchestrator import OrchestratorConfig

T = TypeVar("T")


class RolloutQueue(Generic[T]):
    """The generation queue: positions 0, 1, 2, ... in launch order; see the module docstring."""

    def __init__(self, window: int | None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None (greedy), got {window}")
        self.window = window
        self.head = 0
        """H: the lowest position not yet consumed."""
        self.next_position = 0
        self._finished: dict[int, T] = {}
        self._consumed: set[int] = set()  # consumed positions above the head (taken out of order)

    def launch(self) -> int:
        """Registers a newly launched group; returns its position."""
        pos = self.next_position
        self.next_position += 1
        return pos

    def finish(self, position: int, item: T) -> None:
        if not (self.head <= position < self.next_position) or position in self._consumed:
            raise ValueError(f"position {position} is not in flight (head {self.head}, next {self.next_position})")
        self._finished[position] = item

    def discard(self, position: int) -> None:
        """Consumes a position without an item (a launch that failed or was cancelled for good)."""
        self._finished.pop(position, None)
        self._consume(position)

    @property
    def in_flight(self) -> int:
        """Launched, not finished, not consumed."""
        return self.next_position - self.head - len(self._consumed) - len(self._finished)

    @property
    def waiting(self) -> int:
        """Finished, not consumed (visible or blocked outside the window)."""
        return len(self._finished)

    @property
    def outstanding(self) -> int:
        """Launched and not consumed: in flight plus waiting."""
        return self.in_flight + self.waiting

    @property
    def ready(self) -> int:
        """Finished and visible (inside the window) right now."""
        return sum(1 for p in self._finished if self._visible(p))

    def _visible(self, position: int) -> bool:
        return self.window is None or position < self.head + self.window

    def _consume(self, position: int) -> None:
        self._consumed.add(position)
        while self.head in self._consumed:
            self._consumed.remove(self.head)
            self.head += 1

    def take(self, limit: int | None = None) -> list[tuple[int, T]]:
        """Finished groups inside the window, lowest position first, at most `limit`; they are consumed. The
        window is re-evaluated as the head advances, so a batch may take a group that enters the window because
        the head was taken in this same call."""
        out: list[tuple[int, T]] = []
        while limit is None or len(out) < limit:
            visible = [p for p in self._finished if self._visible(p)]
            if not visible:
                break
            p = min(visible)
            out.append((p, self._finished.pop(p)))
            self._consume(p)
        return out


@dataclasses.dataclass(frozen=True)
class SchedulePolicy:
    mode: str
    continuous: bool
    window: int | None
    max_in_flight: int
    lag_interval: int
    fixed_lag: int
    per_step: int = 0
    """Per-step modes: groups launched for a step (ceil(oversample x groups per step))."""
    slack: int = 0
    """Continuous modes: steps of the staleness bound kept free by the admission rule (module docstring)."""

    @classmethod
    def from_config(cls, cfg: OrchestratorConfig) -> "SchedulePolicy":
        s = cfg.scheduler
        groups = cfg.batch_size // cfg.group_size
        mode = s.mode
        continuous = mode in ("async", "greedy", "windowed_fifo")
        window = {"async": 1, "greedy": None, "windowed_fifo": s.window or max(1, groups // 2)}.get(mode)
        if not continuous:
            window = None  # per-step: all of the step's groups are needed, order is irrelevant
        launched = math.ceil(s.oversample * groups)
        in_flight = s.max_in_flight or (2 * groups if continuous else cfg.max_concurrent_groups or launched)
        slack = min(math.ceil(window / groups), cfg.max_off_policy_steps) if mode == "windowed_fifo" else 0
        if mode == "one_step_off":
            lag = 1
        else:
            lag = s.lag if s.lag is not None else cfg.max_off_policy_steps - slack
        return cls(
            mode,
            continuous,
            window,
            in_flight,
            s.sync_interval if mode == "sync" else 0,
            lag,
            groups if continuous else launched,
            slack,
        )

    def lag(self, step: int) -> int:
        """Versions the policy serving `step`'s generation may trail `step` by."""
        if self.mode == "sync":
            return step % self.lag_interval
        return self.fixed_lag


def staleness_histogram(staleness: Iterable[int]) -> dict[str, int]:
    """`{"staleness/hist_0": n0, "staleness/hist_1": n1, ...}` over rollouts."""
    out: dict[str, int] = {}
    for s in staleness:
        key = f"staleness/hist_{int(s)}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))
