"""`metrics.jsonl`: one JSON object per step, the orchestrator's figures merged with the trainer's.

The trainer appends its per-step figures to `metrics/trainer.jsonl` and the orchestrator its own to
`metrics/orchestrator.jsonl`, each as soon as a step is done; the orchestrator owns `metrics.jsonl` and writes
step N's line once both halves are on disk, in step order, so a reader (the `rl` console, a plot) sees whole
steps only, and a kill at any moment loses no half that a resume would not redo. Lines are appended and flushed one at a
time; a resumed run first truncates both files to the
steps before the checkpoint it resumes from, so no step is missing or repeated.

Both halves carry `time` (unix seconds) and `elapsed_s` (`RunClock`: wall-clock seconds since the run's processes
started; on a resume it goes on from the last metrics.jsonl row kept before the checkpoint, so the downtime between
attempts and the work redone after the checkpoint are not counted): the orchestrator's when it wrote the step's
batch, the trainer's when it finished training the step. A merged row takes the trainer's, the time its step
became whole.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from arbor.run_dir import metrics_path, orchestrator_metrics_path, room_for, trainer_metrics_path, write_text_atomic

log = logging.getLogger("arbor.monitor")


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Appends one line; a full disk is a DiskFullError naming `path` (a torn last line is skipped by
    `read_jsonl` and dropped by a resume's `truncate_jsonl`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({k: _clean(v) for k, v in row.items()}) + "\n"
    with room_for(path, len(line)), open(path, "a") as f:
        f.write(line)
        f.flush()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now; it is complete on the next read
            break
    return out


def truncate_jsonl(path: str | Path, below_step: int) -> None:
    """Keeps only the lines with `step < below_step` (atomically)."""
    p = Path(path)
    if not p.exists():
        return
    keep = [r for r in read_jsonl(p) if r.get("step", -1) < below_step]
    write_text_atomic(p, "".join(json.dumps(r) + "\n" for r in keep))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class RunClock:
    """Wall-clock seconds of a run: since this process started, plus what the rows before `start` (the step a
    resume starts at) had counted (the `elapsed_s` of the last metrics.jsonl row before it; 0 for a fresh run)."""

    def __init__(self, output_dir: str | Path, start: int = 0) -> None:
        before = [r for r in read_jsonl(metrics_path(output_dir)) if r.get("step", -1) < start]
        last = before[-1].get("elapsed_s") if before else None
        self.offset = float(last) if isinstance(last, (int, float)) else 0.0
        self._t0 = time.monotonic()

    def elapsed(self) -> float:
        return self.offset + time.monotonic() - self._t0

    def stamp(self) -> dict[str, float]:
        """`time` (unix seconds, now) and `elapsed_s` for a metrics row."""
        return {"time": round(time.time(), 3), "elapsed_s": round(self.elapsed(), 3)}


class MetricsWriter:
    """Merges orchestrator and trainer figures per step into metrics.jsonl and forwards them to W&B."""

    def __init__(self, output_dir: str | Path, wandb_run=None) -> None:
        self.path = metrics_path(output_dir)
        self.trainer_path = trainer_metrics_path(output_dir)
        self.orchestrator_path = orchestrator_metrics_path(output_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trainer: dict[int, dict[str, Any]] = {}
        self.wandb_run = wandb_run
        self.written = {r["step"] for r in read_jsonl(self.path)}
        # Halves written before a restart whose merged line is still missing.
        self.pending: dict[int, dict[str, Any]] = {
            r["step"]: {k: v for k, v in r.items() if k != "step"}
            for r in read_jsonl(self.orchestrator_path)
            if r["step"] not in self.written
        }

    def add(self, step: int, figures: dict[str, Any]) -> None:
        append_jsonl(self.orchestrator_path, {"step": step, **figures})
        self.pending.setdefault(step, {}).update(figures)

    def poll(self) -> list[int]:
        """Writes every pending step whose trainer half has arrived, lowest first; returns the steps written."""
        for r in read_jsonl(self.trainer_path):
            self.trainer[r["step"]] = r
        done = []
        for step in sorted(self.pending):
            if step not in self.trainer:
                break
            row = {
                "step": step,
                **self.pending.pop(step),
                **{k: v for k, v in self.trainer[step].items() if k != "step"},
            }
            append_jsonl(self.path, row)
            self.written.add(step)
            if self.wandb_run is not None:
                self.wandb_run.log(
                    {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}, step=step
                )
            done.append(step)
        return done

    def forget_from(self, step: int) -> None:
        """Drops the pending halves of steps >= `step`, which no trainer will train (the run stopped before)."""
        for s in [s for s in self.pending if s >= step]:
            del self.pending[s]

    def close(self) -> None:
        """Writes every step whose two halves are on disk, then ends the W&B run: a run that stops on an error (a
        refused weight update, a dead server) still records each step its trainer finished before it stopped."""
        try:
            self.poll()
        except OSError as e:  # a full disk: the stop's own error says so; this must not replace it
            log.warning("metrics.jsonl not brought up to date at the stop: %s", e)
        if self.wandb_run is not None:
            self.wandb_run.finish()


def init_wandb(cfg, output_dir: str | Path, run_config: dict[str, Any]):
    """Starts a W&B run (offline when no API key is configured), or returns None when `cfg` is None."""
    if cfg is None:
        return None
    try:  # optional: the `wandb` extra, needed only when a [wandb] table is given
        import wandb  # optional extra, see above
    except ImportError:
        raise RuntimeError(
            "[wandb] logging needs the wandb package: install arbor with the `wandb` extra "
            "(`uv sync --extra wandb` or `pip install 'arbor[wandb]'`)"
        ) from None

    offline = cfg.offline if cfg.offline is not None else not (os.environ.get("WANDB_API_KEY") or _netrc_has_wandb())
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name or Path(output_dir).resolve().name,
        tags=cfg.tags,
        dir=str(output_dir),
        config=run_config,
        mode="offline" if offline else "online",
    )


def _netrc_has_wandb() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
