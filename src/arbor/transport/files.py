"""Filesystem transport: `rollouts/step_N/rank_R.safetensors`, written to a temporary name and renamed.

A rename within one directory is atomic on POSIX filesystems (and on NFS/Lustre for a single client), so a
reader that sees the final name always sees a whole file. The temporary name starts with a dot and ends in
`.tmp` so that no glob for `rank_*.safetensors` ever matches it.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import safetensors.torch
from safetensors.torch import save_file

from arbor.transport.batch import StepBatch


def step_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "rollouts" / f"step_{step}"


def rank_file(output_dir: str | Path, step: int, rank: int) -> Path:
    return step_dir(output_dir, step) / f"rank_{rank}.safetensors"


def write_atomic(path: Path, write) -> None:
    """Calls `write(tmp_path)` then renames the temporary file onto `path` after an fsync."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_step(output_dir: str | Path, step: int, batches: list[StepBatch]) -> None:
    """Writes one file per trainer rank for `step`; ranks are written in order, each atomically."""
    for rank, batch in enumerate(batches):
        tensors, meta = batch.to_tensors()
        write_atomic(rank_file(output_dir, step, rank), lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_step(path: str | Path) -> StepBatch:
    # Read the bytes through one file handle: safetensors' safe_open re-opens the path for its mmap, so a
    # concurrent rename between the two opens would pair one version's header with another's data.
    with open(path, "rb") as f:
        data = f.read()
    header_len = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    return StepBatch.from_tensors(safetensors.torch.load(data), meta)


def wait_for_step(
    output_dir: str | Path, step: int, rank: int, timeout: float, poll: float = 0.05, alive=lambda: True
) -> StepBatch:
    """Blocks until this rank's file for `step` exists; raises TimeoutError naming the file after `timeout` s."""
    path = rank_file(output_dir, step, rank)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no rollouts for step {step} after {timeout:.0f}s: {path} never appeared")
        if not alive():
            raise RuntimeError(f"stopped while waiting for {path}")
        time.sleep(poll)
    return read_step(path)
