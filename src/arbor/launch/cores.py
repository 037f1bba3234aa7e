"""The launcher's core split: torch threads for the trainer and the inference engine, from measured rates.

A process's torch thread pool is sized once, when it starts (the trainer and the server call
`torch.set_num_threads` before building their models, and changing it later under a running OpenMP pool is
neither cheap nor reliable), so the split is decided here, at launch, and never changes during the run.

With asynchronous overlap a step costs about max(train work / trainer threads, generation work / inference
threads), so the split that minimises it gives each side threads in proportion to its work (`split`). The work
comes from measured figures:
- a resumed run reads its own: the median trainer `time/compute` and orchestrator `time/generate` of its last
  rows in metrics.jsonl, times the threads each side ran with then (its previous `configs/*.toml`): thread-seconds
  per step, assuming time scales inversely with threads;
- a fresh run has none yet and uses the ratio benchmarks/step_time.py measured on the reverse_text example at one
  thread per side (training 4.26 s, generation 2.04 s a step: the trainer does about twice the generator's work,
  as issue 20 found). A calibration run at launch would measure the same thing for the run's own model, at the
  price of seconds of start-up on every run; this default costs nothing and a resume corrects it.

It applies only to a single-process local run (a backend whose threads follow `inference.num_threads`, its
`core_split`: arbor's own engine; one replica, one trainer rank): vLLM and multi-rank trainers size their own
pools. A side whose `num_threads` is set by hand keeps it; the other gets the remaining cores.
This module never imports torch.
"""

from __future__ import annotations

import os
import statistics
import tomllib
from pathlib import Path

from arbor import run_dir
from arbor.config.rl import RLConfig
from arbor.monitor.metrics import read_jsonl

DEFAULT_WORK = (4.26, 2.04)
"""Thread-seconds per step of training and of generation when the run has no figures of its own (module
docstring)."""

RECENT = 10
"""Rows of a resumed run's metrics the measured work is the median of (its first steps are warm-up)."""


def split(cores: int, train_work: float, generate_work: float) -> tuple[int, int]:
    """(trainer threads, inference threads), at least one each, summing to `cores` (2 when fewer), minimising
    max(train_work / t, generate_work / g)."""
    if cores < 2:
        return 1, 1
    return min(
        ((t, cores - t) for t in range(1, cores)),
        key=lambda tg: (max(train_work / tg[0], generate_work / tg[1]), -tg[0]),
    )


def measured_work(output_dir: Path) -> tuple[float, float] | None:
    """Thread-seconds per step of training and of generation from a previous attempt's rows and configs, or None
    when it left no complete figures."""
    rows = [r for r in read_jsonl(run_dir.metrics_path(output_dir)) if "time/compute" in r and "time/generate" in r]
    threads = [_threads(run_dir.configs_dir(output_dir) / f"{name}.toml") for name in ("trainer", "inference")]
    if not rows or None in threads:
        return None
    rows = rows[-RECENT:]
    return (
        statistics.median(r["time/compute"] for r in rows) * threads[0],
        statistics.median(r["time/generate"] for r in rows) * threads[1],
    )


def _threads(path: Path) -> int | None:
    if not path.exists():
        return None
    value = tomllib.loads(path.read_text()).get("num_threads")
    return value if isinstance(value, int) else None


def split_cores(cfg: RLConfig, cores: int | None = None) -> str | None:
    """Sets `trainer.num_threads` and `inference.num_threads` where the user did not; returns a line saying what
    was chosen and why, or None when the split does not apply."""
    trainer, inference = cfg.trainer, cfg.inference
    if not inference.engine_backend().core_split or inference.replicas > 1 or trainer.parallel.nproc > 1:
        return None
    if trainer.num_threads is not None and inference.num_threads is not None:
        return None
    cores = cores or len(os.sched_getaffinity(0))
    if trainer.num_threads is not None:
        inference.num_threads = max(1, cores - trainer.num_threads)
        return f"cores: inference {inference.num_threads} threads (trainer.num_threads {trainer.num_threads} set)"
    if inference.num_threads is not None:
        trainer.num_threads = max(1, cores - inference.num_threads)
        return f"cores: trainer {trainer.num_threads} threads (inference.num_threads {inference.num_threads} set)"
    work = measured_work(cfg.output_dir) if cfg.resume else None
    source = "this run's measured figures" if work is not None else "the default work ratio"
    train_work, generate_work = work or DEFAULT_WORK
    trainer.num_threads, inference.num_threads = split(cores, train_work, generate_work)
    return (
        f"cores: trainer {trainer.num_threads}, inference {inference.num_threads} threads of {cores} "
        f"(from {source}: {train_work:.2f} vs {generate_work:.2f} thread-seconds a step)"
    )
