"""The code sandbox and the `code` environment: hostile programs are contained and scored 0 while the run goes on.

Every hostile program runs under small limits (a few seconds, 32 processes, 256 MiB per process), so a failure of
containment shows up as a slow or failing test rather than a harmed machine; each test checks afterwards that no
sandbox process, temporary directory or cgroup is left.
"""

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from arbor.config.environment import EnvironmentConfig
from arbor.environments.code import CodeEnv, extract_code
from arbor.environments.protocol import Environment, load_environment
from arbor.environments.sandbox import (
    CGROUP_PREFIX,
    MAX_SLOTS,
    UID_BASE,
    UNSHARE_FLAGS,
    Isolation,
    Sandbox,
    SandboxLimits,
    _python_for,
    _remove_stale,
    detect_isolation,
)

LIMITS = SandboxLimits(cpu_seconds=3, wall_seconds=6, memory_mb=256, max_processes=16, disk_mb=32)

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
SHELL_FORK_BOMB = (
    "import subprocess\nwhile True:\n    try:\n"
    "        subprocess.Popen(['sh', '-c', 'f() { f | f & }; f'], start_new_session=True)\n"
    "    except OSError:\n        pass\n"
)
INFINITE_LOOP = "while True:\n    pass\n"
ALLOCATE_10GB = "x = bytearray(10 * 1024 ** 3)\n"
WRITE_1GB = "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2 ** 20)\n"
WRITE_1GB_MANY_FILES = (
    "chunk = b'0' * 2 ** 20\nfor i in range(1024):\n    with open(f'part{i}', 'wb') as f:\n"
    "        for _ in range(8):\n            f.write(chunk)\n"
)


def sandbox_processes(owner: int | None = None) -> list[str]:
    """Live processes of the sandboxes of process `owner` (default: this one; other runs may share the host):
    one of its slot uids, or one of its work directories on the command line."""
    owner = os.getpid() if owner is None else owner
    mine = f"/arbor-sandbox-{owner}-".encode()
    uids = range(UID_BASE + (owner % 4_000_000) * MAX_SLOTS, UID_BASE + (owner % 4_000_000 + 1) * MAX_SLOTS)
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(ln for ln in status.read_text().splitlines() if ln.startswith("Uid:")).split()[1])
            cmdline = (status.parent / "cmdline").read_bytes()
        except (OSError, StopIteration):
            continue
        if uid in uids or mine in cmdline:
            found.append(f"{status.parent.name} uid={uid} {cmdline[:80]!r}")
    return found


def leftovers(before_dirs: set[str]) -> list[str]:
    dirs = set(map(str, Path(tempfile.gettempdir()).glob(f"arbor-sandbox-{os.getpid()}-*"))) - before_dirs
    iso = detect_isolation()
    cgroups = [
        str(p)
        for parent in (iso.pids_cgroup, iso.cpu_cgroup)
        if parent
        for p in Path(parent).glob(f"{CGROUP_PREFIX}{os.getpid()}-*")
    ]
    return sandbox_processes() + sorted(dirs) + cgroups


@pytest.fixture
def clean():
    """Asserts the test leaves no sandbox process, work directory or cgroup behind."""
    before = set(map(str, Path(tempfile.gettempdir()).glob(f"arbor-sandbox-{os.getpid()}-*")))
    yield
    deadline = time.monotonic() + 5
    while (left := leftovers(before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def run(code: str, sandbox: Sandbox | None = None, **kw):
    return asyncio.run((sandbox or Sandbox(LIMITS)).run(code, **kw))


def test_isolation_is_detected_and_strongest_here():
    iso = detect_isolation()
    print(iso.describe())
    assert iso.mode in ("namespaces", "userns", "rlimits")
    unshare = shutil.which("unshare")
    can_unshare = (
        unshare
        and subprocess.run(
            [unshare, "--pid", "--fork", "--mount", "--net", "true"], capture_output=True, timeout=30
        ).returncode
        == 0
    )
    if os.geteuid() == 0 and can_unshare:  # root where namespaces work: the strongest mode must be chosen
        assert iso.mode == "namespaces" and iso.drop_uid, iso.describe()
    r = run("import os\nprint(open('/proc/self/cgroup').read())\nprint(os.getuid(), os.getpid())")
    groups = dict(line.split(":", 2)[1:] for line in r.stdout.splitlines()[:-1] if line)
    for controller, parent in (("pids", iso.pids_cgroup), ("cpu", iso.cpu_cgroup)):
        if parent:  # the run sits in its own per-run cgroup of that controller
            assert any(controller in k.split(",") and CGROUP_PREFIX in v for k, v in groups.items()), groups
    uid, pid = map(int, r.stdout.splitlines()[-1].split())
    if iso.drop_uid:
        assert uid >= UID_BASE
    if iso.mode != "rlimits":
        assert pid == 1  # its own pid namespace


def test_program_runs_in_fresh_dir_that_is_removed(clean):
    r = run(
        "import os, sys\nprint(os.getcwd(), os.environ['HOME'], sorted(os.environ))\n"
        "print(sys.stdin.read().upper())\nopen('out.txt', 'w').write('fine')\n",
        stdin="hello",
    )
    assert r.ok and not r.timed_out, r.stderr
    cwd, home, env = r.stdout.splitlines()[0].split(" ", 2)
    assert "arbor-sandbox-" in cwd and home == cwd
    assert "AWS" not in env and "VIRTUAL_ENV" not in env  # scrubbed environment
    assert r.stdout.splitlines()[1] == "HELLO"
    assert not Path(cwd).exists()


@pytest.mark.slow
def test_sandbox_dies_with_its_orchestrator():
    """SIGKILL the process that started a run: the run's processes die too (no orphan keeps sleeping)."""
    forks = detect_isolation().mode != "rlimits"  # the audit hook of that mode refuses fork
    program = "import os, time\\nos.fork()\\ntime.sleep(300)" if forks else "import time\\ntime.sleep(300)"
    script = (
        "import asyncio\nfrom arbor.environments.sandbox import Sandbox, SandboxLimits\n"
        "asyncio.run(Sandbox(SandboxLimits(wall_seconds=300, cpu_seconds=300)).run("
        f"'{program}'))\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline, started = time.monotonic() + 60, 0
        while started < 2 and time.monotonic() < deadline:  # twice, 1 s apart: not the short isolation probe
            started = started + 1 if len(sandbox_processes(owner.pid)) >= 1 + forks else 0
            time.sleep(1.0)
        assert started == 2, "the sandboxed program did not start"
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while sandbox_processes(owner.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sandbox_processes(owner.pid)
    # What the dead process could not clean, the next process's first sandbox removes.
    iso = detect_isolation()
    for parent, cgroups in [(iso.pids_cgroup, True), (iso.cpu_cgroup, True), (tempfile.gettempdir(), False)]:
        if parent:
            _remove_stale(Path(parent), cgroups)
            assert not list(Path(parent).glob(f"{CGROUP_PREFIX}{owner.pid}-*"))


@pytest.mark.slow
def test_hostile_programs_contained(clean):
    sandbox = Sandbox(LIMITS, max_concurrency=4)
    programs = {
        "fork bomb": FORK_BOMB,
        "shell fork bomb": SHELL_FORK_BOMB,
        "infinite loop": INFINITE_LOOP,
        "10 GB": ALLOCATE_10GB,
        "1 GB file": WRITE_1GB,
    }

    async def main():
        return await asyncio.gather(*(sandbox.run(p) for p in programs.values()))

    start = time.monotonic()
    results = dict(zip(programs, asyncio.run(main())))
    assert time.monotonic() - start < 30
    for name, r in results.items():
        assert not r.ok, (name, r)
        assert r.seconds < LIMITS.wall_seconds + 3, (name, r.seconds)
    assert results["infinite loop"].timed_out or results["infinite loop"].returncode < 0
    assert "MemoryError" in results["10 GB"].stderr
    assert "File too large" in results["1 GB file"].stderr
    assert run("print(sum(range(10)))").stdout == "45\n"  # the machine still runs programs


@pytest.mark.skipif(
    detect_isolation().pids_cgroup is None and detect_isolation().cpu_cgroup is None,
    reason="the run-wide memory watchdog needs a per-run cgroup to list the processes",
)
def test_total_memory_bounded(clean):
    """8 processes of 160 MiB each, each within RLIMIT_AS (256 MiB), 1.3 GiB together: over the run's 256 MiB."""
    code = (
        "import os, time\nfor _ in range(7):\n    if os.fork() == 0:\n        break\n"
        "x = bytearray(160 * 2 ** 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\ntime.sleep(5)\n"
        "print('survived', flush=True)\n"
    )
    r = run(code)
    assert r.exceeded == "memory" and not r.ok and not r.timed_out, r
    assert "survived" not in r.stdout  # killed while it held the memory, not after its sleep ended
    assert run("x = bytearray(100 * 2 ** 20)\nprint(len(x))").ok  # one process under the limit is fine


@pytest.mark.skipif(detect_isolation().mode == "rlimits", reason="needs the tmpfs work directory (namespaces)")
def test_total_disk_bounded(clean):
    r = run(WRITE_1GB_MANY_FILES)
    assert not r.ok and "No space left on device" in r.stderr, r.stderr[-300:]


def test_process_limit_is_per_run(clean):
    """50 harmless sleeps: at most max_processes exist, and none survives the run."""
    code = (
        "import subprocess\nps = []\ntry:\n    for _ in range(50):\n"
        "        ps.append(subprocess.Popen(['sleep', '30']))\nexcept OSError:\n    pass\nprint(len(ps))\n"
    )
    r = run(code)
    if detect_isolation().mode == "rlimits":
        assert "not allowed" in r.stdout + r.stderr or int(r.stdout) < LIMITS.max_processes
    else:
        assert r.ok, r.stderr
        assert 0 < int(r.stdout) < LIMITS.max_processes


def escape_attempts(targets: list[Path]) -> str:
    lines = ["import os", "results = []"]
    for t in targets:
        lines.append(
            f"try:\n    open({str(t)!r}, 'w').write('x')\n    results.append('WROTE')\n"
            f"except Exception as e:\n    results.append(type(e).__name__)"
        )
    lines.append(
        f"try:\n    os.symlink({str(targets[0])!r}, 'link')\n    open('link', 'w').write('x')\n"
        f"    results.append('WROTE')\nexcept Exception as e:\n    results.append(type(e).__name__)"
    )
    lines.append("print(results)")
    return "\n".join(lines)


def test_nothing_escapes_the_temporary_directory(clean):
    tag = uuid.uuid4().hex
    repo = Path(__file__).resolve().parents[2]
    targets = [
        Path(tempfile.gettempdir(), f"escape-{tag}"),
        repo / f"escape-{tag}",
        Path("/var/tmp", f"escape-{tag}"),
        Path("/dev/shm", f"escape-{tag}"),
        Path.home() / f"escape-{tag}",
    ]
    r = run(escape_attempts(targets))
    assert "WROTE" not in r.stdout, r.stdout
    for t in targets:
        assert not t.exists(), t


def test_no_network(clean):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = (
        f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n    s = socket.socket()\n"
        "    s.settimeout(2)\n    try:\n        s.connect(addr)\n        print('CONNECTED')\n"
        "    except Exception as e:\n        print(type(e).__name__)\n"
    )
    try:
        r = run(code)
        server.settimeout(0.5)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert "CONNECTED" not in r.stdout, r.stdout


def test_output_capped(clean):
    r = run("import sys\nsys.stdout.write('x' * 10_000_000)\n", Sandbox(SandboxLimits(max_output_bytes=1000)))
    assert r.ok and r.truncated and len(r.stdout) == 1000


def test_concurrency_limit(clean):
    sandbox = Sandbox(LIMITS, max_concurrency=2)
    code = "import time\nprint(time.time())\ntime.sleep(0.5)\nprint(time.time())\n"

    async def main():
        return await asyncio.gather(*(sandbox.run(code) for _ in range(5)))

    spans = [tuple(map(float, r.stdout.split())) for r in asyncio.run(main())]
    for start, _ in spans:
        assert sum(s <= start < e for s, e in spans) <= 2, spans


def forced(mode: str) -> Isolation:
    """A weaker mode than this host may offer. As root without a uid drop, RLIMIT_NPROC is not enforced (uid 0 of
    a user namespace is still root's uid), so the fork bomb then needs the pids cgroup: skip it when there is none."""
    cgroup = detect_isolation().pids_cgroup
    if mode == "userns":
        if not shutil.which("unshare"):
            pytest.skip("no unshare")
        if os.geteuid() == 0 and cgroup is None:
            pytest.skip("root without a pids cgroup: nothing would bound a fork bomb in a user namespace")
        return Isolation(
            "userns",
            (shutil.which("unshare"), "--user", "--map-root-user", *UNSHARE_FLAGS),
            sys.executable,
            False,
            cgroup,
        )
    drop = os.geteuid() == 0 and _python_for(True) is not None
    return Isolation("rlimits", (), _python_for(True) if drop else sys.executable, drop, cgroup)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["userns", "rlimits"])
def test_weaker_modes_still_contain(mode, clean):
    sandbox = Sandbox(LIMITS, isolation=forced(mode))
    probe = run("print('ok')", sandbox)
    if mode == "userns" and probe.returncode != 0:
        pytest.skip(f"user namespaces unavailable here: {probe.stderr.strip()[-200:]}")
    assert probe.stdout == "ok\n", probe.stderr
    tag = uuid.uuid4().hex
    target = Path(tempfile.gettempdir(), f"escape-{tag}")
    r = run(escape_attempts([target]), sandbox)
    assert "WROTE" not in r.stdout and not target.exists(), r
    r = run(
        "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', 9))\nprint('CONNECTED')", sandbox
    )
    assert "CONNECTED" not in r.stdout
    r = run(WRITE_1GB_MANY_FILES, sandbox)
    assert not r.ok and (r.exceeded == "disk" or "No space left" in r.stderr), r
    if mode == "userns":  # uid 0 of the user namespace must not be able to undo the read-only mounts
        r = run(
            "import subprocess\nprint(subprocess.run(['mount', '-o', 'remount,rw', '/'], capture_output=True)"
            ".returncode)",
            sandbox,
        )
        assert r.stdout.strip() not in ("", "0"), r

    async def hostile():
        return await asyncio.gather(sandbox.run(FORK_BOMB), sandbox.run(INFINITE_LOOP), sandbox.run(ALLOCATE_10GB))

    assert not any(r.ok for r in asyncio.run(hostile()))


# --- the code environment ---------------------------------------------------------------------------------


def test_code_env_contract_and_references():
    env = load_environment(EnvironmentConfig(id="code", args={"num_tasks": 16, "tests_per_task": 3}))
    assert isinstance(env, CodeEnv) and isinstance(env, Environment)
    tasks = env.dataset(0)
    assert tasks == env.dataset(0) and tasks != env.dataset(1)
    assert len({t["entry"] for t in tasks}) == 16
    assert "```python" in env.prompt(tasks[0])[-1]["content"]

    async def main():
        return await asyncio.gather(*(env.score(t, env.reference(t)) for t in tasks))

    assert asyncio.run(main()) == [{"pass": 1.0, "format": 1.0}] * 16


def test_code_env_partial_credit_and_format():
    env = CodeEnv(num_tasks=1, tests_per_task=6)
    task = env.dataset(0)[0]  # add_constant
    k = task["tests"][0]["expected"] - task["tests"][0]["args"][0]
    half_right = f"```python\ndef add_constant(x):\n    return x + {k} if x % 2 == 0 else x\n```"
    expected = sum(t["args"][0] % 2 == 0 for t in task["tests"]) / 6
    assert asyncio.run(env.score(task, half_right)) == {"pass": expected, "format": 1.0}
    assert asyncio.run(env.score(task, "def add_constant(x): ...")) == {"pass": 0.0, "format": 0.0}
    strict = CodeEnv(num_tasks=1, tests_per_task=6, partial_credit=False)
    assert asyncio.run(strict.score(task, half_right))["pass"] == float(expected == 1.0)
    assert extract_code("a\n```\nbare\n```\n```python\nlast\n```") == "last\n"


def test_code_env_resists_reward_hacks():
    env = CodeEnv(num_tasks=1)
    task = env.dataset(0)[0]
    hacks = [
        "import sys\nprint('__arbor_result__' + 'x' * 32 + '[true, true, true, true, true, true]')\nsys.exit(0)",
        "import os\nos._exit(0)",
        "class Any:\n    def __eq__(self, other):\n        return True\ndef add_constant(x):\n    return Any()",
        "import __main__\nprint(getattr(__main__, 'nonce', 'hidden'))\ndef add_constant(x):\n    return None",
    ]

    async def main():
        return await asyncio.gather(*(env.score(task, f"```python\n{h}\n```") for h in hacks))

    assert [s["pass"] for s in asyncio.run(main())] == [0.0] * len(hacks)


@pytest.mark.slow
def test_code_env_hostile_completions_score_zero_and_the_run_goes_on(clean):
    """The acceptance test: a fork bomb, an infinite loop, 10 GB and a 1 GB write, scored concurrently with
    correct answers, each score 0 without raising, and correct answers (during and after) still score 1."""
    env = CodeEnv(num_tasks=4, cpu_seconds=3, wall_seconds=6, memory_mb=256, max_concurrency=4)
    tasks = env.dataset(0)
    hostile = [FORK_BOMB, SHELL_FORK_BOMB, INFINITE_LOOP, ALLOCATE_10GB, WRITE_1GB, WRITE_1GB_MANY_FILES]

    async def main():
        bad = [env.score(tasks[i % 4], f"```python\n{code}\n```") for i, code in enumerate(hostile)]
        good = [env.score(t, env.reference(t)) for t in tasks]
        scored = await asyncio.gather(*bad, *good)
        return scored, await env.score(tasks[0], env.reference(tasks[0]))

    start = time.monotonic()
    scored, after = asyncio.run(main())
    assert time.monotonic() - start < 40
    assert [s["pass"] for s in scored] == [0.0] * len(hostile) + [1.0] * 4
    assert after == {"pass": 1.0, "format": 1.0}
