"""How `rl` (and `fleet`) watch their children: waits for readiness, the poll of deaths and liveness, the run's loop.

A child that exits 0 where it may finish is done; a server that dies is its group's to restart
(arbor.launch.servers); any other death stops the run as `ChildFailed` with its log's tail (or its one stop line:
a full disk, a damaged checkpoint), and no step within `stall_timeout` as `Stalled` with the processes' stacks.
Apart from `rl`'s sequence so that `run` reads as its steps; light to import, as `rl`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from arbor import run_dir
from arbor.colocate import ready_path
from arbor.config.rl import RLConfig
from arbor.launch.console import Console
from arbor.launch.process import ChildFailed, Supervisor, stopped_child, tail
from arbor.launch.servers import Servers, healthy
from arbor.launch.watchdog import Watchdog


class Stalled(RuntimeError):
    pass


def wait_offloaded(cfg: RLConfig, sup: Supervisor, on_wait: Callable[[], None] | None = None) -> None:
    """A colocated run: waits (bounded by `inference_startup_timeout`, watching the trainer) until the trainer has
    built, republished on a resume, and offloaded its state (arbor.colocate.ready_path)."""
    path = ready_path(cfg.output_dir)
    deadline = time.monotonic() + cfg.inference_startup_timeout
    while not path.exists():
        check_children(sup, finished=set())
        if time.monotonic() > deadline:
            raise ChildFailed(
                f"colocated run: the trainer did not build and offload its state within "
                f"{cfg.inference_startup_timeout:.0f}s ({path}); see {sup.children['trainer'].log_path}"
            )
        if on_wait is not None:
            on_wait()
        time.sleep(0.2)


def wait_ready(
    sup: Supervisor,
    servers: Sequence[Servers],
    timeout: float,
    on_wait: Callable[[], None] | None = None,
    watch: Sequence[Servers] | None = None,
) -> None:
    """Waits for each server of each group to answer /health, then counts it as ready (restarted if it dies);
    meanwhile a death among `watch` (default: `servers`) is handled as their group says."""
    for group in servers:
        for name, url in group.urls.items():
            wait_healthy(sup, url, timeout, name, servers if watch is None else watch, on_wait)
            group.ready.add(name)
            group.last_ok[name] = time.monotonic()
        group.watch()


def wait_healthy(
    sup: Supervisor,
    url: str,
    timeout: float,
    name: str = "inference",
    servers: Sequence[Servers] = (),
    on_wait: Callable[[], None] | None = None,
) -> None:
    """Polls `url`/health until it answers 200; calls `on_wait` between polls (the console's "waiting for")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_children(sup, finished=set(), servers=servers)
        if on_wait is not None:
            on_wait()
        if healthy(url):
            return
        time.sleep(0.3)
    raise ChildFailed(f"{name} did not become healthy within {timeout:.0f}s; see {sup.children[name].log_path}")


def check_children(
    sup: Supervisor,
    finished: set[str],
    may_finish: tuple[str, ...] = ("trainer", "orchestrator", "sft"),
    servers: Sequence[Servers] = (),
    console: Console | None = None,
) -> None:
    for name, child in list(sup.children.items()):
        if name in finished:
            continue
        rc = child.poll()
        if rc is None:
            continue
        if rc == 0 and name in may_finish:
            finished.add(name)
            continue
        group = next((g for g in servers if name in g.argv), None)
        if group is not None:
            group.on_death(name, rc, console.say if console is not None else None)
            continue
        stopped = stopped_child(name, rc, child.log_path)  # a full disk, a damaged checkpoint: its one line
        if stopped is not None:
            raise stopped
        raise ChildFailed(f"{name} exited with code {rc}; see {child.log_path}\n{tail(child.log_path)}")
    for group in servers:
        group.check_liveness(console.say if console is not None else None)


def record_timings(output_dir: Path, sup: Supervisor) -> None:
    """Appends each process's wall-clock seconds of this launch to `timings.jsonl` (arbor-report's cost figure)."""
    row = {name: round(c.ended - c.started, 3) for name, c in sup.children.items() if c.ended is not None}
    with open(run_dir.timings_path(output_dir), "a") as f:
        f.write(json.dumps({"time": time.time(), "seconds": row}) + "\n")


def show_waiting(sup: Supervisor, console: Console) -> None:
    """The console's "waiting for" line over every child but the warm-up."""
    console.waiting({n: c.started for n, c in sup.children.items() if n != "sft"})


def watch_run(
    cfg: RLConfig, sup: Supervisor, servers: Sequence[Servers], console: Console, waits: Callable[[], None]
) -> None:
    """Polls the children and prints each step until the trainer and the orchestrator have finished; raises
    `ChildFailed` on a death the servers' groups do not handle and `Stalled` when no step completes in time."""
    finished = {"sft"}
    watchdog = Watchdog(cfg.output_dir, cfg.stall_timeout)
    while not {"trainer", "orchestrator"} <= finished:
        check_children(sup, finished, servers=servers, console=console)
        console.poll()
        waits()
        if watchdog.stalled(console.seen):
            dumps = watchdog.dump_stacks()
            raise Stalled(
                f"no step completed in {cfg.stall_timeout:.0f}s (stall_timeout); "
                f"{watchdog.stacks_summary(dumps)}; last heartbeats:\n{watchdog.diagnosis()}"
            )
        time.sleep(0.2)
    console.poll()
