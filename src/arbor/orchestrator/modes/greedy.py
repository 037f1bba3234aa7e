"""`greedy`: continuous, first finished first out (no window: the whole queue is visible, nothing ever blocks, and
fast, easy tasks crowd the batch mix), lag `scheduler.lag` (default max_off_policy_steps)."""

from __future__ import annotations

from arbor.orchestrator.modes.base import ContinuousMode
from arbor.orchestrator.scheduler import ModeSettings


class GreedyMode(ContinuousMode):
    def __init__(self, settings: ModeSettings) -> None:
        super().__init__(settings, window=None)
