"""Run untrusted, model-written Python in a confined subprocess, asynchronously and many at a time.

Each run gets a fresh work directory, a scrubbed environment, rlimits, capped output and a wall-clock kill of its
process group; on top, the strongest isolation the host offers is chosen once per process (`detect_isolation`:
pid/network/mount namespaces with a per-slot unprivileged uid, the same in a user namespace, or rlimits plus an
audit hook), plus per-run pids and cpu cgroups where they can be made (and then a whole-run memory watchdog).
Local on purpose: no container service, about one interpreter start per run.

The process plumbing (the memory and disk watchdog, capped output, killing and removing what a run leaves) is
arbor.environments.sandbox_procs. Details: docs/agents.md, "The sandbox".
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from arbor.environments.sandbox_procs import (
    feed_and_wait,
    kill_cgroup,
    kill_group,
    read_capped,
    read_text_or_empty,
    remove_tree,
    rmdir_cgroup,
    watch_limits,
)

log = logging.getLogger(__name__)

CHILD_SOURCE = (Path(__file__).parent / "_sandbox_child.py").read_text()
SETUP_FAILED = 125
UID_BASE = 1_000_000_000  # far above any real account; one uid per (orchestrator pid, slot)
MAX_SLOTS = 64
UNSHARE_RERAISE_FAILED = b"unshare: sigprocmask unblock failed"
UNSHARE_FLAGS = [
    "--pid",
    "--fork",
    "--kill-child",
    "--mount-proc",
    "--net",
    "--ipc",
    "--uts",
    "--propagation",
    "private",
]
CGROUP_PREFIX = "arbor-sandbox-"


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    """CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL one second later)."""
    wall_seconds: float = 10.0
    """Wall-clock seconds for the whole run; then its process group (and namespace) is killed."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS), MiB."""
    file_size_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE), MiB."""
    max_processes: int = 32
    """Processes and threads in the run (RLIMIT_NPROC for the slot uid, and pids.max)."""
    max_open_files: int = 64
    disk_mb: int = 64
    """All files of a run together, MiB: the size of the work directory's tmpfs (namespace modes), else polled."""
    max_output_bytes: int = 64 * 1024
    """Bytes of stdout and of stderr kept; the rest is read and dropped."""


@dataclass
class SandboxResult:
    returncode: int | None
    """Exit status (negative: killed by that signal; None: never started)."""
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    truncated: bool = False
    exceeded: str | None = None
    """"memory": killed because its processes together held more than `memory_mb` resident (needs a cgroup);
    "disk": because its files together took more than `disk_mb` (the mode without a tmpfs)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.exceeded is None


@dataclass(frozen=True)
class Isolation:
    mode: str
    """`namespaces`, `userns` or `rlimits` (see the module docstring)."""
    prefix: tuple[str, ...]
    """The command that enters the namespaces (empty for `rlimits`)."""
    python: str
    drop_uid: bool
    pids_cgroup: str | None
    """Directory under which a per-run pids cgroup is created, or None."""
    cpu_cgroup: str | None = None
    """Directory under which a per-run cpu cgroup (quota: one CPU) is created, or None."""

    def describe(self) -> str:
        parts = {
            "namespaces": "pid+net+mount(read-only)+ipc+uts namespaces via unshare",
            "userns": "user+pid+net+mount(read-only)+ipc+uts namespaces via unshare -U",
            "rlimits": "no namespaces; audit hook refuses sockets/processes/ctypes/writes outside (best effort)",
        }
        extra = ["uid drop per slot (RLIMIT_NPROC enforced)"] if self.drop_uid else []
        if "--pdeathsig" in self.prefix:
            extra.append("namespace killed if this process dies (setpriv --pdeathsig)")
        extra.append(f"pids cgroup under {self.pids_cgroup}" if self.pids_cgroup else "no pids cgroup")
        extra.append(f"cpu cgroup (1 CPU) under {self.cpu_cgroup}" if self.cpu_cgroup else "no cpu cgroup")
        extra += ["rlimits cpu/as/fsize/nproc/nofile", f"python {self.python}"]
        return f"{self.mode}: {parts[self.mode]}; {'; '.join(extra)}"


def _world_usable(path: str) -> bool:
    """Whether any uid can execute `path`: every ancestor directory searchable by others, the file r-x."""
    p = Path(os.path.realpath(path))
    try:
        if (p.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH)) != (stat.S_IROTH | stat.S_IXOTH):
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _python_for(drop_uid: bool) -> str | None:
    """This interpreter, or (when the sandbox uid cannot reach it, e.g. under a 0700 /root) the first
    world-executable python3 found on PATH or in the usual system directories, same minor version first."""
    if not drop_uid or _world_usable(sys.executable):
        return sys.executable
    dirs = [*os.environ.get("PATH", "").split(os.pathsep), "/usr/local/bin", "/usr/bin", "/bin"]
    names = [f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3"]
    for name in names:
        for d in dirs:
            c = os.path.join(d, name)
            if d and os.path.isfile(c) and _world_usable(c):
                return c
    return None


def _own_cgroup(controller: str) -> Path | None:
    """This process's cgroup directory for `controller` (a v1 hierarchy, or v2 when it offers the controller),
    when it is writable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            bases = [Path("/sys/fs/cgroup", controllers), Path("/sys/fs/cgroup", controller)]
        elif controllers == "" and controller in read_text_or_empty("/sys/fs/cgroup/cgroup.controllers").split():
            bases = [Path("/sys/fs/cgroup")]
        else:
            continue
        for base in bases:
            d = base / path.lstrip("/")
            if (d / "cgroup.procs").exists() and os.access(d, os.W_OK):
                return d
    return None


def _remove_stale(parent: Path, cgroups: bool) -> None:
    """Per-run cgroups (empty by then) or work directories left by a process that died (its pid is in the name)."""
    for d in parent.glob(CGROUP_PREFIX + "*"):
        owner = d.name[len(CGROUP_PREFIX) :].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            try:
                d.rmdir() if cgroups else remove_tree(str(d))
            except OSError:
                pass


def _probe(iso: Isolation) -> str | None:
    """Runs a trivial program under `iso`; returns None when it works, else why not."""
    sandbox = Sandbox(SandboxLimits(wall_seconds=20), max_concurrency=1, isolation=iso)
    result = asyncio.run(sandbox.run("print('ok')"))
    if result.returncode == 0 and result.stdout.strip() == "ok":
        return None
    return (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]


_detect_lock = threading.Lock()
_run_ids = itertools.count()  # names per-run cgroups uniquely within this process


def detect_isolation() -> Isolation:
    """The strongest containment that works on this host (probed once per process, logged in one line)."""
    with _detect_lock:  # concurrent first runs wait for one probe
        return _detect_isolation()


@functools.cache
def _detect_isolation() -> Isolation:
    unshare = shutil.which("unshare")
    groups = {c: _own_cgroup(c) for c in ("pids", "cpu")}
    for d in groups.values():
        if d is not None:
            _remove_stale(d, cgroups=True)
    _remove_stale(Path(tempfile.gettempdir()), cgroups=False)
    cg = str(groups["pids"]) if groups["pids"] else None
    cpu = str(groups["cpu"]) if groups["cpu"] else None
    root = os.geteuid() == 0
    candidates = []
    enter: tuple[str, ...] = (unshare,) if unshare else ()
    if unshare and (setpriv := shutil.which("setpriv")):
        helped = subprocess.run([setpriv, "--help"], capture_output=True, text=True).stdout
        if "--pdeathsig" in helped:  # unshare then dies with this process, and with it the whole namespace
            enter = (setpriv, "--pdeathsig", "KILL", unshare)
    if unshare and root and (py := _python_for(drop_uid=True)):
        candidates.append(Isolation("namespaces", (*enter, *UNSHARE_FLAGS), py, True, cg, cpu))
    if unshare and not root:
        candidates.append(
            Isolation("userns", (*enter, "--user", "--map-root-user", *UNSHARE_FLAGS), sys.executable, False, cg, cpu)
        )
    if root and (py := _python_for(drop_uid=True)):
        candidates.append(Isolation("rlimits", (), py, True, cg, cpu))
    candidates.append(Isolation("rlimits", (), sys.executable, False, cg, cpu))
    for iso in candidates:
        why = _probe(iso)
        if why is None:
            (log.info if iso.mode != "rlimits" else log.warning)("code sandbox isolation: %s", iso.describe())
            return iso
        log.warning("code sandbox: %s isolation unavailable (%s); trying a weaker one", iso.mode, why)
    raise RuntimeError("code sandbox: not even rlimits-only isolation works on this host")


class Sandbox:
    """Runs Python source in a confined subprocess. `run` is async; at most `max_concurrency` run at once."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        max_concurrency: int = 4,
        isolation: Isolation | None = None,
        root: str | None = None,
    ) -> None:
        if not 1 <= max_concurrency <= MAX_SLOTS:
            raise ValueError(f"max_concurrency must be in [1, {MAX_SLOTS}], got {max_concurrency}")
        self.limits = limits or SandboxLimits()
        self.max_concurrency = max_concurrency
        self._isolation = isolation
        self.root = root
        self._slots = list(range(max_concurrency))
        self._lock = threading.Lock()
        self._semaphores: dict[int, asyncio.Semaphore] = {}  # one per event loop: a Semaphore binds to its loop

    @property
    def isolation(self) -> Isolation:
        if self._isolation is None:
            self._isolation = detect_isolation()
        return self._isolation

    def _semaphore(self) -> asyncio.Semaphore:
        loop = id(asyncio.get_running_loop())
        with self._lock:
            if loop not in self._semaphores:
                self._semaphores[loop] = asyncio.Semaphore(self.max_concurrency)
            return self._semaphores[loop]

    async def run(self, code: str, files: dict[str, str] | None = None, stdin: str = "") -> SandboxResult:
        """Writes `code` as `main.py` (and `files`) into a fresh directory and runs it there."""
        if self._isolation is None:
            await asyncio.to_thread(lambda: self.isolation)  # the first probe runs subprocesses
        async with self._semaphore():
            slot = await self._take_slot()
            try:
                return await self._run(code, files or {}, stdin, slot)
            finally:
                with self._lock:
                    self._slots.append(slot)

    async def _take_slot(self) -> int:
        # The per-loop semaphore bounds one loop; slots (uids) are shared by all loops using this sandbox, so
        # a run from a second loop waits here while the first holds them all.
        while True:
            with self._lock:
                if self._slots:
                    return self._slots.pop()
            await asyncio.sleep(0.05)

    def _rlimits(self) -> dict[str, list[int]]:
        lim, mib = self.limits, 1024 * 1024
        return {
            "RLIMIT_CPU": [lim.cpu_seconds, lim.cpu_seconds + 1],
            "RLIMIT_AS": [lim.memory_mb * mib] * 2,
            "RLIMIT_FSIZE": [lim.file_size_mb * mib] * 2,
            "RLIMIT_NPROC": [lim.max_processes] * 2,
            "RLIMIT_NOFILE": [lim.max_open_files] * 2,
            "RLIMIT_CORE": [0, 0],
        }

    def _make_cgroups(self, slot: int) -> list[Path]:
        """This run's pids cgroup (pids.max) and cpu cgroup (a quota of one CPU, so a fork bomb or a busy loop
        takes at most one core however many processes it has), as far as the host allows."""
        iso, made = self.isolation, []
        name = f"{CGROUP_PREFIX}{os.getpid()}-{slot}-{next(_run_ids)}"
        wanted = [
            (iso.pids_cgroup, [("pids.max", str(self.limits.max_processes))]),
            (
                iso.cpu_cgroup,
                [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "100000")]
                if Path(iso.cpu_cgroup or "", "cpu.cfs_quota_us").exists()
                else [("cpu.max", "100000 100000")],
            ),
        ]
        for parent, settings in wanted:
            if parent is None:
                continue
            d = Path(parent) / name
            try:
                d.mkdir()
                for file, value in settings:
                    (d / file).write_text(value)
            except OSError as e:
                log.warning("code sandbox: cannot set up cgroup %s (%s); running without it", d, e)
                rmdir_cgroup(d)
                continue
            made.append(d)
        return made

    async def _run(self, code: str, files: dict[str, str], stdin: str, slot: int) -> SandboxResult:
        iso = self.isolation
        workdir = tempfile.mkdtemp(prefix=f"{CGROUP_PREFIX}{os.getpid()}-", dir=self.root)  # owner in the name
        uid = gid = None
        if iso.drop_uid:
            uid = gid = UID_BASE + (os.getpid() % 4_000_000) * MAX_SLOTS + slot
        cgroups: list[Path] = []
        start = time.monotonic()
        try:
            for name, text in {**files, "main.py": code}.items():
                path = Path(workdir, name)
                if path.resolve().parent != Path(workdir).resolve():
                    raise ValueError(f"sandbox file name {name!r} must be a plain file name")
                path.write_text(text)
            if uid is not None:
                for p in [workdir, *(str(Path(workdir, n)) for n in [*files, "main.py"])]:
                    os.chown(p, uid, gid)
            os.chmod(workdir, 0o700)
            cgroups = await asyncio.to_thread(self._make_cgroups, slot)
            cfg = {
                "workdir": os.path.realpath(workdir),
                "main": "main.py",
                "rlimits": self._rlimits(),
                "uid": uid,
                "gid": gid,
                "read_only_mounts": iso.mode != "rlimits",
                "disk_mb": self.limits.disk_mb,
                "audit": iso.mode == "rlimits",
                "cgroup_procs": [str(d / "cgroup.procs") for d in cgroups],
            }
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": workdir,
                "TMPDIR": workdir,
                "LANG": "C.UTF-8",
                "PYTHONHASHSEED": "0",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
            }
            argv = [*iso.prefix, iso.python, "-I", "-B", "-c", CHILD_SOURCE, json.dumps(cfg)]
            return await self._execute(argv, env, workdir, stdin, start, cgroups)
        finally:
            for d in cgroups:
                await asyncio.to_thread(kill_cgroup, d)
            await asyncio.to_thread(remove_tree, workdir)

    async def _execute(
        self, argv: list[str], env: dict[str, str], workdir: str, stdin: str, start: float, cgroups: list[Path]
    ) -> SandboxResult:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=workdir,
            start_new_session=True,
        )
        cap = self.limits.max_output_bytes
        readers = [asyncio.ensure_future(read_capped(s, cap)) for s in (proc.stdout, proc.stderr)]
        waiter = asyncio.ensure_future(feed_and_wait(proc, stdin))
        disk = workdir if self.isolation.mode == "rlimits" else None  # the namespace modes have a bounded tmpfs
        watcher = None
        if cgroups or disk:
            watcher = asyncio.ensure_future(
                watch_limits(
                    cgroups[0] if cgroups else None, self.limits.memory_mb * 2**20, disk, self.limits.disk_mb * 2**20
                )
            )
        try:
            ended, _ = await asyncio.wait(
                [t for t in (waiter, watcher) if t],
                timeout=self.limits.wall_seconds,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for t in (waiter, watcher):
                if t:
                    t.cancel()
            kill_group(proc.pid)
            if cgroups:
                await asyncio.to_thread(kill_cgroup, cgroups[0], False)
            await proc.wait()
        # Pipes close when the last holder dies; without a pid namespace an escaped daemon could hold them.
        done, pending = await asyncio.wait(readers, timeout=1.0)
        for r in pending:
            r.cancel()
        (out, out_cut), (err, err_cut) = [r.result() if r in done else (b"", True) for r in readers]
        if proc.returncode == SETUP_FAILED and b"sandbox setup failed" in err:
            log.error("code sandbox: %s", err.decode(errors="replace").strip())
        returncode = proc.returncode
        if returncode == 1 and UNSHARE_RERAISE_FAILED in err:
            # `unshare --fork` re-raises on itself the signal that killed the program; when that fails (seen once
            # under heavy load, on a CPU-limit kill) unshare exits 1 with this message instead: still a kill.
            returncode = -signal.SIGKILL
        return SandboxResult(
            returncode=returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=not ended,
            seconds=time.monotonic() - start,
            truncated=out_cut or err_cut,
            exceeded=watcher.result() if watcher in ended else None,
        )
