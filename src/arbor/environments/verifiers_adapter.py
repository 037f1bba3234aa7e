"""Run a `verifiers` (v0.4, the `verifiers.v1` API) taskset as an arbor environment, as-is.

`[orchestrator.environment] id = "verifiers"`, `args = {env_id = "...", config = {...}}`: `env_id` is a verifiers
taskset id (an installed taskset package, as `vf eval <id>` takes it, loaded with verifiers' own
`load_taskset`) or a dotted path `package.module:attr` to a `Taskset` subclass, a factory returning a taskset, or
a taskset instance (the colon is required); `config` holds the taskset's config fields (its `TasksetConfig` subclass).

The mapping: each task the taskset yields is one arbor task (its `TaskData` dumped as JSON under "data"); the
prompt is the task's `system_prompt` plus its `prompt` (a string becomes one user message, a message list is
kept, text parts joined); scoring builds a verifiers `Trace` of those messages and the completion as the sampled
assistant reply, and awaits the task's own `score(trace)`, so its `@vf.reward` methods and config-plugged reward
functions run unchanged. Each reward becomes one arbor component, valued `score x weight` (verifiers'
`Reward.value`) so that arbor's default sum equals verifiers' `trace.reward`; a reward that failed (None) is 0.
`reference` is the task data's `answer` field when it is a string.

Not covered (verifiers' agentic side): harnesses, toolsets and runtimes (multi-turn agents run as programs in a
box; arbor trains those through its gateway, not this adapter), rewards that require a `runtime` (skipped,
verifiers logs which), `@vf.metric`s (recorded by verifiers, not summed, so not reward components here) and
infinite tasksets beyond `max_tasks`. verifiers is imported lazily: without it, one line names the extra.
"""

from __future__ import annotations

from typing import Any

from arbor.environments.base import Task, load_object

INSTALL_HINT = "the verifiers adapter needs the optional extra: uv sync --extra verifiers"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vf


class VerifiersEnv:
    def __init__(self, env_id: str, config: dict[str, Any] | None = None, max_tasks: int | None = None,
                 name: str | None = None) -> None:
        self.vf = _vf()
        self.taskset = self._load_taskset(env_id, dict(config or {}))
        if not self.taskset.bounded and max_tasks is None:
            raise ValueError(f"verifiers taskset {env_id!r} is infinite: set args.max_tasks")
        self.max_tasks = max_tasks
        self.task_type = type(self.taskset).task_type()
        self.name = name or env_id.rsplit(":", 1)[-1]
        self._tasks: dict[int, Any] = {}  # idx -> the verifiers Task that `dataset` yielded

    def _load_taskset(self, env_id: str, config: dict[str, Any]) -> Any:
        vf = self.vf
        if ":" not in env_id:  # verifiers ids may hold dots (`name@0.1.0`); dotted paths here need the colon
            cfg_type = vf.taskset_config_type(env_id)
            return vf.load_taskset(cfg_type.model_validate({**config, "id": env_id}))
        obj = load_object(env_id)
        if isinstance(obj, type) and issubclass(obj, vf.Taskset):
            from verifiers.v1.utils.generic import concrete_type

            cfg_type = concrete_type(obj, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            obj = obj(cfg_type.model_validate(config))
        elif callable(obj) and not isinstance(obj, vf.Taskset):
            obj = obj(**config)
        if not isinstance(obj, vf.Taskset):
            raise TypeError(f"{env_id!r} is not a verifiers Taskset (subclass, factory or instance): {type(obj)}")
        return obj

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
        from verifiers.v1.types import content_text

        if bad := [m.role for m in data.prompt or [] if m.role not in ("system", "user", "assistant")]:
            raise ValueError(f"verifiers task {task['id']}: prompt roles {bad} (tool calls) are not supported here")
        return messages + [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]

    def _trace(self, vf_task: Any, messages: list[dict[str, str]], completion: str) -> Any:
        vf = self.vf
        from verifiers.v1.state import state_cls

        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        nodes = [vf.MessageNode(message=kinds[m["role"]](content=m["content"]), parent=i - 1 if i else None)
                 for i, m in enumerate(messages)]
        nodes.append(vf.MessageNode(message=vf.AssistantMessage(content=completion), sampled=True,
                                    parent=len(nodes) - 1 if nodes else None))
        return vf.Trace(
            task=vf.TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
            state=state_cls(type(vf_task))(),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="arbor"),
            nodes=nodes, is_completed=True, ok=True)

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        vf_task = self._vf_task(task)
        trace = self._trace(vf_task, self.prompt(task), completion)
        await vf_task.score(trace)
        return {name: (r.value if r is not None else 0.0) for name, r in trace.rewards.items()}

    def reference(self, task: Task) -> str | None:
        answer = getattr(self._vf_task(task).data, "answer", None)
        return answer if isinstance(answer, str) else None


def is_available() -> bool:
    """Whether the verifiers extra is installed (for preflight and tests)."""
    try:
        _vf()
    except ImportError:
        return False
    return True


