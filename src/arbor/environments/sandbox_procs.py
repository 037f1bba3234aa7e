"""The sandbox's process plumbing (arbor.environments.sandbox): the memory and disk watchdog of a run, its
stdin feed and capped output reads, and killing and removing what a run leaves (its process group, its per-run
cgroup, its work directory)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from pathlib import Path

log = logging.getLogger("arbor.environments.sandbox")


def read_text_or_empty(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


async def watch_limits(cgroup: Path | None, memory: int, workdir: str | None, disk: int, interval: float = 0.02) -> str:
    """Returns what the run exceeded: "memory" when the resident memory of all its processes (listed by its
    cgroup) together exceeds `memory` (RLIMIT_AS bounds each process only), "disk" when the files under `workdir`
    together exceed `disk` (RLIMIT_FSIZE bounds each file only; used where no tmpfs bounds the directory).
    Polled, so a run may overshoot by what it allocates or writes in `interval` (with the one-CPU quota, well
    under a GiB). Shared pages count once per process, so the memory check errs on the strict side."""
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        if cgroup is not None:
            total = 0
            for pid in read_text_or_empty(str(cgroup / "cgroup.procs")).split():
                statm = read_text_or_empty(f"/proc/{pid}/statm").split()
                total += int(statm[1]) * page if len(statm) > 1 else 0
            if total > memory:
                return "memory"
        if workdir is not None and tree_size(workdir) > disk:
            return "disk"
        await asyncio.sleep(interval)


def tree_size(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


async def feed_and_wait(proc: asyncio.subprocess.Process, stdin: str) -> None:
    try:
        if stdin:
            proc.stdin.write(stdin.encode())
            await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading its input
    await proc.wait()


async def read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    kept, cut = bytearray(), False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        kept += chunk[: max(room, 0)]
        cut = cut or len(chunk) > room
    return bytes(kept), cut


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_cgroup(cgroup: Path, remove: bool = True) -> None:
    """SIGKILLs every process left in the cgroup (a fork bomb may still be forking: repeat until empty)."""
    for _ in range(200):
        pids = [int(p) for p in read_text_or_empty(str(cgroup / "cgroup.procs")).split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    if remove:
        rmdir_cgroup(cgroup)


def rmdir_cgroup(cgroup: Path) -> None:
    for _ in range(100):  # killed processes leave the cgroup once reaped, shortly after
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    log.warning("code sandbox: could not remove cgroup %s", cgroup)


def remove_tree(path: str) -> None:
    def make_writable(func, p, _exc):  # the program may have removed its own permissions (userns mode)
        os.chmod(os.path.dirname(p), 0o700)
        os.chmod(p, 0o700)
        func(p)

    shutil.rmtree(path, onerror=make_writable)
