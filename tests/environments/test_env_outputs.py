"""What environments answer is checked before it reaches advantages: reward components that are not finite numbers
by name, or a step answer that is not a StepResult, fail the call at once (one line naming the call and the value),
and training, multi-turn episodes and eval score such a rollout 0 and count it instead of crashing or training
on NaN."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from test_multiturn import TOK, Scripted

from arbor.config.environment import EnvironmentConfig
from arbor.config.eval import EvalSettings
from arbor.config.orchestrator import OrchestratorConfig
from arbor.environments import NoTaskFits, StepResult
from arbor.environments.guard import BadOutput, EnvFailure, EnvStats, guarded, reward_components, step_result
from arbor.environments.multiturn import ToolEnv
from arbor.environments.reverse_text import ReverseTextEnv
from arbor.orchestrator.client import Completion
from arbor.orchestrator.episode import EpisodeSettings, EpisodeStats, run_group_episodes
from arbor.orchestrator.evaluator import evaluate
from arbor.orchestrator.group import GroupSpec, generate_group
from arbor.orchestrator.main import slice_config
from arbor.orchestrator.state import OrchestratorState
from arbor.orchestrator.tasks import TaskSource

BAD_COMPONENTS = [
    None,
    1.0,
    "1",
    [1.0],
    {"r": math.nan},
    {"r": math.inf},
    {"r": "1"},
    {"r": None},
    {1: 1.0},
    {"r": [1.0]},
    {"r": torch.ones(2)},
]


def test_reward_components_take_numbers_of_any_kind_and_refuse_what_would_poison_advantages():
    ok = reward_components({"a": 1, "b": True, "c": np.float32(0.5), "d": torch.tensor(2.0), "e": np.int64(3)})
    assert ok == {"a": 1.0, "b": 1.0, "c": 0.5, "d": 2.0, "e": 3.0} and all(type(v) is float for v in ok.values())
    assert reward_components({}) == {}
    for bad in BAD_COMPONENTS:
        with pytest.raises(BadOutput) as e:
            reward_components(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(BadOutput, match="reward component 'r' is nan, not a finite number"):
        reward_components({"r": math.nan})
    assert step_result(StepResult([{"role": "tool", "content": "3"}], reward=np.float64(0.5))).reward == 0.5
    for bad in (
        None,
        {"messages": []},
        StepResult("not a list"),
        StepResult([{"content": "x"}]),
        StepResult([], reward=math.nan),
    ):
        with pytest.raises(BadOutput):
            step_result(bad)


def test_a_bad_answer_fails_at_once_naming_the_call_and_is_not_retried():
    calls = []

    async def score(task, text):
        calls.append(text)
        return {"r": math.nan}

    with pytest.raises(EnvFailure, match=r"^scoring task 3 reward component 'r' is nan, not a finite number$"):
        asyncio.run(guarded("scoring task 3", score, {}, "x", timeout=1, retries=3, check=reward_components))
    assert calls == ["x"]


class Poisoned(ReverseTextEnv):
    """reverse_text whose scorer answers NaN for task 1, a string for task 2 and raises for task 3."""

    async def score(self, task, completion):
        answer = {1: {"r": math.nan}, 2: "1.0"}.get(task["id"])
        if task["id"] == 3:
            raise ZeroDivisionError("verifier crashed")
        return answer if answer is not None else await super().score(task, completion)


async def _reversed(prompt_ids, n, max_tokens, temperature, top_p, seed=None):
    text = TOK.decode(prompt_ids)
    return [Completion([65, TOK.eos_token_id], [0.0, 0.0], [0, 0], text[::-1][:4], "stop") for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("on_failure", ["score_zero", "skip"])
def test_training_rollouts_of_a_poisoned_scorer_score_0_or_are_skipped_and_counted(on_failure):
    env, stats = Poisoned(), EnvStats()
    cfg = EnvironmentConfig(retries=1, timeout=5, on_failure=on_failure)
    for task_id in (0, 1, 2, 3):
        spec = GroupSpec({**env.dataset(0)[0], "id": task_id}, [1, 2], seed=0)
        out = asyncio.run(
            generate_group(None, env, spec, 2, 4, 1.0, 1.0, {}, 5.0, generate=_reversed, env_cfg=cfg, stats=stats)
        )
        if task_id == 0:
            assert len(out) == 2 and all(math.isfinite(r.reward) and not r.score_failed for r in out)
        elif on_failure == "skip":
            assert out == []
        else:
            assert [(r.reward, r.score_failed) for r in out] == [(0.0, True)] * 2
    counted = stats.skipped if on_failure == "skip" else stats.failed
    assert counted == 6 and stats.retries == 2  # only the raising scorer was retried


class GarbledSteps(ToolEnv):
    """A tool environment whose step answers None (a forgotten return) and whose score is fine."""

    name, max_turns = "garbled", 3

    def dataset(self, seed):
        return [{"id": 0}]

    def prompt(self, task):
        return [{"role": "user", "content": "go"}]

    def tools(self, task):
        return []

    async def step(self, task, state, messages):
        return None

    async def score_episode(self, task, state, messages):
        return {"r": 1.0}


def test_a_step_answering_garbage_fails_its_episode_not_the_run():
    stats = EpisodeStats()
    settings = EpisodeSettings(max_tokens=16, temperature=1.0, top_p=1.0, seq_len=512, env=EnvironmentConfig())
    out = asyncio.run(
        run_group_episodes(Scripted("a", "b"), GarbledSteps(), {"id": 0}, TOK, settings, 2, seed=0, stats=stats)
    )
    assert len(out) == 2 and all(r.score_failed and r.reward == 0.0 for r in out)
    assert stats.failed == 2 and stats.finished == {"env_failed": 2}


def poisoned(**args):
    return Poisoned(**args)


class Hangs(ReverseTextEnv):
    async def score(self, task, completion):
        if task["id"] % 2:
            await asyncio.sleep(3600)
        return await super().score(task, completion)


def hangs(**args):
    return Hangs(**args)


def test_eval_counts_failing_scorers_as_0_and_finishes():
    envs = [
        {"id": "test_env_outputs:poisoned", "args": {"min_len": 3, "max_len": 3}, "retries": 0},
        {"id": "test_env_outputs:hangs", "args": {"min_len": 3, "max_len": 3}, "timeout": 0.2, "retries": 1},
    ]
    cfg = EvalSettings(num_tasks=4, k=2, environments=envs)
    figures = asyncio.run(asyncio.wait_for(evaluate(_reversed, TOK, cfg), 30))
    assert figures["eval/poisoned/failed"] == 6  # tasks 1, 2 and 3, two samples each
    assert figures["eval/hangs/failed"] == 4  # tasks 1 and 3
    assert all(math.isfinite(v) for v in figures.values())


class BadPrompts(ReverseTextEnv):
    """reverse_text whose prompt raises for every third task and returns None for the next."""

    def prompt(self, task):
        if task["id"] % 3 == 1:
            raise KeyError("a template field is missing")
        return None if task["id"] % 3 == 2 else super().prompt(task)


def bad_prompts(**args):
    return BadPrompts(**args)


class NoPrompts(ReverseTextEnv):
    def prompt(self, task):
        raise KeyError("a template field is missing")


def test_tasks_whose_prompt_cannot_be_built_are_skipped_and_counted_in_training_and_eval():
    cfg = OrchestratorConfig(environment={"id": "test_env_outputs:bad_prompts"})
    settings = slice_config(cfg).tasks
    source = TaskSource(settings, BadPrompts(num_tasks=30), TOK, OrchestratorState())
    specs = [source.next_spec(0, k) for k in range(10)]
    assert all(s.task["id"] % 3 == 0 and s.prompt_ids for s in specs)
    assert source.skipped_bad >= 10  # about two skipped per launch
    with pytest.raises(NoTaskFits, match=r"no prompt of environment 'reverse_text' could be built \(task 0: KeyError"):
        TaskSource(settings, NoPrompts(num_tasks=5), TOK, OrchestratorState())
    envs = [{"id": "test_env_outputs:bad_prompts", "args": {"min_len": 3, "max_len": 3}}]
    figures = asyncio.run(evaluate(_reversed, TOK, EvalSettings(num_tasks=6, k=2, environments=envs)))
    assert figures["eval/bad_prompts/failed"] == 8  # tasks 1, 2, 4 and 5
