"""Trainer checkpoints with torch.distributed.checkpoint (DCP): `<output_dir>/checkpoints/step_N/trainer/`.

N is the number of optimizer steps done. Every rank writes its shards; rank 0 writes `DONE` last, so a directory
with `DONE` is complete, and DCP reshards on load (a checkpoint saved by 2 ranks loads into 1). The orchestrator
keeps its own state beside ours (`checkpoints/step_N/orchestrator.json`), so pruning removes only the `trainer/`
subdirectory and the step directory only once it is empty.

This module imports torch inside its functions: the launcher and the orchestrator import `latest_checkpoint`
without paying for torch.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from arbor.run_dir import DONE, checkpoint_dir, completed_checkpoints, latest_checkpoint, trainer_steps  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    import torch
    from torch import nn

def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Keeps the `keep` newest complete checkpoints; removes older trainer state (complete or not)."""
    done = completed_checkpoints(output_dir)
    if len(done) <= keep:
        return
    oldest_kept = done[-keep]
    for step in trainer_steps(output_dir):
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
