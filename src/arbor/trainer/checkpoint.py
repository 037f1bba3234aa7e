"""Trainer checkpoints with torch.distributed.checkpoint (DCP): `<output_dir>/checkpoints/step_N/trainer/`.

N is the number of optimizer steps done. Every rank writes its shards; rank 0 writes `DONE` last, so a directory
with `DONE` is complete, and DCP reshards on load (a checkpoint saved by 2 ranks loads into 1). The orchestrator
keeps its own state beside ours (`checkpoints/step_N/orchestrator.json`), so pruning removes only the `trainer/`
subdirectory and the step directory only once it is empty.

This module imports torch inside its functions: the launcher and the orchestrator import `latest_checkpoint`
without paying for torch.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

DONE = "DONE"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where the trainer state after `step` optimizer steps lives."""
    return checkpoints_root(output_dir) / f"step_{step}" / "trainer"


def _trainer_steps(output_dir: str | Path) -> list[int]:
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
    return [s for s in _trainer_steps(output_dir) if (checkpoint_dir(output_dir, s) / DONE).exists()]


def latest_checkpoint(output_dir: str | Path) -> int | None:
    """The newest step with a complete trainer checkpoint, or None."""
    steps = completed_checkpoints(output_dir)
    return steps[-1] if steps else None


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Keeps the `keep` newest complete checkpoints; removes older trainer state (complete or not)."""
    done = completed_checkpoints(output_dir)
    if len(done) <= keep:
        return
    oldest_kept = done[-keep]
    for step in _trainer_steps(output_dir):
        if step < oldest_kept:
            shutil.rmtree(checkpoint_dir(output_dir, step), ignore_errors=True)
            step_dir = checkpoint_dir(output_dir, step).parent
            if step_dir.is_dir() and not any(step_dir.iterdir()):
                step_dir.rmdir()


def _state(model: "nn.Module", optimizer: "torch.optim.Optimizer", step: int) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = getattr(optimizer, "optimizers", optimizer)  # arbor.trainer.optim.Optimizers holds several
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(step, dtype=torch.int64)}}


def save_checkpoint(
    output_dir: str | Path, step: int, model: "nn.Module", optimizer: "torch.optim.Optimizer", keep: int
) -> Path:
    """Collective: every rank calls it. Writes model + optimizer state for `step`, then `DONE`, then prunes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = checkpoint_dir(output_dir, step)
    rank = dist.get_rank()
    if rank == 0 and path.exists():  # left over by a run killed mid-save: never mix old and new shards
        shutil.rmtree(path)
    dist.barrier()
    dcp.save(_state(model, optimizer, step), checkpoint_id=str(path))
    # dcp.save returns on the coordinator only after every rank's shards and the metadata are written.
    if rank == 0:
        (path / DONE).write_text(str(step))
        prune_checkpoints(output_dir, keep)
    return path


def load_checkpoint(
    output_dir: str | Path, step: int, model: "nn.Module", optimizer: "torch.optim.Optimizer"
) -> None:
    """Collective: loads the state saved for `step` into `model` and `optimizer` (resharding as needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = checkpoint_dir(output_dir, step)
    if not (path / DONE).exists():
        raise FileNotFoundError(f"trainer checkpoint {path} is incomplete (no {DONE} marker)")
    state = _state(model, optimizer, -1)
    dcp.load(state, checkpoint_id=str(path))
    saved = int(state["trainer"]["step"])
    if saved != step:
        raise ValueError(f"checkpoint {path} holds step {saved}, not {step}")
    optimizers = getattr(optimizer, "optimizers", optimizer)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
