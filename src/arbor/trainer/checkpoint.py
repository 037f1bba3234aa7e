"""Trainer checkpoints with torch.distributed.checkpoint (DCP): `<output_dir>/checkpoints/step_N/trainer/`.

N is the number of optimizer steps done. Every rank writes its shards; rank 0 writes `DONE` last, so a directory
with `DONE` is complete, and DCP reshards on load (a checkpoint saved by 2 ranks loads into 1). The orchestrator
keeps its own state beside ours (`checkpoints/step_N/orchestrator.json`), so pruning removes only the `trainer/`
subdirectory and the step directory only once it is empty. The layout, the listing (`latest_checkpoint`) and the
pruning are arbor.run_dir's, which the launcher and the orchestrator read without torch. A LoRA model
(`model.lora`) saves its adapters and their optimizer state only: the frozen base is rebuilt from the config.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from arbor.models.lora import is_lora_param
from arbor.run_dir import DONE, checkpoint_dir, prune_checkpoints

# torch.distributed.checkpoint imports DTensor and sympy, seconds of start-up: the functions below load it at the
# first checkpoint, so that the trainer is waiting for its first rollouts (and heartbeating) long before.


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict  # at the first checkpoint, see above

    optimizers = getattr(optimizer, "optimizers", optimizer)  # arbor.trainer.optim.Optimizers holds several
    model_sd, optim_sd = get_state_dict(model, optimizers)
    if any(is_lora_param(k) for k in model_sd):  # LoRA: the frozen base is not state
        model_sd = {k: v for k, v in model_sd.items() if is_lora_param(k)}
    return {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(step, dtype=torch.int64)}}


def save_checkpoint(
    output_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, keep: int
) -> Path:
    """Collective: every rank calls it. Writes model + optimizer state for `step`, then `DONE`, then prunes."""
    import torch.distributed.checkpoint as dcp  # at the first checkpoint, see above

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


def load_checkpoint(output_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: loads the state saved for `step` into `model` and `optimizer` (resharding as needed)."""
    import torch.distributed.checkpoint as dcp  # at the first checkpoint, see above
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # see above

    path = checkpoint_dir(output_dir, step)
    if not (path / DONE).exists():
        raise FileNotFoundError(f"trainer checkpoint {path} is incomplete (no {DONE} marker)")
    state = _state(model, optimizer, -1)
    dcp.load(state, checkpoint_id=str(path))
    saved = int(state["trainer"]["step"])
    if saved != step:
        raise ValueError(f"checkpoint {path} holds step {saved}, not {step}")
    optimizers = getattr(optimizer, "optimizers", optimizer)
    lora = any(is_lora_param(k) for k in state["model"])  # adapters only: the base keeps its built weights
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=not lora),
    )
