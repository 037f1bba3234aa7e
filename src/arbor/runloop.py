"""Runs a process's event loop to completion without waiting, at exit, for threads an environment left running.

`asyncio.run` joins the default executor's threads when it closes the loop, and the interpreter joins them again
at exit. An environment call that never returns in a worker thread (`asyncio.to_thread`: a verifier stuck in a
loop, a socket read without a timeout) therefore kept `rl` and `eval` from ever exiting after their last step,
although its coroutine had long been cancelled by `environment.timeout`. A thread cannot be stopped from Python:
`run` closes the loop without joining the executor, and the process's main calls `exit_if_stuck` once its own
output is out: running work gets `grace` seconds to finish, and if some thread is still busy it says so and ends
the process with `os._exit` once output is flushed (the only way past the interpreter's own join). When `main`
raises, `run` does that itself, after printing the traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger("arbor.runloop")
T = TypeVar("T")
PREFIX = "arbor-worker"
"""Name prefix of the default executor's threads (`asyncio.to_thread` and `run_in_executor(None, ...)`)."""


def run(main: Coroutine[Any, Any, T], threads: int | None = None, grace: float = 2.0) -> T:
    """`asyncio.run(main)` with a default executor of `threads` workers (None: Python's default size), except
    that closing the loop does not wait for its threads (the caller ends with `exit_if_stuck`); if `main` raises
    and a thread is still busy after `grace` seconds, the process exits with status 1 without it."""
    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=PREFIX)
    loop.set_default_executor(executor)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            cancel_remaining(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # shuts the default executor down without joining its threads
            executor.shutdown(wait=False, cancel_futures=True)
            if sys.exc_info()[1] is not None:
                exit_if_stuck(grace)


def cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    """Cancels the tasks `main` left behind and lets them unwind, as `asyncio.run` does."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def stuck_threads(grace: float) -> list[threading.Thread]:
    """The executor's threads still alive after up to `grace` seconds (idle ones end at once on shutdown)."""
    deadline = time.monotonic() + grace
    threads = [t for t in threading.enumerate() if t.name.startswith(PREFIX)]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def exit_if_stuck(grace: float = 2.0) -> None:
    """Ends the process now (status 0, or 1 while an exception is being handled) if a worker thread is still busy
    after `grace` seconds: the interpreter would wait for it forever."""
    stuck = stuck_threads(grace)
    if not stuck:
        return
    error = sys.exc_info()[1]
    if error is not None:  # os._exit skips the traceback the caller would have printed
        traceback.print_exception(error)
    log.warning(
        "exiting without waiting for %d worker thread(s) still running (%s): work such as an environment "
        "call whose coroutine was cancelled, by its timeout or as the run ended; a thread cannot be",
        len(stuck),
        ", ".join(t.name for t in stuck),
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if error is not None else 0)
