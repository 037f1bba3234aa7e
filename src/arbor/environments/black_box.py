"""black_box: trains an unmodified agent program through the gateway, one gateway session per rollout.

An inner environment (`tasks`) supplies the tasks and the scorer. Each rollout runs the agent (a `command`
subprocess, an in-process `function`, or `remote` agents pulling work from the gateway) against its own session;
its reward is the one it posts, else the inner environment's score of its output. Failed agents are retried,
then dropped and counted; every wait is bounded. The orchestrator calls `run_group(gateway, group, ...)`; what
that needs of them is typed here (`AgentGateway`, `AgentSession`, `AgentGroup`, `AgentSample`), so this module
imports nothing of the orchestrator, which sits above environments.

Details: docs/agents.md, "The black_box environment".
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from arbor.config.environment import EnvironmentConfig
from arbor.config.orchestrator import GatewayConfig
from arbor.environments.guard import reward_components
from arbor.environments.protocol import Task, load_environment, total_reward
from arbor.models.image_parts import wire_parts
from arbor.registry import load_object

log = logging.getLogger("arbor.environments.black_box")


@runtime_checkable
class AgentSample(Protocol):
    """One training sample recorded from an agent's chain of calls (the orchestrator's Rollout)."""

    score_failed: bool
    latency: float | None


@runtime_checkable
class AgentSession(Protocol):
    """One gateway session, one agent run (arbor.orchestrator.gateway.sessions.Session)."""

    id: str
    reward: float | None
    """The reward the agent posted, or None; the environment sets it when it scores the answer itself."""
    components: dict[str, float]

    def rollouts(self, episode_id: int = -1) -> Sequence[AgentSample]:
        """One sample per chain of calls, with the session's reward; `episode_id`: the run's index in its group."""
        ...


@runtime_checkable
class AgentGateway(Protocol):
    """The gateway's session API for in-process users (arbor.orchestrator.gateway.service.Gateway)."""

    cfg: GatewayConfig

    def open(self, session_id: str | None = None, task_id: int | str = -1, group_id: int = -1) -> AgentSession: ...

    async def finish(self, session_id: str, ended: str = "abandoned") -> AgentSession:
        """Closes the session, waits for its calls still generating, forgets it; without a posted reward it is
        counted under `ended`."""
        ...

    def abandon(self, session_id: str) -> None:
        """Forgets a session whose run was cancelled, without waiting for its calls."""
        ...

    def offer(self, session_id: str, task: str) -> None:
        """Queues the session for a remote agent to claim (pull mode)."""
        ...

    async def wait_reward(self, session_id: str, timeout: float) -> bool:
        """Waits for the session's reward POST; False on timeout."""
        ...

    def base_url(self, session_id: str) -> str:
        """The session's OPENAI_BASE_URL."""
        ...

    def reward_url(self, session_id: str) -> str:
        """Where the session's agent POSTs its reward."""
        ...


@runtime_checkable
class AgentGroup(Protocol):
    """The group to run (the orchestrator's GroupSpec): its task and its id."""

    task: Task
    group_id: int


class AgentFailed(Exception):
    """An agent run that failed; `ended` says how (arbor.orchestrator.gateway.sessions.UNREWARDED)."""

    def __init__(self, message: str, ended: str = "agent_failed") -> None:
        super().__init__(message)
        self.ended = ended


class BlackBoxEnv:
    name = "black_box"
    needs_gateway = True

    def __init__(
        self,
        command: list[str] | str | None = None,
        function: str | None = None,
        remote: bool = False,
        tasks: str = "reverse_text",
        task_args: dict[str, Any] | None = None,
        task_input: Literal["argv", "stdin", "env"] = "argv",
        timeout: float = 60.0,
        retries: int = 1,
        max_concurrent_agents: int = 64,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        if (command is not None) + (function is not None) + bool(remote) != 1:
            raise ValueError(
                "black_box: give exactly one of `command` (argv list or string), `function` or `remote = true`"
            )
        if task_input not in ("argv", "stdin", "env"):
            raise ValueError(f"black_box: task_input must be argv, stdin or env, got {task_input!r}")
        if timeout <= 0 or retries < 0 or max_concurrent_agents < 1:
            raise ValueError("black_box: need timeout > 0, retries >= 0, max_concurrent_agents >= 1")
        self.command = shlex.split(command) if isinstance(command, str) else command
        if self.command is not None and self.command[:1] == ["python"]:
            self.command = [sys.executable, *self.command[1:]]  # the orchestrator's interpreter and venv
        self.function = _load_function(function) if function else None
        self.inner = load_environment(EnvironmentConfig(id=tasks, args=task_args or {}))
        self.remote, self.task_input, self.timeout, self.retries = bool(remote), task_input, timeout, retries
        self.extra_env = dict(extra_env or {})
        self._slots = asyncio.Semaphore(max_concurrent_agents)
        # Function agents block in their HTTP calls: a pool as wide as the concurrency keeps them all in flight.
        self._pool = ThreadPoolExecutor(max_concurrent_agents, thread_name_prefix="agent") if function else None
        self.failed = 0
        self.retried = 0

    # -- the Environment protocol, delegated to the inner environment --

    def dataset(self, seed: int) -> list[Task]:
        return self.inner.dataset(seed)

    def prompt(self, task: Task) -> list[dict[str, str]]:
        return self.inner.prompt(task)

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        return await self.inner.score(task, completion)

    def reference(self, task: Task) -> str | None:
        return self.inner.reference(task)

    def task_text(self, task: Task) -> str:
        """The last user message of the inner prompt: its text, or for content parts (images) their JSON list as
        an agent sends them (`image` parts as `image_url` data URLs), for a vision-language model's agent."""
        users = [m["content"] for m in self.inner.prompt(task) if m["role"] == "user"]
        if not users:
            return json.dumps(task)
        return users[-1] if isinstance(users[-1], str) else json.dumps(wire_parts(users[-1]))

    # -- rollouts --

    async def run_group(
        self, gateway: AgentGateway, spec: AgentGroup, group_size: int, weights: dict[str, float], score_timeout: float
    ) -> list[AgentSample]:
        groups = await asyncio.gather(
            *(self._rollout(gateway, spec, weights, score_timeout, k) for k in range(group_size))
        )
        return [r for g in groups for r in g]

    async def _rollout(
        self, gateway: AgentGateway, spec: AgentGroup, weights: dict[str, float], score_timeout: float, episode: int
    ) -> list[AgentSample]:
        text = self.task_text(spec.task)
        for attempt in range(self.retries + 1):
            session = gateway.open(task_id=spec.task.get("id", -1), group_id=spec.group_id)
            t0 = time.monotonic()
            try:
                answer = await self._attempt(gateway, session.id, text)
            except AgentFailed as e:
                await gateway.finish(session.id, e.ended)
                if attempt < self.retries:
                    self.retried += 1
                    log.warning(
                        "agent failed on task %s (%s); retry %d/%d", spec.task.get("id"), e, attempt + 1, self.retries
                    )
                    continue
                self.failed += 1
                log.warning("agent failed on task %s (%s); rollout dropped", spec.task.get("id"), e)
                return []
            session = await gateway.finish(session.id, "scored_by_env")
            failed = False
            if session.reward is None:  # no reward was posted: score the agent's answer
                try:
                    scored = await asyncio.wait_for(self.inner.score(spec.task, answer), score_timeout)
                    session.components = reward_components(scored)
                    session.reward = total_reward(session.components, weights)
                except Exception as e:  # noqa: BLE001 - a failing scorer scores 0 and is counted, as in rollout.py
                    log.warning("scoring task %s failed: %r", spec.task.get("id"), e)
                    session.reward, session.components, failed = 0.0, {}, True
            rollouts = list(session.rollouts(episode))  # a branched session is one episode for advantages
            for r in rollouts:
                r.score_failed, r.latency = failed, time.monotonic() - t0
            return rollouts
        return []

    async def _attempt(self, gateway: AgentGateway, session_id: str, task: str) -> str:
        """One agent run in the session; its answer. A cancelled run (its group cancelled) abandons the session."""
        try:
            if self.remote:
                return await self._remote_agent(gateway, session_id, task)
            async with self._slots:
                return await self._run_agent(
                    task,
                    gateway.base_url(session_id),
                    gateway.cfg.api_key or "none",
                    gateway.reward_url(session_id),
                    session_id,
                )
        except asyncio.CancelledError:
            gateway.abandon(session_id)
            raise

    async def _remote_agent(self, gateway: AgentGateway, session_id: str, task: str) -> str:
        """Pull mode: a remote agent claims the task (POST /v1/work) and must POST the reward in time."""
        gateway.offer(session_id, task)
        if not await gateway.wait_reward(session_id, self.timeout):
            raise AgentFailed(f"no reward posted within {self.timeout:.0f}s", "timed_out")
        return ""

    async def _run_agent(self, task: str, base_url: str, api_key: str, reward_url: str, session_id: str) -> str:
        if self.function is not None:
            try:
                # A thread cannot be killed: the function's own HTTP timeout must end it; we stop waiting.
                call = asyncio.get_running_loop().run_in_executor(self._pool, self.function, task, base_url, api_key)
                return str(await asyncio.wait_for(call, self.timeout)).strip()
            except TimeoutError:
                raise AgentFailed(f"timed out after {self.timeout:.0f}s", "timed_out") from None
            except Exception as e:  # noqa: BLE001 - any agent error is a failed attempt, retried or counted
                raise AgentFailed(repr(e)) from None
        env = {
            **os.environ,
            **self.extra_env,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "ARBOR_REWARD_URL": reward_url,
            "ARBOR_SESSION_ID": session_id,
        }
        argv = list(self.command)
        if self.task_input == "argv":
            argv.append(task)
        elif self.task_input == "env":
            env["ARBOR_TASK"] = task
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        stdin = task.encode() if self.task_input == "stdin" else b""
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), self.timeout)
        except TimeoutError:
            _kill(proc)
            await proc.wait()
            raise AgentFailed(f"timed out after {self.timeout:.0f}s", "timed_out") from None
        except asyncio.CancelledError:
            _kill(proc)
            await asyncio.shield(proc.wait())  # reaped on this loop, before the loop may close (SIGKILLed: quick)
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise AgentFailed(f"exit code {proc.returncode}: {tail[0][:300]}")
        return out.decode(errors="replace").strip()


def _load_function(path: str) -> Any:
    """`module:fn`, or `some/file.py:fn` (a script beside its rl.toml need not be an installed module)."""
    file, sep, attr = path.rpartition(":")
    if sep and file.endswith(".py"):
        if not Path(file).is_file():
            raise ValueError(f"black_box: agent file {file!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"arbor_agent_{Path(file).stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, attr):
            raise ValueError(f"black_box: {file!r} has no function {attr!r}")
        return getattr(module, attr)
    return load_object(path)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """Kills the agent's whole process group (it may have started children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
