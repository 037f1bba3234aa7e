"""The failure policy of environment calls: a per-call timeout, retries with backoff, and counters.

Every call the orchestrator makes into an environment (single-turn `score`, an episode's `setup`, `step` and
`score_episode`) goes through `guarded`: it is cancelled after `timeout` seconds, retried up to `retries` times
(with 0.1 s, 0.2 s, ... of backoff), and then raises `EnvFailure`, which the caller turns into a rollout scored 0
or a skipped one (`[orchestrator.environment] on_failure`). `EnvStats` counts all of it for the step metrics
(`env/retries`, `env/failed`, `env/skipped`, `env/timeouts`), so a flaky environment is visible, never silent.

A blocking (non-async) call cannot be cancelled by a timeout; environments must keep blocking work in threads
or subprocesses (`asyncio.to_thread`), as the built-ins do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger("arbor.environments")


class EnvFailure(RuntimeError):
    """An environment call that failed after all its retries."""


@dataclasses.dataclass
class EnvStats:
    retries: int = 0
    timeouts: int = 0
    failed: int = 0
    """Rollouts scored 0 because the environment failed."""
    skipped: int = 0
    """Rollouts dropped because the environment failed (on_failure = "skip")."""

    def figures(self) -> dict[str, int]:
        return {f"env/{k}": v for k, v in dataclasses.asdict(self).items()}


async def guarded(
    what: str,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    timeout: float,
    retries: int,
    stats: EnvStats | None = None,
) -> Any:
    """`await fn(*args)` under the timeout and retry policy; raises EnvFailure naming `what` at the end."""
    last: BaseException | None = None
    for attempt in range(retries + 1):
        try:
            return await asyncio.wait_for(fn(*args), timeout)
        except asyncio.TimeoutError as e:
            last = e
            if stats is not None:
                stats.timeouts += 1
            reason = f"timed out after {timeout:g}s"
        except Exception as e:  # noqa: BLE001 - any environment error is retried, then reported as EnvFailure
            last = e
            reason = repr(e)
        if attempt < retries:
            if stats is not None:
                stats.retries += 1
            log.warning("%s failed (%s); retry %d/%d", what, reason, attempt + 1, retries)
            await asyncio.sleep(0.1 * 2**attempt)
    raise EnvFailure(f"{what} failed after {retries + 1} attempts: {last!r}") from last
