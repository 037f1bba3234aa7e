"""The run directory: the one module that knows the layout of `<output_dir>`.

Trainer, orchestrator, inference and launcher find checkpoints, published weights, rollouts, metrics and
heartbeats through this module, never by importing each other. Light on purpose (no torch): the launcher and the
orchestrator import it before anything heavy.
"""

from __future__ import annotations

import re
from pathlib import Path

DONE = "DONE"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where the trainer state after `step` optimizer steps lives."""
    return checkpoints_root(output_dir) / f"step_{step}" / "trainer"


def trainer_steps(output_dir: str | Path) -> list[int]:
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and (p / "trainer").is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


def completed_checkpoints(output_dir: str | Path) -> list[int]:
    """Steps whose trainer checkpoint is complete (has `DONE`), oldest first."""
    return [s for s in trainer_steps(output_dir) if (checkpoint_dir(output_dir, s) / DONE).exists()]


def latest_checkpoint(output_dir: str | Path) -> int | None:
    """The newest step with a complete trainer checkpoint, or None."""
    steps = completed_checkpoints(output_dir)
    return steps[-1] if steps else None
