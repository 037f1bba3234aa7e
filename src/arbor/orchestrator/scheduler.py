"""Which finished rollout groups may enter the next batch, and how far generation may run ahead of training.

`RolloutQueue` is the pure part (no asyncio, no clock): groups enter the generation queue at increasing
positions as they are launched, finish in any order, and `take` hands out finished ones under a window rule:
only positions in [H, H + W) are visible, any finished group inside the window is taken at once (lowest position
first, unless the mode's `pick` orders them otherwise), none outside it ever is, and the head H advances only as
the group at H is consumed (MiniMax Forge's windowed FIFO). W = 1 is strict FIFO; W = None is greedy (first
finished, first out). Scripted completion orders in the tests pin this.

A scheduling mode (`SchedulingMode`, `[orchestrator.scheduler] mode`) decides everything else: whether generation
is a continuous producer (groups launched ahead, up to the in-flight limit, across step boundaries) or per-step
(exactly one step's groups launched when the step starts), the queue's window W, the order a batch takes the
visible finished groups in (`pick`), the policy lag a step waits for (weights version >= step - lag before the
step's groups are launched or taken), the launch rule (`admits`), the staleness slack it keeps free, and the
in-flight default and adaptive bounds (arbor.orchestrator.concurrency). The built-ins live in
arbor.orchestrator.modes, one module each, registered in arbor.registry.MODES; a user's mode is a dotted path.
Every mode drops (and counts) a group with a token older than max_off_policy_steps when it is taken.
Oversampling (per-step modes) and partial rollouts (aborting stragglers out of the window) are applied by the
generation pool (arbor.orchestrator.generation, arbor.orchestrator.parking) on top of this queue: a moved group
is `discard`ed at its old position and `launch`ed again at the tail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar, runtime_checkable

from arbor.config.orchestrator import RolloutScheduleConfig
from arbor.registry import MODES

T = TypeVar("T")


def lowest_first(ready: Sequence[int]) -> int:
    """The queue's default order: the lowest visible finished position (FIFO within the window)."""
    return ready[0]


class RolloutQueue(Generic[T]):
    """The generation queue: positions 0, 1, 2, ... in launch order; see the module docstring."""

    def __init__(self, window: int | None, pick: Callable[[Sequence[int]], int] = lowest_first) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None (greedy), got {window}")
        self.window = window
        self.pick = pick
        """Which of the visible finished positions (ascending, never empty) a batch takes next."""
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
        """Finished groups inside the window, in `pick` order (lowest position first by default), at most
        `limit`; they are consumed. The window is re-evaluated as the head advances, so a batch may take a group
        that enters the window because the head was taken in this same call."""
        out: list[tuple[int, T]] = []
        while limit is None or len(out) < limit:
            visible = sorted(p for p in self._finished if self._visible(p))
            if not visible:
                break
            p = self.pick(visible)
            if p not in visible:
                raise ValueError(f"pick chose position {p}, which is not one of the visible finished {visible}")
            out.append((p, self._finished.pop(p)))
            self._consume(p)
        return out


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """What a scheduling mode reads of the orchestrator config (arbor.orchestrator.main hands it out)."""

    scheduler: RolloutScheduleConfig
    """`[orchestrator.scheduler]`: the mode's name and knobs (lag, sync_interval, window, in-flight, oversample)."""
    groups_per_step: int
    """batch_size / group_size."""
    max_off_policy_steps: int
    """The staleness bound a taken group must meet."""
    max_concurrent_groups: int | None
    """The per-step modes' older in-flight knob (`orchestrator.max_concurrent_groups`)."""


@runtime_checkable
class SchedulingMode(Protocol):
    """Everything a scheduling mode decides. A mode is built as `Mode(settings: ModeSettings)`; the built-ins
    (arbor.orchestrator.modes) share the bases of arbor.orchestrator.modes.base."""

    continuous: bool
    """True: groups are launched ahead across step boundaries (the pool then moves stragglers out of the window
    and wakes on a newer policy); False: per-step, the surplus still generating when a batch is full is
    cancelled or parked for the next step (arbor.orchestrator.parking)."""
    window: int | None
    """W: only queue positions [H, H + W) are visible to a batch (and watched for stragglers); None: the whole
    queue (no straggler moves)."""
    slack: int
    """Steps of the staleness bound the launch rule keeps free (windowed FIFO: a group overtaken by the whole
    window is trained that many steps later than planned)."""
    max_in_flight: int
    """The in-flight limit before any adaptation (groups generating at once)."""
    most_in_flight: int
    """The most groups in flight the mode can use: the adaptive limit's default upper bound."""
    queue_budget: int
    """Finished groups that may wait in the queue after a batch is taken before the generator counts as running
    ahead (the adaptation then lowers the limit)."""

    def lag(self, step: int) -> int:
        """Versions the policy serving `step`'s generation may trail `step` by: the step waits for weights
        version >= step - lag(step)."""
        ...

    def admits(self, step: int, kept: int, need: int, version: int, queue: RolloutQueue, max_in_flight: int) -> bool:
        """Whether one more group may be launched (or a parked one resumed) now, for `step`, which has `kept` of
        its `need` groups, the fleet serving `version`, under the in-flight limit `max_in_flight`."""
        ...

    def pick(self, ready: Sequence[int]) -> int:
        """Which of the visible finished queue positions (ascending, never empty) a batch takes next."""
        ...


def build_mode(settings: ModeSettings) -> SchedulingMode:
    """The configured mode: a registered name (arbor.registry.MODES) or a user's dotted path."""
    name = settings.scheduler.mode
    try:
        factory = MODES.load(name)
    except ValueError as e:  # a plugin's path that does not import: say which setting named it
        raise ValueError(f"{MODES.field}: {e}") from None
    mode = factory(settings)
    if not isinstance(mode, SchedulingMode):  # a plugin's class that misses part of the interface
        missing = [m for m in (*SchedulingMode.__annotations__, "lag", "admits", "pick") if not hasattr(mode, m)]
        raise TypeError(f"{MODES.field}: {name!r} is not a SchedulingMode (it lacks {', '.join(sorted(missing))})")
    if mode.continuous and settings.scheduler.weight_updates == "between_steps":  # a plugin's (the config checks ours)
        raise ValueError(
            f"orchestrator.scheduler.weight_updates = 'between_steps' needs a per-step mode; {name!r} is continuous"
        )
    return mode


def staleness_histogram(staleness: Iterable[int]) -> dict[str, int]:
    """`{"staleness/hist_0": n0, "staleness/hist_1": n1, ...}` over rollouts."""
    out: dict[str, int] = {}
    for s in staleness:
        key = f"staleness/hist_{int(s)}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))
