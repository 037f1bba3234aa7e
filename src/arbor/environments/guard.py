"""The failure policy of environment calls: a per-call timeout, retries with backoff, and counters.

Every call the orchestrator makes into an environment (single-turn `score`, an episode's `setup`, `step` and
`score_episode`) goes through `guarded`: it is cancelled after `timeout` seconds, retried up to `retries` times
(with 0.1 s, 0.2 s, ... of backoff), and then raises `EnvFailure`, which the caller turns into a rollout scored 0
or a skipped one (`[orchestrator.environment] on_failure`). `EnvStats` counts all of it for the step metrics
(`env/retries`, `env/failed`, `env/skipped`, `env/timeouts`), so a flaky environment is visible, never silent.

What a call returns is checked too (`check`: `reward_components`, `step_result`): reward components that are not
finite numbers by name (a NaN from a scorer's 0/0, a string, None) or a step answer that is not a StepResult would
otherwise poison a whole group's advantages or crash the orchestrator. Such an answer is a failure like an
exception, reported in one line that names the call and the value, but not retried: the same arguments would give
the same answer, and a multi-turn step may already have changed its state.

A blocking (non-async) call cannot be cancelled by a timeout; environments must keep blocking work in threads
or subprocesses (`asyncio.to_thread`), as the built-ins do. One that does not is named in the orchestrator's log
while it blocks, and counted in `time/loop_blocked` (arbor.loopwatch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from arbor.environments.protocol import StepResult

log = logging.getLogger("arbor.environments")


class EnvFailure(RuntimeError):
    """An environment call that failed after all its retries."""


class BadOutput(ValueError):
    """An environment call answered with something the orchestrator cannot use."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _number(value: Any, name: str) -> float:
    """`value` as a finite float (ints, bools, numpy and 0-d tensor scalars included), else BadOutput naming it."""
    try:
        x = float(value) if not isinstance(value, (str, bytes)) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise BadOutput(f"{name} is {_shown(value)}, not a finite number")
    return x


def reward_components(value: Any) -> dict[str, float]:
    """`score`'s or `score_episode`'s answer as reward components: a dict of finite numbers by name."""
    if not isinstance(value, dict):
        raise BadOutput(f"returned {_shown(value)}, not a dict of reward components {{name: number}}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise BadOutput(f"returned a reward component named {_shown(k)}, not a string")
        out[k] = _number(v, f"reward component {k!r}")
    return out


def step_result(value: Any) -> StepResult:
    """`step`'s answer: a StepResult whose messages are role dicts and whose reward, if any, is a finite number."""
    if not isinstance(value, StepResult):
        raise BadOutput(f"returned {_shown(value)}, not an arbor.environments.StepResult")
    if not isinstance(value.messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value.messages
    ):
        raise BadOutput(f"returned StepResult.messages {_shown(value.messages)}, not a list of {{role, content}} dicts")
    if value.reward is not None:
        value.reward = _number(value.reward, "StepResult.reward")
    return value


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
    check: Callable[[Any], Any] | None = None,
) -> Any:
    """`await fn(*args)` under the timeout and retry policy, its answer passed through `check`; raises EnvFailure
    naming `what` at the end, or at once for an answer `check` refuses."""
    last: BaseException | None = None
    for attempt in range(retries + 1):
        try:
            value = await asyncio.wait_for(fn(*args), timeout)
        except TimeoutError as e:
            last = e
            if stats is not None:
                stats.timeouts += 1
            reason = f"timed out after {timeout:g}s"
        except Exception as e:  # noqa: BLE001 - any environment error is retried, then reported as EnvFailure
            last = e
            reason = repr(e)
        else:
            try:
                return value if check is None else check(value)
            except BadOutput as e:
                raise EnvFailure(f"{what} {e}") from None
        if attempt < retries:
            if stats is not None:
                stats.retries += 1
            log.warning("%s failed (%s); retry %d/%d", what, reason, attempt + 1, retries)
            await asyncio.sleep(0.1 * 2**attempt)
    raise EnvFailure(f"{what} failed after {retries + 1} attempts: {last!r}") from last
