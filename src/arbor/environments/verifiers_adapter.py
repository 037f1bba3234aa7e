"""Run a `verifiers` (v0.4, the `verifiers.v1` API) taskset as an arbor environment, as-is.

`[orchestrator.environment] id = "verifiers"`, `args = {env_id = "...", config = {...}}`. Each task becomes an
arbor task, each verifiers reward an arbor reward component (so arbor's sum equals verifiers' `trace.reward`), and
a taskset with toolsets a multi-turn `ToolEnv` whose tools run in-process. verifiers' agentic side (harnesses,
runtimes, remote toolsets, user simulators) is not covered. verifiers is imported lazily: without it, one line
names the extra.

Details: docs/agents.md, "verifiers tasksets".
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

from arbor.environments.multiturn import ToolEnv, ToolState
from arbor.environments.protocol import Task
from arbor.registry import load_object
from arbor.tool_calls import parse_tool_calls

INSTALL_HINT = "the verifiers adapter needs the optional extra: uv sync --extra verifiers"


def _vf() -> Any:
    try:  # optional: the `verifiers` extra
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vf


class VerifiersEnv:
    """A single-turn verifiers taskset (built by `load_verifiers_env`)."""

    def __init__(self, taskset: Any, env_id: str, max_tasks: int | None = None, name: str | None = None) -> None:
        self.vf = _vf()
        self.taskset = taskset
        if not self.taskset.bounded and max_tasks is None:
            raise ValueError(f"verifiers taskset {env_id!r} is infinite: set args.max_tasks")
        self.max_tasks = max_tasks
        self.task_type = type(self.taskset).task_type()
        self.name = name or env_id.rsplit(":", 1)[-1]
        self._tasks: dict[int, Any] = {}  # idx -> the verifiers Task that `dataset` yielded

    def dataset(self, seed: int) -> list[Task]:
        view = self.taskset if self.max_tasks is None else self.taskset.take(self.max_tasks)
        tasks = []
        for vf_task in view:
            idx = vf_task.data.idx
            self._tasks[idx] = vf_task
            tasks.append({"id": idx, "data": vf_task.data.model_dump(mode="json")})
        return tasks

    def _vf_task(self, task: Task) -> Any:
        if task["id"] not in self._tasks:  # a task built by another instance: rebuild it from its data
            data = self.task_type.data_type().model_validate(task["data"])
            self._tasks[task["id"]] = self.task_type(data, self.taskset.config.task)
        return self._tasks[task["id"]]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        data = self._vf_task(task).data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return messages + [{"role": "user", "content": data.prompt}]
        from verifiers.v1.types import content_text  # the optional `verifiers` extra, loaded with the taskset

        if bad := [m.role for m in data.prompt or [] if m.role not in ("system", "user", "assistant")]:
            raise ValueError(f"verifiers task {task['id']}: prompt roles {bad} (tool calls) are not supported here")
        return messages + [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]

    def _trace(self, vf_task: Any, messages: list[dict[str, Any]]) -> Any:
        """A verifiers trace of `messages`: one chain of nodes; assistant turns are the sampled ones, with their
        `<tool_call>` blocks as verifiers tool calls whose ids the following tool results answer."""
        vf = self.vf
        from verifiers.v1.state import state_cls  # the optional `verifiers` extra, loaded with the taskset

        nodes, pending = [], []
        for i, m in enumerate(messages):
            role, content = m["role"], m.get("content") or ""
            if role == "assistant":
                calls, _ = parse_tool_calls(content)
                tool_calls = [
                    vf.ToolCall(id=f"call_{i}_{j}", name=c.name, arguments=json.dumps(c.arguments))
                    for j, c in enumerate(calls)
                ] or None
                pending = [c.id for c in tool_calls or []]
                message = vf.AssistantMessage(content=content, tool_calls=tool_calls)
            elif role == "tool":
                message = vf.ToolMessage(content=content, tool_call_id=pending.pop(0) if pending else f"call_{i}")
            elif role in ("system", "user"):
                message = (vf.SystemMessage if role == "system" else vf.UserMessage)(content=content)
            else:
                raise ValueError(f"verifiers adapter: message role {role!r} has no verifiers counterpart")
            nodes.append(vf.MessageNode(message=message, parent=i - 1 if i else None, sampled=role == "assistant"))
        return vf.Trace(
            task=vf.TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
            state=state_cls(type(vf_task))(),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="arbor"),
            nodes=nodes,
            is_completed=True,
            ok=True,
        )

    async def _rewards(self, task: Task, messages: list[dict[str, Any]]) -> dict[str, float]:
        vf_task = self._vf_task(task)
        trace = self._trace(vf_task, messages)
        await vf_task.score(trace)
        return {name: (r.value if r is not None else 0.0) for name, r in trace.rewards.items()}

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        return await self._rewards(task, self.prompt(task) + [{"role": "assistant", "content": completion}])

    def reference(self, task: Task) -> str | None:
        answer = getattr(self._vf_task(task).data, "answer", None)
        return answer if isinstance(answer, str) else None


class VerifiersToolEnv(VerifiersEnv, ToolEnv):
    """A verifiers taskset with toolsets, as an arbor multi-turn tool environment."""

    def __init__(
        self,
        taskset: Any,
        env_id: str,
        max_tasks: int | None = None,
        name: str | None = None,
        max_turns: int = 6,
        tool_timeout: float = 10.0,
    ) -> None:
        super().__init__(taskset, env_id, max_tasks, name)
        self.max_turns, self.tool_timeout = max_turns, tool_timeout
        self._tools = tool_functions(self.vf, toolsets_of(self.taskset))

    def tools(self, task: Task) -> list[Callable[..., Any]]:
        return self._tools

    async def score_episode(self, task: Task, state: ToolState, messages: list[dict[str, Any]]) -> dict[str, float]:
        return await self._rewards(task, messages)

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        return await VerifiersEnv.score(self, task, completion)


def toolsets_of(taskset: Any) -> list[Any]:
    """The toolsets a taskset declares for all its tasks and for its task type."""
    return [*type(taskset).toolsets(taskset.config), *type(taskset).task_type().toolsets(taskset.config.task)]


def tool_functions(vf: Any, toolsets: list[Any]) -> list[Callable[..., Any]]:
    """The toolsets' `@vf.tool` methods as plain functions named as the model calls them."""
    from verifiers.v1.utils.decorators import (
        discover_decorated,
    )  # the optional `verifiers` extra, loaded with the taskset

    fns = []
    for toolset in toolsets:
        if toolset.config.url:
            raise ValueError(
                f"verifiers toolset {type(toolset).__name__} is served remotely ({toolset.config.url}): "
                "the adapter runs tools in-process only"
            )
        for method in discover_decorated(toolset, "tool"):
            fns.append(_as_tool(method, getattr(method, "tool_name", None) or method.__name__))
    names = [fn.__name__ for fn in fns]
    if len(set(names)) != len(names):
        raise ValueError(f"verifiers toolsets define a tool name twice: {sorted(names)}")
    return fns


def load_taskset(vf: Any, env_id: str, config: dict[str, Any]) -> Any:
    """A taskset by verifiers id (its own loader) or by dotted path (a Taskset subclass, factory or instance)."""
    if ":" not in env_id:  # verifiers ids may hold dots (`name@0.1.0`); dotted paths here need the colon
        cfg_type = vf.taskset_config_type(env_id)
        return vf.load_taskset(cfg_type.model_validate({**config, "id": env_id}))
    obj = load_object(env_id)
    if isinstance(obj, type) and issubclass(obj, vf.Taskset):
        from verifiers.v1.utils.generic import concrete_type  # the optional `verifiers` extra, loaded with the taskset

        cfg_type = concrete_type(obj, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        obj = obj(cfg_type.model_validate(config))
    elif callable(obj) and not isinstance(obj, vf.Taskset):
        obj = obj(**config)
    if not isinstance(obj, vf.Taskset):
        raise TypeError(f"{env_id!r} is not a verifiers Taskset (subclass, factory or instance): {type(obj)}")
    return obj


def _as_tool(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A function named `name` with the method's signature, docstring and type hints (the tool schema); async
    when the method is, so that sync tools keep running in a thread."""
    if inspect.iscoroutinefunction(method):

        async def tool(**kwargs: Any) -> Any:
            return await method(**kwargs)
    else:

        def tool(**kwargs: Any) -> Any:
            return method(**kwargs)

    functools.update_wrapper(tool, method)
    tool.__name__ = tool.__qualname__ = name
    return tool


def load_verifiers_env(
    env_id: str,
    config: dict[str, Any] | None = None,
    max_tasks: int | None = None,
    name: str | None = None,
    max_turns: int = 6,
    tool_timeout: float = 10.0,
) -> VerifiersEnv:
    """The `verifiers` built-in: a multi-turn tool environment when the taskset declares toolsets, else single
    turn (where `max_turns` and `tool_timeout` do not apply)."""
    taskset = load_taskset(_vf(), env_id, dict(config or {}))
    if toolsets_of(taskset):
        return VerifiersToolEnv(taskset, env_id, max_tasks, name, max_turns, tool_timeout)
    return VerifiersEnv(taskset, env_id, max_tasks, name)


def is_available() -> bool:
    """Whether the verifiers extra is installed (for preflight and tests)."""
    try:
        _vf()
    except ImportError:
        return False
    return True
