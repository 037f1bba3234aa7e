"""A user's scheduling mode, kept outside arbor (tests/orchestrator/test_modes.py runs it): per-step and one step
behind like one_step_off, but a batch takes the newest finished groups first (LIFO)."""

from __future__ import annotations

from collections.abc import Sequence

from arbor.orchestrator.modes.base import PerStepMode


class NewestFirstMode(PerStepMode):
    def lag(self, step: int) -> int:
        return 1

    def pick(self, ready: Sequence[int]) -> int:
        return ready[-1]
