"""arbor.runloop: a process whose environment call never returned (a worker thread stuck after its coroutine
timed out) still ends, with its output and exit status, instead of hanging in the interpreter's thread join."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from arbor import runloop

SCRIPT = """
import asyncio, sys, time
from arbor import runloop

async def main(stuck, fail):
    if stuck:  # an environment call that never returns, cancelled by its timeout
        try:
            await asyncio.wait_for(asyncio.to_thread(time.sleep, 600), 0.1)
        except asyncio.TimeoutError:
            pass
    await asyncio.to_thread(time.sleep, 0.05)  # work that does finish
    if fail:
        raise RuntimeError("the run failed")
    return "result"

stuck, fail = sys.argv[1] == "stuck", sys.argv[2] == "fail"
print(runloop.run(main(stuck, fail), grace=0.2), flush=True)
runloop.exit_if_stuck(grace=0.2)
print("after", flush=True)
"""


def run_script(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    return proc, time.perf_counter() - t0


@pytest.mark.slow
def test_a_stuck_worker_thread_does_not_keep_the_process_from_ending():
    proc, seconds = run_script("stuck", "ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["result"]  # the caller's output is out; nothing after exit_if_stuck runs
    assert "1 worker thread(s) still running" in proc.stderr
    assert seconds < 60  # the stuck call sleeps for 600 s


@pytest.mark.slow
def test_a_failing_run_with_a_stuck_thread_exits_1_with_its_traceback():
    proc, _ = run_script("stuck", "fail")
    assert proc.returncode == 1
    assert "RuntimeError: the run failed" in proc.stderr
    assert "worker thread(s) still running" in proc.stderr


@pytest.mark.slow
def test_without_stuck_threads_the_process_goes_on_as_usual():
    proc, _ = run_script("free", "ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["result", "after"]
    assert "worker thread" not in proc.stderr


def test_run_returns_the_result_and_closes_its_loop():
    async def main() -> int:
        return await asyncio.to_thread(lambda: 41) + 1

    assert runloop.run(main()) == 42
    # (exit_if_stuck is checked in subprocesses only: were a thread ever stuck here, it would end pytest itself)


def test_the_pool_runs_as_many_blocking_calls_at_once_as_it_has_threads():
    """`threads` (environment.threads) bounds how many blocking calls run at once; Python's default pool would
    have run min(32, cores + 4)."""

    def peak(threads: int, calls: int) -> int:
        running, most, lock = [0], [0], threading.Lock()

        def call() -> None:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.3)
            with lock:
                running[0] -= 1

        async def main() -> None:
            await asyncio.gather(*(asyncio.to_thread(call) for _ in range(calls)))

        runloop.run(main(), threads=threads)
        return most[0]

    assert peak(40, 40) == 40
    assert peak(3, 12) == 3
