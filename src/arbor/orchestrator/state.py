"""The orchestrator's resumable state: which step comes next and where in the dataset it is.

State for step N (the dataset position right after batch N-1 was collected) is written to
`checkpoints/step_N/orchestrator.json` (`arbor.run_dir.orchestrator_state_path`) before batch N-1 is written,
so it sits beside the trainer checkpoint taken after N optimizer steps and always exists when that checkpoint
does (the trainer cannot take step N-1 before its batch exists). A resume from trainer checkpoint N restores exactly the
dataset position that
produced batch N the first time, plus the tasks that were launched but not yet trained (`pending`, relaunched
first), so no task is skipped or repeated. The file carries its own CRC-32 (arbor.checkpoint_manifest.seal_state):
a resume that finds it damaged falls back to an older checkpoint rather than start from a wrong position.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from arbor.checkpoint_manifest import open_state, seal_state
from arbor.run_dir import orchestrator_state_path, write_text_atomic


@dataclasses.dataclass
class OrchestratorState:
    step: int = 0
    epoch: int = 0
    position: int = 0
    curriculum: dict[str, Any] | None = None
    """CurriculumSampler.state() when the curriculum is on."""
    pending: list[int] = dataclasses.field(default_factory=list)
    """Dataset indices of tasks launched but in no batch yet when this state was saved (groups in flight, parked
    or finished but not taken), in launch order: a resumed orchestrator launches them first, so a crash skips no
    task."""


class TaskSampler:
    """Walks the dataset in a fresh seeded permutation each epoch; (epoch, position) is the whole state."""

    def __init__(self, tasks: list[dict[str, Any]], seed: int, epoch: int = 0, position: int = 0) -> None:
        if not tasks:
            raise ValueError("the environment's dataset is empty")
        self.tasks, self.seed, self.epoch, self.position = tasks, seed, epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> dict[str, Any]:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        task = self.tasks[self._order[self.position]]
        self.position += 1
        return task


def save_state(output_dir: str | Path, state: OrchestratorState) -> None:
    write_text_atomic(orchestrator_state_path(output_dir, state.step), seal_state(dataclasses.asdict(state)))


def load_state(output_dir: str | Path, step: int) -> OrchestratorState:
    """The state saved for `step`; CheckpointDamaged (one line naming the file) when it is missing or damaged."""
    return OrchestratorState(**open_state(orchestrator_state_path(output_dir, step)))
