"""The run directory: the one module that knows the layout of `<output_dir>`.

    checkpoints/step_N/trainer/        trainer state after N optimizer steps (`manifest.json`, then `DONE` last)
    checkpoints/step_N.damaged/        a step a resume found damaged, kept aside (`set_aside`)
    checkpoints/step_N/orchestrator.json   the orchestrator's resumable state for step N
    broadcasts/step_N/                 published policy weights (`STABLE` written last)
    broadcasts/republish.json          the orchestrator's request to publish a refused version again
    rollouts/step_N/rank_R.safetensors the batch of step N for trainer rank R
    metrics.jsonl, metrics/<process>.jsonl, eval.jsonl, timings.jsonl
    heartbeats/<process>, logs/ (process logs), logs/stacks/<process>.txt
    configs/<process>.toml, gateway_url, sft/ (the warm-up model)
    colocate/train_N, colocate/generated_N, colocate/ready   a colocated run's turns (arbor.colocate)

Trainer, orchestrator, inference and launcher find every file through this module, never by importing each
other or spelling a path themselves. It also holds the atomic writes (temporary name, fsync, rename: a reader
never sees half a file), the step listings (complete checkpoints, published weights, rollout steps) and their
retention (`prune_checkpoints`, `prune_orchestrator_states`, `prune_published`, `prune_rollouts`), how often a
process looks for a file another one writes (`poll_interval`), and what a full disk is (`DiskFullError`: one line
naming the path and the size needed). Light on
purpose (standard library only): the launcher and the orchestrator import it before anything heavy.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DONE = "DONE"
"""Written last into a trainer checkpoint directory: the checkpoint is complete."""
STABLE = "STABLE"
"""Written last into a published weights directory (before its rename into place): the weights are complete."""
ORCHESTRATOR_STATE = "orchestrator.json"
POLL_MIN, POLL_MAX, POLL_SHARE = 0.002, 0.05, 0.1
"""Bounds (seconds) and share of the wait so far of `poll_interval`."""
_STEP = re.compile(r"^step_(\d+)$")
DAMAGED = ".damaged"
"""Suffix of a checkpoint step directory that failed verification, kept aside (`set_aside`), never deleted."""

PathLike = str | Path


# ---- a full disk ----


class DiskFullError(OSError):
    """A write failed for lack of space (ENOSPC); the message is one line naming the path and the size needed.
    Every process stops on it with that line (exit status `DISK_FULL_EXIT`); `--resume` continues once there
    is room again."""

    def __str__(self) -> str:
        return str(self.strerror)


DISK_FULL_EXIT = 28
"""Exit status of a process stopped by a full disk (ENOSPC's number)."""
STOP_PREFIX = "arbor stop: "
"""Starts the one line a process prints when it stops on a full disk or a damaged checkpoint; `rl` shows that
line instead of the log's tail."""


def stop_line(error: BaseException) -> str:
    """The one line a process prints when it stops on `error` (a full disk, a damaged checkpoint)."""
    return STOP_PREFIX + " ".join(str(error).split())


def format_bytes(n: float) -> str:
    """`n` bytes in the unit that fits: B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from (or wraps, as DCP's CheckpointException does), is ENOSPC."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        wrapped = getattr(error, "failures", None)  # torch.distributed.checkpoint's per rank: (exception, traceback)
        if isinstance(wrapped, dict) and any(
            is_disk_full(w[0] if isinstance(w, tuple) else w) for w in wrapped.values()
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def disk_full(path: PathLike, needed: int) -> DiskFullError:
    """The one-line error for a write of `needed` bytes to `path` that found no room."""
    try:
        free = f"{format_bytes(shutil.disk_usage(Path(path).parent).free)} free"
    except OSError:
        free = "free space unknown"
    return DiskFullError(
        errno.ENOSPC,
        f"disk full: writing {path} needed {format_bytes(needed)} ({free}); free space, then continue with --resume",
    )


@contextmanager
def room_for(path: PathLike, needed: int) -> Iterator[None]:
    """Turns an ENOSPC raised inside into `disk_full(path, needed)`."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if is_disk_full(e):
            raise disk_full(path, needed) from None
        raise


# ---- atomic writes ----


def write_atomic(path: Path, write: Callable[[Path], object], fsync: bool = True) -> None:
    """Calls `write(tmp_path)` then renames the temporary file onto `path` (after an fsync unless `fsync` is off:
    for files a crash may lose, such as heartbeats, written several times a second).

    A rename within one directory is atomic on POSIX filesystems (and on NFS/Lustre for a single client), so a
    reader that sees `path` sees a whole file. The temporary name starts with a dot and ends in `.tmp`, so no
    glob for the final names ever matches it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if is_disk_full(e):
            raise disk_full(path, tmp.stat().st_size if tmp.exists() else 0) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str, fsync: bool = True) -> None:
    with room_for(path, len(text.encode())):
        write_atomic(path, lambda tmp: tmp.write_text(text), fsync)


# ---- paths ----


def poll_interval(waited: float) -> float:
    """Seconds to sleep before the next look for a file (a step's rollouts, a newer policy), `waited` seconds into
    the wait: a tenth of the wait so far, between 2 ms and 50 ms. Each handoff between the trainer and the
    orchestrator is a wait for a file, and a synchronous step has two of them on its critical path: a fixed 50 ms
    poll added 25 ms to each on average (a fifth of a CPU quick-start step), while a short one on every look would
    cost a shared filesystem hundreds of looks a second per rank during a long wait. Seeing the file late now
    adds at most about a tenth to a wait (2 ms to a short one), and a long wait still looks 20 times a second."""
    return min(POLL_MAX, max(POLL_MIN, POLL_SHARE * waited))


def step_name(step: int) -> str:
    return f"step_{step}"


def checkpoints_root(output_dir: PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_step_dir(output_dir: PathLike, step: int) -> Path:
    """`checkpoints/step_N/`: the trainer's and the orchestrator's state for resuming at step N."""
    return checkpoints_root(output_dir) / step_name(step)


def checkpoint_dir(output_dir: PathLike, step: int) -> Path:
    """Where the trainer state after `step` optimizer steps lives."""
    return checkpoint_step_dir(output_dir, step) / "trainer"


def orchestrator_state_path(output_dir: PathLike, step: int) -> Path:
    return checkpoint_step_dir(output_dir, step) / ORCHESTRATOR_STATE


def broadcasts_root(output_dir: PathLike) -> Path:
    return Path(output_dir) / "broadcasts"


def broadcast_dir(output_dir: PathLike, step: int) -> Path:
    """The policy weights published after `step` optimizer steps (complete once it holds `STABLE`)."""
    return broadcasts_root(output_dir) / step_name(step)


def republish_request_path(output_dir: PathLike) -> Path:
    """The orchestrator's request that the trainer publish again a version the fleet refused
    (arbor.transport.republish); under `broadcasts/`, so a resume clears it with the versions it concerns."""
    return broadcasts_root(output_dir) / "republish.json"


def withdraw_published(output_dir: PathLike, step: int) -> None:
    """Removes published version `step` (one the fleet refused): renamed out of the listings first, so no
    reader sees it half-removed, then deleted (a later version's hard links to its shards keep their bytes)."""
    final = broadcast_dir(output_dir, step)
    gone = final.with_name(f".{final.name}.withdrawn.{os.getpid()}")
    try:
        final.rename(gone)
    except FileNotFoundError:  # pruned meanwhile
        return
    shutil.rmtree(gone, ignore_errors=True)


def broadcast_staging_dir(output_dir: PathLike, step: int) -> Path:
    """Where a publish writes before renaming into `broadcast_dir` (hidden from `published_steps`)."""
    return broadcasts_root(output_dir) / f".{step_name(step)}.tmp"


def rollouts_root(output_dir: PathLike) -> Path:
    return Path(output_dir) / "rollouts"


def rollout_step_dir(output_dir: PathLike, step: int) -> Path:
    return rollouts_root(output_dir) / step_name(step)


def rollout_rank_file(output_dir: PathLike, step: int, rank: int) -> Path:
    """The batch of `step` for trainer rank `rank`."""
    return rollout_step_dir(output_dir, step) / f"rank_{rank}.safetensors"


def metrics_path(output_dir: PathLike) -> Path:
    """Whole steps, the orchestrator's figures merged with the trainer's (see arbor.monitor.metrics)."""
    return Path(output_dir) / "metrics.jsonl"


def process_metrics_path(output_dir: PathLike, process: str) -> Path:
    """One process's own per-step figures: `metrics/<process>.jsonl` (trainer, orchestrator, sft)."""
    return Path(output_dir) / "metrics" / f"{process}.jsonl"


def trainer_metrics_path(output_dir: PathLike) -> Path:
    return process_metrics_path(output_dir, "trainer")


def orchestrator_metrics_path(output_dir: PathLike) -> Path:
    return process_metrics_path(output_dir, "orchestrator")


def all_metrics_paths(output_dir: PathLike) -> list[Path]:
    """The per-step files a resume truncates to the steps before its checkpoint."""
    return [metrics_path(output_dir), trainer_metrics_path(output_dir), orchestrator_metrics_path(output_dir)]


def eval_path(output_dir: PathLike) -> Path:
    return Path(output_dir) / "eval.jsonl"


def timings_path(output_dir: PathLike) -> Path:
    """Each launch's per-process wall-clock seconds (`rl` appends, arbor-report reads)."""
    return Path(output_dir) / "timings.jsonl"


def fleet_usage_path(output_dir: PathLike) -> Path:
    """A run's use of a shared fleet (`rl --fleet`, one row per launch), or a fleet's periodic figures (`fleet`):
    arbor-report's cost share."""
    return Path(output_dir) / "fleet_usage.jsonl"


def fleet_url_path(output_dir: PathLike) -> Path:
    """The URL a running fleet (`fleet`) answers on, written once its router is up."""
    return Path(output_dir) / "url"


def heartbeats_dir(output_dir: PathLike) -> Path:
    return Path(output_dir) / "heartbeats"


def logs_dir(output_dir: PathLike) -> Path:
    return Path(output_dir) / "logs"


def stacks_dir(output_dir: PathLike) -> Path:
    return logs_dir(output_dir) / "stacks"


def configs_dir(output_dir: PathLike) -> Path:
    return Path(output_dir) / "configs"


def sft_model_dir(output_dir: PathLike) -> Path:
    """The warm-up (SFT) model that RL starts from when `[sft] steps` is set."""
    return Path(output_dir) / "sft"


def gateway_url_path(output_dir: PathLike) -> Path:
    """The agents' gateway writes its base URL here once bound (its port may be chosen at start)."""
    return Path(output_dir) / "gateway_url"


def colocate_dir(output_dir: PathLike) -> Path:
    """The turn files of a colocated run (`inference.colocate`: trainer and engine take turns on one device):
    `train_N` (the orchestrator put the engine to sleep, the trainer may train step N), `generated_N` (step N
    trained, published and the trainer offloaded: the engine may wake), `ready` (the trainer built and offloaded
    its state, so the engine may start)."""
    return Path(output_dir) / "colocate"


def stopped_path(output_dir: PathLike) -> Path:
    """Written by the trainer when `max_minutes` ended the run: `{"step": S, "reason": ...}`, S being the
    checkpoint it wrote last (the orchestrator stops producing batches when it sees it)."""
    return Path(output_dir) / "stopped.json"


# ---- step listings ----


def _steps(root: Path, complete: Callable[[Path], bool]) -> list[int]:
    """The N of every `root/step_N` that `complete` accepts, ascending."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and complete(p):
            steps.append(int(m.group(1)))
    return sorted(steps)


def trainer_steps(output_dir: PathLike) -> list[int]:
    """Steps with a trainer checkpoint directory, complete or not."""
    return _steps(checkpoints_root(output_dir), lambda p: (p / "trainer").is_dir())


def completed_checkpoints(output_dir: PathLike) -> list[int]:
    """Steps whose trainer checkpoint is complete (has `DONE`), oldest first."""
    return _steps(checkpoints_root(output_dir), lambda p: (p / "trainer" / DONE).exists())


def set_aside(output_dir: PathLike, step: int) -> Path:
    """Renames `checkpoints/step_N/` to `step_N.damaged/` (`.damaged.2/`, ... if taken); returns the new path."""
    src = checkpoint_step_dir(output_dir, step)
    dst, k = src.with_name(src.name + DAMAGED), 1
    while dst.exists():
        k += 1
        dst = src.with_name(f"{src.name}{DAMAGED}.{k}")
    src.rename(dst)
    return dst


def damaged_checkpoints(output_dir: PathLike) -> int:
    """How many checkpoint steps of this run were set aside as damaged (`set_aside`)."""
    root = checkpoints_root(output_dir)
    return sum(1 for p in root.iterdir() if DAMAGED in p.name) if root.is_dir() else 0


def latest_checkpoint(output_dir: PathLike) -> int | None:
    """The newest step with a complete trainer checkpoint, or None."""
    steps = completed_checkpoints(output_dir)
    return steps[-1] if steps else None


def published_steps(output_dir: PathLike) -> list[int]:
    """Steps whose published weights are complete (have `STABLE`), oldest first."""
    return _steps(broadcasts_root(output_dir), lambda p: (p / STABLE).exists())


def latest_published(output_dir: PathLike) -> int | None:
    steps = published_steps(output_dir)
    return steps[-1] if steps else None


def rollout_steps(output_dir: PathLike) -> list[int]:
    """Steps with a rollouts directory (whole or being written)."""
    return _steps(rollouts_root(output_dir), Path.is_dir)


# ---- retention ----


def _remove_step_dir_if_empty(output_dir: PathLike, step: int) -> None:
    d = checkpoint_step_dir(output_dir, step)
    if d.is_dir() and not any(d.iterdir()):
        d.rmdir()


def prune_checkpoints(output_dir: PathLike, keep: int) -> None:
    """Keeps the `keep` newest complete trainer checkpoints; removes older trainer state (complete or not).

    The orchestrator's state beside it is pruned on its own schedule (`prune_orchestrator_states`), so a step
    directory goes only once both are gone."""
    done = completed_checkpoints(output_dir)
    if len(done) <= keep:
        return
    oldest_kept = done[-keep]
    for step in trainer_steps(output_dir):
        if step < oldest_kept:
            shutil.rmtree(checkpoint_dir(output_dir, step), ignore_errors=True)
            _remove_step_dir_if_empty(output_dir, step)


def prune_orchestrator_states(output_dir: PathLike, below_step: int) -> None:
    """Removes orchestrator states older than the oldest step a resume could still start from."""
    for step in _steps(checkpoints_root(output_dir), lambda p: (p / ORCHESTRATOR_STATE).exists()):
        if step < below_step:
            orchestrator_state_path(output_dir, step).unlink()
            _remove_step_dir_if_empty(output_dir, step)


def prune_published(output_dir: PathLike, keep: int) -> None:
    """Keeps the `keep` newest published weight directories (`keep` <= 0: all of them)."""
    for step in published_steps(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(broadcast_dir(output_dir, step), ignore_errors=True)


def prune_rollouts(output_dir: PathLike, keep: int, trained: int) -> None:
    """Keeps the rollouts of the `keep` newest trained steps and of every later one: removes `rollouts/step_N/`
    for N <= trained - keep, once step `trained` is trained on every rank.

    Only the trainer calls this, after step `trained`'s collective publish, so every rank has read each removed
    file; and a resume never needs one: it starts at a checkpoint S <= trained + 1 and has every step from S on
    written again (`clear_after`)."""
    for step in rollout_steps(output_dir):
        if step <= trained - keep:
            shutil.rmtree(rollout_step_dir(output_dir, step), ignore_errors=True)


def clear_after(output_dir: PathLike, start: int) -> None:
    """Removes what an earlier attempt left past `start`, where a run (re)starts: rollouts of steps >= `start`,
    every published version (a resume never trusts `broadcasts/`: the trainer republishes `start` from its
    verified checkpoint), a colocated run's turn files, heartbeats, whose pids may now belong to someone else and
    must never be signalled, and an earlier `stopped.json`."""
    for step in rollout_steps(output_dir):
        if step >= start:
            shutil.rmtree(rollout_step_dir(output_dir, step))
    shutil.rmtree(broadcasts_root(output_dir), ignore_errors=True)
    shutil.rmtree(heartbeats_dir(output_dir), ignore_errors=True)
    shutil.rmtree(colocate_dir(output_dir), ignore_errors=True)  # an earlier attempt's turns are not this one's
    stopped_path(output_dir).unlink(missing_ok=True)  # the stop of an earlier attempt is not this one's
