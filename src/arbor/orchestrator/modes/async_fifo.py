"""`async`: continuous, strict FIFO (W = 1: a batch takes groups in launch order, a straggler at the head holds
the rest back until it finishes or, with partial rollouts, is moved), lag `scheduler.lag` (default
max_off_policy_steps). The module is not named `async`, a Python keyword."""

from __future__ import annotations

from arbor.orchestrator.modes.base import ContinuousMode
from arbor.orchestrator.scheduler import ModeSettings


class AsyncMode(ContinuousMode):
    def __init__(self, settings: ModeSettings) -> None:
        super().__init__(settings, window=1)
