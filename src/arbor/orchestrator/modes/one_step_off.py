"""`one_step_off` (the default): per-step, lag 1: batch N + 1 is generated while the trainer trains on batch N."""

from __future__ import annotations

from arbor.orchestrator.modes.base import PerStepMode


class OneStepOffMode(PerStepMode):
    def lag(self, step: int) -> int:
        return 1
