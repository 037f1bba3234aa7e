"""Trainer checkpoints with torch.distributed.checkpoint (DCP): `<output_dir>/checkpoints/step_N/trainer/`.

N is the number of optimizer steps done. Every rank writes its shards; rank 0 then writes `manifest.json` (every
file's size and CRC-32, arbor.checkpoint_manifest) and `DONE` last, so a directory with `DONE` is complete and
checkable. A resume verifies it first, the files shared out among the ranks (a damaged step is never loaded; a
reader error on one that verifies is a one-line CheckpointDamaged), and DCP reshards on load (a checkpoint saved by
2 ranks loads into 1). The orchestrator keeps its own state beside ours (`checkpoints/step_N/orchestrator.json`), so
pruning removes only the `trainer/` subdirectory and the step directory only once it is empty. The layout, the
listing (`latest_checkpoint`) and the pruning are arbor.run_dir's, which the launcher and the orchestrator read
without torch. A LoRA model (`model.lora`) saves its adapters and their optimizer state only: the frozen base is
rebuilt from the config.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from arbor.checkpoint_manifest import MANIFEST, CheckpointDamaged, read_manifest, verify_files, write_manifest
from arbor.models.lora import is_lora_param
from arbor.run_dir import DONE, checkpoint_dir, disk_full, is_disk_full, prune_checkpoints, write_text_atomic

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
    state = _state(model, optimizer, step)
    try:
        dcp.save(state, checkpoint_id=str(path))
        # dcp.save returns on the coordinator only after every rank's shards and the metadata are written.
        if rank == 0:
            write_manifest(path)
            write_text_atomic(path / DONE, str(step))  # last: a step without it is never resumed from
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if is_disk_full(e):
            raise disk_full(path, _nbytes(state)) from None
        raise
    if rank == 0:
        prune_checkpoints(output_dir, keep)
    return path


def _nbytes(state: dict) -> int:
    """Bytes of the tensors in a (nested) state dict on this rank: what its shards need on disk."""
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state  # a DTensor's shard on this rank
        return local.numel() * local.element_size()
    return 0


def verify_checkpoint(output_dir: str | Path, step: int) -> None:
    """Collective: every rank checks its share of the checkpoint's files against the manifest (threads within a
    rank); raises CheckpointDamaged on every rank, naming the first damaged file, when any rank found one."""
    path = checkpoint_dir(output_dir, step)
    if not (path / MANIFEST).exists():  # written before manifests (arbor.checkpoint_manifest.verify_step)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        names = sorted(read_manifest(path)["files"])
        problem = verify_files(path, names[rank::world])
    except CheckpointDamaged as e:
        problem = str(e)
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise CheckpointDamaged(f"checkpoint step {step} is damaged: {found}")


def load_checkpoint(
    output_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, verify: bool = True
) -> None:
    """Collective: loads the state saved for `step` into `model` and `optimizer` (resharding as needed), after
    `verify_checkpoint` unless the caller has just done so (`verify` False)."""
    import torch.distributed.checkpoint as dcp  # at the first checkpoint, see above
    from torch.distributed.checkpoint.api import CheckpointException  # see above
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # see above

    path = checkpoint_dir(output_dir, step)
    if not (path / DONE).exists():
        raise FileNotFoundError(f"trainer checkpoint {path} is incomplete (no {DONE} marker)")
    if verify:
        verify_checkpoint(output_dir, step)
    state = _state(model, optimizer, -1)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # a shard DCP cannot read (its error is a BaseException)
        reason = " ".join(str(e).split())[:300]
        raise CheckpointDamaged(f"checkpoint step {step} ({path}) could not be read: {reason}") from None

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
