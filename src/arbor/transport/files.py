"""Filesystem transport of batches: one safetensors file per trainer rank and step, written atomically.

Where the files live (`arbor.run_dir.rollout_rank_file`) and how they are written (`arbor.run_dir.write_atomic`:
temporary name, fsync, rename) belong to the run directory; this module holds the format and the wait.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from pathlib import Path

from safetensors.numpy import save_file

from arbor.run_dir import poll_interval, rollout_rank_file, room_for, write_atomic
from arbor.transport.batch import StepBatch


def write_step(output_dir: str | Path, step: int, batches: list[StepBatch]) -> None:
    """Writes one file per trainer rank for `step`; ranks are written in order, each atomically."""
    for rank, batch in enumerate(batches):
        tensors, meta = batch.to_tensors()
        path = rollout_rank_file(output_dir, step, rank)
        # a full disk: one line naming the file and its size
        with room_for(path, sum(t.nbytes for t in tensors.values())):
            write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_step(path: str | Path) -> StepBatch:
    """The trainer's read: the step's batch as torch tensors."""
    import safetensors.torch  # noqa: PLC0415 - torch: the trainer's, never the orchestrator's (which only writes)

    # Read the bytes through one file handle: safetensors' safe_open re-opens the path for its mmap, so a
    # concurrent rename between the two opens would pair one version's header with another's data.
    with open(path, "rb") as f:
        data = f.read()
    header_len = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    return StepBatch.from_tensors(safetensors.torch.load(data), meta)


def wait_for_step(
    output_dir: str | Path,
    step: int,
    rank: int,
    timeout: float,
    interrupt: Callable[[], bool] | None = None,
    since: float | None = None,
) -> StepBatch | None:
    """Blocks until this rank's file for `step` exists, looking as often as `arbor.run_dir.poll_interval` says,
    and returns its batch; None as soon as `interrupt()` is true (the trainer's republish requests,
    arbor.trainer.republish). Raises TimeoutError naming the file `timeout` s after `since` (monotonic; default:
    now), so a wait resumed after an interruption keeps its deadline."""
    path = rollout_rank_file(output_dir, step, rank)
    start = time.monotonic() if since is None else since
    while not path.exists():
        if interrupt is not None and interrupt():
            return None
        waited = time.monotonic() - start
        if waited > timeout:
            raise TimeoutError(f"no rollouts for step {step} after {timeout:.0f}s: {path} never appeared")
        time.sleep(poll_interval(waited))
    return read_step(path)
