"""Child-process supervision for `rl`: per-process logs, one process group each, nothing left behind.

Each child runs in its own session (so torchrun's workers and any helpers are killed with it) and asks the
kernel to SIGTERM it if the launcher dies (arbor.orphans), so even a `kill -9` of `rl` leaves no orphan. The
launchers (`rl`, `fleet`) share SIGTERM-as-an-exception (`Terminated`) and `free_port` from here.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

from arbor.orphans import die_with_parent
from arbor.run_dir import DISK_FULL_EXIT, STOP_PREFIX


class Terminated(BaseException):
    """SIGTERM arrived (a scheduler's or `kill`'s stop): `rl` stops every process and exits 143 (128 + 15).
    A BaseException, like the KeyboardInterrupt of SIGINT, so that no `except Exception` on the way swallows it."""


def on_sigterm(signum: int, frame: object) -> None:
    # Further SIGTERMs (a scheduler may repeat them) must not cut the shutdown that this one starts.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


LOWEST_PORT = 10000
"""The lowest port `free_port` draws (below it lie the well-known services' defaults)."""


def free_port() -> int:
    """A TCP port free now, drawn outside the kernel's ephemeral range: a port from that range (what binding port
    0 returns) may be handed to any outgoing connection as its source port in the seconds before the server started
    next binds it (one `rl` run's inference server failed so: "address already in use"); ports below the range are
    only ever taken by an explicit bind, which this one checks. The kernel's pick where the range leaves no room."""
    low, _ = ephemeral_range()
    draw = random.SystemRandom()
    for _ in range(64 if low - LOWEST_PORT > 1000 else 0):
        port = draw.randrange(LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # taken on any address: not free
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


class ChildFailed(RuntimeError):
    """A child process died where the run cannot go on without it (the launcher's error line); `exit_code` is
    what `rl` exits with (1, or `DISK_FULL_EXIT` when a full disk stopped it)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.started, self.ended = time.time(), None
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.time()
        return rc

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self._log.close()


class Supervisor:
    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir, self.env = log_dir, env
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Starts `name`; `env` adds variables for this child only (a secret only it may read)."""
        if name in self.children:  # a restart: the old process is gone, its log stays open until now
            self.children[name].proc.wait()
            self.children[name].close()
        child = Child(name, argv, self.log_dir / f"{name}.log", {**self.env, **(env or {})})
        self.children[name] = child
        return child

    def stop(self, names: list[str] | None = None, grace: float = 10.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace` seconds."""
        targets = [c for n, c in self.children.items() if names is None or n in names]
        for c in targets:
            if c.poll() is None:
                c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in targets:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            c.signal_group(signal.SIGKILL)  # also reaps grandchildren that outlived their parent
            c.proc.wait()
            c.poll()
            c.close()


def stop_reason(path: Path) -> str | None:
    """The one line (`arbor.run_dir.stop_line`) a process printed when a full disk or a damaged checkpoint
    stopped it, without its prefix; None when it printed none."""
    if not path.exists():
        return None
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith(STOP_PREFIX)]
    return lines[-1][len(STOP_PREFIX) :] if lines else None


def stopped_child(name: str, rc: int, log_path: Path) -> ChildFailed | None:
    """The launcher's error for child `name`, dead with code `rc`, when it stopped on one line (a full disk, a
    damaged checkpoint, a model it cannot build: `arbor.checkpoint_manifest.stop_cleanly`); None when it printed
    none. `rl` exits with `DISK_FULL_EXIT` for a full disk (torchrun's own code is 1 whatever its rank's), with 2
    where the child exited as on a config error, else 1."""
    stopped = stop_reason(log_path)
    if stopped is None:
        return None
    code = DISK_FULL_EXIT if stopped.startswith("disk full") else 2 if rc == 2 else 1
    return ChildFailed(f"{name} stopped: {stopped}", exit_code=code)


def tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])
