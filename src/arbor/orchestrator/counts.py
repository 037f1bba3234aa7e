"""Counters the orchestrator's parts add to and its figures report.

One `Counts` is shared by the generation pool (stale parked or moved groups, surplus, straggler moves and
retries, finished groups), the step assembler (stale and filtered groups) and the figures. `dropped_stale`,
`filtered` and `finished_groups` are cumulative; `partial` holds what the scheduler did to partial rollouts since
the last batch (the figures report and reset it).
"""

from __future__ import annotations

import dataclasses

FILTER_REASONS = ("zero_advantage", "difficulty", "env_skipped")
PARTIAL_EVENTS = ("cancelled", "parked", "resumed", "moved", "retried", "given_up")


@dataclasses.dataclass
class Counts:
    dropped_stale: int = 0
    """Rollouts dropped because a token was older than max_off_policy_steps."""
    finished_groups: int = 0
    """Groups the generator has produced (for the production rate)."""
    failed_groups: int = 0
    """Groups skipped because their generation failed for good (arbor.orchestrator.assembler)."""
    filtered: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FILTER_REASONS, 0))
    """Rollouts (groups, for env_skipped) the filters dropped, by reason."""
    partial: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(PARTIAL_EVENTS, 0))
    """Groups cancelled, parked, resumed, moved, retried or given up since the last batch."""

    def rejected(self) -> int:
        """Everything taken from the queue and not trained: stale drops plus filtered."""
        return self.dropped_stale + sum(self.filtered.values())
