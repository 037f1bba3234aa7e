"""`windowed_fifo` (MiniMax Forge): continuous, window W = `scheduler.window` (default half a step's groups):
any finished group in [H, H + W) is taken at once, none beyond. A group can be overtaken by up to W - 1 others,
i.e. trained up to slack = ceil(W / groups per step) steps (at most max_off_policy_steps) later than its launch
planned, so the mode launches only up to max_off_policy_steps - slack steps ahead and its lag defaults to that
too: the window's waits never turn into stale drops (which would skew the batch mix toward easy, fast tasks).
benchmarks/scheduler_sim.py models the rule."""

from __future__ import annotations

import math

from arbor.orchestrator.modes.base import ContinuousMode
from arbor.orchestrator.scheduler import ModeSettings


class WindowedFifoMode(ContinuousMode):
    def __init__(self, settings: ModeSettings) -> None:
        groups = settings.groups_per_step
        window = settings.scheduler.window or max(1, groups // 2)
        super().__init__(settings, window, slack=min(math.ceil(window / groups), settings.max_off_policy_steps))
