"""Inference servers the launcher keeps alive (the replicas, the distillation teacher), and when it restarts one.

A server that dies after it was ready is restarted on the same port (`restart_dead_replicas` of its config, on
by default), at most once per `RESTART_BACKOFF` seconds; its clients wait for it meanwhile (a router retries on
the other replicas; the orchestrator's client holds the requests and loads the run's weights on it before they
reach it, arbor.orchestrator.client). One that died `MAX_RESTARTS` times within `RESTART_WINDOW` seconds is not
restarted again (it would only die again), and one that dies before it was first healthy is never restarted (a
bad model, config or memory fails the same way each time). The run fails when none of a group is left alive.

A server that lives but stops answering (frozen, deadlocked, its vLLM engine dead behind a live proxy) would hold
its clients until the stall watchdog ends the run: once a group is ready a thread polls each server's `/health`
every `PROBE_INTERVAL` seconds, and one silent for `liveness_timeout` seconds (or, after a restart, not healthy
within `startup_timeout`) is killed with its process group, which the restart rule above then handles.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

from arbor.launch.process import ChildFailed, Supervisor, stopped_child, tail

RESTART_BACKOFF = 5.0
"""Seconds between two restarts of the same dead server."""
MAX_RESTARTS, RESTART_WINDOW = 3, 600.0
"""A server restarted this many times within this many seconds is given up on."""
PROBE_INTERVAL = 2.0
"""Seconds between two liveness probes of a server (and each probe's own timeout)."""


def healthy(url: str, timeout: float = PROBE_INTERVAL) -> bool:
    """Whether the server at `url` answers GET /health with 200 within `timeout` seconds (a refused or reset
    connection, a timeout or a 503 all count as not)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


Say = Callable[..., None]
"""The console's `say(text, err=...)`: where a restart is announced."""


class Servers:
    """Servers the launcher keeps alive, by name: their argv and URL, restarts of dead ones (module docstring),
    failure when none is left. `env` adds variables to each one's environment (its admin token); `plural` names
    them in the message when all are dead; `prog` (the launcher: "rl", "fleet") starts each message."""

    def __init__(
        self,
        sup: Supervisor,
        argv: dict[str, list[str]],
        urls: dict[str, str],
        env: dict[str, str],
        restart: bool,
        plural: str,
        liveness_timeout: float | None = None,
        startup_timeout: float = 600.0,
        prog: str = "rl",
    ) -> None:
        self.sup, self.argv, self.urls, self.env, self.plural, self.prog = sup, argv, urls, env, plural, prog
        self.restart = restart
        self.liveness_timeout, self.startup_timeout = liveness_timeout, startup_timeout
        self.last_ok: dict[str, float] = {}
        """When each server last answered /health with 200 (monotonic seconds; the probe thread writes it)."""
        self._stop = threading.Event()
        self._probe: threading.Thread | None = None
        self.last_start: dict[str, float] = {}
        self.restarts: dict[str, list[float]] = {name: [] for name in self.argv}
        """When each server was restarted (monotonic seconds)."""
        self.ready: set[str] = set()
        """Servers that answered /health since the launch: only those are restarted."""
        self.reported: set[str] = set()

    def start(self, name: str) -> None:
        self.sup.start(name, self.argv[name], self.env)
        self.last_start[name] = time.monotonic()

    def watch(self) -> None:
        """Starts the liveness probe (once the group is ready; a no-op without restarts or a liveness_timeout)."""
        if self._probe is None and self.restart and self.liveness_timeout is not None:
            self._probe = threading.Thread(target=self._probe_loop, name=f"probe-{self.plural}", daemon=True)
            self._probe.start()

    def close(self) -> None:
        self._stop.set()

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            for name, url in self.urls.items():
                if healthy(url):
                    self.last_ok[name] = time.monotonic()
            self._stop.wait(PROBE_INTERVAL)

    def check_liveness(self, console: Say | None) -> None:
        """Kills each live server silent for too long (module docstring), so that its death restarts it."""
        if self._probe is None:
            return
        now = time.monotonic()
        for name in self.ready:
            child = self.sup.children[name]
            if child.poll() is not None:
                continue
            started, ok = self.last_start.get(name, 0.0), self.last_ok.get(name, 0.0)
            if ok >= started:
                silent, limit, what = now - ok, self.liveness_timeout, "stopped answering /health for {}s"
            else:  # (re)started and not yet healthy since
                silent, limit = now - started, self.startup_timeout
                what = "has not answered /health for {}s since its restart"
            if limit is not None and silent > limit:
                message = (
                    f"{self.prog}: {name} {what.format(f'{silent:.0f}')} (limit {limit:.0f}s); killing it so "
                    "that it is restarted"
                )
                if console is not None:
                    console(message, err=True)
                else:
                    print(message, file=sys.stderr, flush=True)
                child.signal_group(signal.SIGKILL)

    def on_death(self, name: str, rc: int, console: Say | None) -> None:
        """Called while server `name` is dead: restarts it (backed off) unless it may not be; fails when then none
        of the group is alive."""
        child = self.sup.children[name]
        why_not = self.why_not_restart(name)
        if why_not is None:
            if time.monotonic() - self.last_start.get(name, 0.0) >= RESTART_BACKOFF:
                self.restarts[name].append(time.monotonic())
                if console is not None:
                    console(
                        f"{self.prog}: {name} exited with code {rc}; restarting it (see {child.log_path})", err=True
                    )
                self.start(name)
            return
        alive = [n for n in self.argv if self.sup.children[n].poll() is None]
        if not alive:
            stopped = stopped_child(name, rc, child.log_path)  # a model it cannot build: its one line is the error
            if stopped is not None:
                raise stopped
            what = (
                f"{name} exited with code {rc}"
                if len(self.argv) == 1
                else f"all {len(self.argv)} {self.plural} exited (last: {name}, code {rc})"
            )
            logs = ", ".join(str(self.sup.children[n].log_path) for n in self.argv)
            raise ChildFailed(f"{what}{why_not}; see {logs}\n{tail(child.log_path)}")
        if name not in self.reported and console is not None:
            console(
                f"{self.prog}: {name} exited with code {rc}{why_not}; continuing with {len(alive)} of "
                f"{len(self.argv)} (see {child.log_path})",
                err=True,
            )
        self.reported.add(name)

    def why_not_restart(self, name: str) -> str | None:
        """None when dead server `name` is to be restarted, else why not (a clause for the message)."""
        if not self.restart:
            return ""
        if name not in self.ready:
            return " before it was ready (not restarted: it would fail the same way)"
        recent = [t for t in self.restarts[name] if time.monotonic() - t < RESTART_WINDOW]
        if len(recent) >= MAX_RESTARTS:
            return f" after {len(recent)} restarts within {RESTART_WINDOW:.0f}s (not restarted again)"
        return None
