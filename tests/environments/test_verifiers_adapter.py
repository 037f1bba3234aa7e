"""The verifiers adapter: a small verifiers (v1 API) taskset defined here, in memory, runs as an arbor environment."""

import asyncio
import builtins
import importlib
import sys

import pytest

from arbor.config.environment import EnvironmentConfig
from arbor.environments.protocol import Environment, load_environment

vf = pytest.importorskip("verifiers.v1")


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply) <= 3)

    @vf.reward
    async def parts(self, task, trace) -> dict:  # keyed scores: one component per key
        return {
            "has_digit": float(any(c.isdigit() for c in trace.last_reply)),
            "saw_prompt": float(trace.messages[-2].content == task.prompt_text),
        }

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 5


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield SumTask(
                SumData(prompt=f"{i} + {i} =", answer=str(2 * i), system_prompt="Answer with a number."),
                self.config.task,
            )


class ChatTaskset(vf.Taskset[SumTask]):
    def load(self):
        yield SumTask(
            SumData(
                prompt=[
                    vf.UserMessage(content="1 + 1 ="),
                    vf.AssistantMessage(content="2"),
                    vf.UserMessage(content="and 2 + 2 ="),
                ],
                answer="4",
            ),
            self.config.task,
        )


def make_sum_taskset(num_tasks: int = 3):
    return SumTaskset(SumConfig(num_tasks=num_tasks))


def test_single_turn_taskset_as_arbor_environment():
    env = load_environment(
        EnvironmentConfig(
            id="verifiers", args={"env_id": "test_verifiers_adapter:SumTaskset", "config": {"num_tasks": 4}}
        )
    )
    assert isinstance(env, Environment)
    tasks = env.dataset(0)
    assert [t["id"] for t in tasks] == [0, 1, 2, 3]
    assert env.prompt(tasks[2]) == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2 + 2 ="},
    ]
    assert env.reference(tasks[2]) == "4"
    right = asyncio.run(env.score(tasks[2], "4"))
    assert right == {"correct": 1.0, "brief": 0.5, "has_digit": 1.0, "saw_prompt": 1.0}
    wrong = asyncio.run(env.score(tasks[2], "five or so"))
    assert wrong == {"correct": 0.0, "brief": 0.0, "has_digit": 0.0, "saw_prompt": 1.0}


def test_factory_chat_prompt_and_rebuilt_tasks():
    env = load_environment(EnvironmentConfig(id="verifiers", args={"env_id": "test_verifiers_adapter:ChatTaskset"}))
    (task,) = env.dataset(0)
    assert [m["role"] for m in env.prompt(task)] == ["user", "assistant", "user"]
    assert asyncio.run(env.score(task, "4"))["correct"] == 1.0
    # Another instance (e.g. an eval process) scores a task from its data alone.
    other = load_environment(
        EnvironmentConfig(
            id="verifiers",
            args={"env_id": "test_verifiers_adapter:make_sum_taskset", "config": {"num_tasks": 2}, "max_tasks": 1},
        )
    )
    assert len(other.dataset(0)) == 1
    fresh = load_environment(
        EnvironmentConfig(id="verifiers", args={"env_id": "test_verifiers_adapter:make_sum_taskset"})
    )
    assert asyncio.run(fresh.score(other.dataset(0)[0], "0"))["correct"] == 1.0


@pytest.mark.slow
def test_installed_taskset_id_loads_through_verifiers(monkeypatch):
    """A bare id goes through verifiers' own loader (an installed package exporting its Taskset via __all__)."""
    module = type(sys)("arbor_test_sum_taskset")
    module.SumTaskset, module.__all__ = SumTaskset, ["SumTaskset"]
    monkeypatch.setitem(sys.modules, "arbor_test_sum_taskset", module)
    env = load_environment(
        EnvironmentConfig(id="verifiers", args={"env_id": "arbor_test_sum_taskset", "config": {"num_tasks": 2}})
    )
    assert len(env.dataset(0)) == 2 and env.name == "arbor_test_sum_taskset"
    assert asyncio.run(env.score(env.dataset(0)[1], "2"))["correct"] == 1.0


def not_a_taskset():
    return [{"prompt": "1 + 1 ="}]


def test_not_a_taskset_is_one_clear_error():
    with pytest.raises(TypeError, match="not a verifiers Taskset"):
        load_environment(EnvironmentConfig(id="verifiers", args={"env_id": "test_verifiers_adapter:not_a_taskset"}))


def test_missing_extra_names_it(monkeypatch):
    real_import = builtins.__import__

    def no_verifiers(name, *args, **kwargs):
        if name == "verifiers" or name.startswith("verifiers."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_verifiers)
    for mod in [m for m in sys.modules if m == "verifiers" or m.startswith("verifiers.")]:
        monkeypatch.delitem(sys.modules, mod)
    adapter = importlib.import_module("arbor.environments.verifiers_adapter")  # imports without verifiers
    assert not adapter.is_available()
    with pytest.raises(ImportError, match="uv sync --extra verifiers"):
        adapter.load_verifiers_env("anything")
    from arbor.launch import preflight

    monkeypatch.setattr(preflight, "_importable", lambda module: module != "verifiers")
    with pytest.raises(preflight.PreflightError, match="uv sync --extra verifiers"):
        preflight.check_environment("verifiers")


# --- multi-turn: a taskset with a toolset runs as an arbor tool environment ----------------------------------


class CalcToolset(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first addend
            b: the second addend
        """
        return a + b

    @vf.tool(name="negate")
    def neg(self, x: int) -> int:
        """Negate an integer."""
        return -x


class CalcTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.1)
    async def used_tools(self, trace) -> float:
        calls = [c for m in trace.assistant_messages for c in (m.tool_calls or [])]
        answered = {m.tool_call_id for m in trace.tool_messages}
        return float(bool(calls) and all(c.id in answered for c in calls))


class CalcTaskset(vf.Taskset[CalcTask]):
    def load(self):
        yield CalcTask(SumData(prompt="What is 20 + 22? Use the tools.", answer="42"), self.config.task)


def test_toolset_taskset_is_a_multi_turn_tool_environment():
    from arbor.environments.protocol import MultiTurnEnvironment, is_multi_turn
    from arbor.environments.tools import tool_schema

    env = load_environment(
        EnvironmentConfig(id="verifiers", args={"env_id": "test_verifiers_adapter:CalcTaskset", "max_turns": 3})
    )
    assert is_multi_turn(env) and isinstance(env, MultiTurnEnvironment) and env.max_turns == 3
    single = load_environment(EnvironmentConfig(id="verifiers", args={"env_id": "test_verifiers_adapter:SumTaskset"}))
    assert not is_multi_turn(single)
    (task,) = env.dataset(0)
    schemas = {s["function"]["name"]: s["function"] for s in map(tool_schema, env.tools(task))}
    assert set(schemas) == {"add", "negate"}
    assert schemas["add"]["parameters"]["required"] == ["a", "b"]
    assert schemas["add"]["parameters"]["properties"]["a"]["type"] == "integer"

    async def episode():
        state = await env.setup(task)
        messages = env.prompt(task)
        turns = [
            '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>',
            '<tool_call>\n{"name": "negate", "arguments": {"x": 5}}\n</tool_call>',
            "42",
        ]
        results = []
        for text in turns:
            messages.append({"role": "assistant", "content": text})
            step = await env.step(task, state, messages)
            messages += step.messages
            results.append((step.done, [m["content"] for m in step.messages]))
        return results, await env.score_episode(task, state, messages)

    results, scores = asyncio.run(episode())
    assert results == [(False, ["42"]), (False, ["-5"]), (True, [])]
    assert scores == {"correct": 1.0, "used_tools": 0.1}
    assert asyncio.run(env.score(task, "41")) == {"correct": 0.0, "used_tools": 0.0}  # single-turn fallback


def test_toolset_taskset_runs_through_the_episode_driver():
    """The orchestrator's multi-turn driver (token-exact turns) plays the verifiers task; its rewards score it."""
    from arbor.models.tokenizer import ByteTokenizer
    from arbor.orchestrator.client import Completion
    from arbor.orchestrator.episode import EpisodeSettings, run_episode

    tok = ByteTokenizer()
    texts = ['<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>', "42"]

    async def generate(prompt_ids, n, max_tokens, temperature, top_p, seed=None):
        ids = tok.encode(texts.pop(0)) + [tok.eos_token_id]
        return [Completion(ids, [-0.5] * len(ids), [1] * len(ids), tok.decode(ids), "stop")]

    env = load_environment(EnvironmentConfig(id="verifiers", args={"env_id": "test_verifiers_adapter:CalcTaskset"}))
    settings = EpisodeSettings(max_tokens=128, temperature=1.0, top_p=1.0, seq_len=2048, env=EnvironmentConfig())
    (r,) = asyncio.run(run_episode(generate, env, env.dataset(0)[0], tok, settings))
    assert r.components == {"correct": 1.0, "used_tools": pytest.approx(0.1)} and not r.score_failed
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(
        [t for t, m in zip(r.completion_ids, r.completion_mask) if m == 0]
    )
