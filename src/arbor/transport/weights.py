"""Filesystem weight broadcast: `broadcasts/step_N/` holds a Hugging Face checkpoint directory and `STABLE`.

The trainer writes the directory under a temporary name, writes `STABLE` last, and renames it into place, so a
directory with `STABLE` is always complete. Only the newest `keep` steps are retained so disks do not fill.
Version N means "the weights after N optimizer steps"; version 0 is the initial model.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from arbor.models.args import ModelArgs
from arbor.models.hf import save_checkpoint_dir

STABLE = "STABLE"
_STEP = re.compile(r"^step_(\d+)$")


def broadcast_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "broadcasts" / f"step_{step}"


def publish_weights(
    output_dir: str | Path,
    step: int,
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    tokenizer=None,
    keep: int = 3,
) -> Path:
    final = broadcast_dir(output_dir, step)
    tmp = final.parent / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint_dir(state, args, tmp, tokenizer)
    (tmp / STABLE).write_text(str(step))
    if final.exists():  # a resumed run republishes the step it resumed from
        shutil.rmtree(final)
    tmp.rename(final)
    prune(output_dir, keep)
    return final


def published_steps(output_dir: str | Path) -> list[int]:
    root = Path(output_dir) / "broadcasts"
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and (p / STABLE).exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_published(output_dir: str | Path) -> int | None:
    steps = published_steps(output_dir)
    return steps[-1] if steps else None


def prune(output_dir: str | Path, keep: int) -> None:
    for step in published_steps(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(broadcast_dir(output_dir, step), ignore_errors=True)
