"""Multi-turn environments without a server: the episode driver with a scripted generate function, the failure
policy (timeout, retry, skip, all counted), context management, and the math / tool_use built-ins."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

from arbor.config.environment import ContextConfig, EnvironmentConfig
from arbor.config.orchestrator import AdvantageConfig
from arbor.environments import StepResult, is_multi_turn, load_environment
from arbor.environments.context import SUMMARY_HEADER, ContextPolicy, extractive_summary
from arbor.environments.guard import EnvFailure, EnvStats, guarded
from arbor.environments.math_problems import MathEnv, extract_answer, is_correct, parse_number
from arbor.environments.multiturn import ToolEnv
from arbor.environments.tool_use import BM25, CalculatorError, ToolUseEnv, calculator
from arbor.models.tokenizer import ByteTokenizer
from arbor.orchestrator.advantages import compute_advantages
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.client import Completion
from arbor.orchestrator.episode import EpisodeSettings, EpisodeStats, run_episode, run_group_episodes
from arbor.orchestrator.group import GroupSpec, generate_group

TOK = ByteTokenizer()


class Scripted:
    """A generate function that answers each call with the next scripted text (as the engine would: its bytes
    plus eos, logprob -0.5, policy version 7), recording every prompt it was sent."""

    def __init__(self, *texts: str, tok=TOK) -> None:
        self.texts, self.prompts, self.tok = list(texts), [], tok

    async def __call__(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None):
        assert n == 1
        self.prompts.append(list(prompt_ids))
        text = self.texts.pop(0)
        ids = self.tok.encode(text) + [self.tok.eos_token_id]
        finish = "stop" if len(ids) <= max_tokens else "length"
        ids = ids[:max_tokens]
        return [Completion(ids, [-0.5] * len(ids), [7] * len(ids), self.tok.decode(ids), finish)]


def _settings(seq_len: int = 1024, **env) -> EpisodeSettings:
    return EpisodeSettings(max_tokens=128, temperature=1.0, top_p=1.0, seq_len=seq_len, env=EnvironmentConfig(**env))


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def test_tool_use_episode_end_to_end_with_a_scripted_agent(chat_tokenizer):
    tok = chat_tokenizer
    env = ToolUseEnv(num_tasks=3, kinds=["calc"])
    task = env.dataset(0)[0]
    expr = task["question"].removeprefix("What is ").removesuffix("?")
    agent = Scripted(
        CALL % expr, "<tool_call>{broken</tool_call>", f"The answer is \\boxed{{{task['answer']}}}", tok=tok
    )
    stats = EpisodeStats()
    (r,) = asyncio.run(run_episode(agent, env, task, tok, _settings(), seed=1, group_id=3, episode_id=9, stats=stats))
    # every turn's prompt extended the previous prompt + the sampled tokens
    for before, after in zip(agent.prompts, agent.prompts[1:]):
        assert after[: len(before)] == before
    assert r.prompt_ids == agent.prompts[0] and r.prompt_ids + r.completion_ids == agent.prompts[-1] + tok.encode(
        f"The answer is \\boxed{{{task['answer']}}}"
    ) + [tok.eos_token_id]
    assert r.components == {"correct": 1.0, "tool_penalty": pytest.approx(-0.1)}
    assert r.reward == pytest.approx(0.9) and r.group_id == 3 and r.episode_id == 9 and not r.score_failed
    tool_text = tok.decode([t for t, m in zip(r.completion_ids, r.completion_mask) if m == 0])
    assert f"<tool_response>\n{calculator(expr)}\n</tool_response>" in tool_text
    assert "malformed tool call" in tool_text
    assert (
        sum(r.completion_mask)
        == sum(len(tok.encode(t)) + 1 for t in (CALL % expr, "<tool_call>{broken</tool_call>"))
        + len(tok.encode(f"The answer is \\boxed{{{task['answer']}}}"))
        + 1
    )
    assert all(v == -1 for v, m in zip(r.policy_versions, r.completion_mask) if m == 0)
    assert stats.episodes == 1 and stats.turns == 3 and stats.finished == {"done": 1}


def test_episode_stops_at_max_turns_and_at_the_token_budget():
    env = ToolUseEnv(num_tasks=2, kinds=["calc"], max_turns=2)
    task = env.dataset(0)[0]
    stats = EpisodeStats()
    rollouts = asyncio.run(run_episode(Scripted(CALL % "1+1", CALL % "2+2"), env, task, TOK, _settings(), stats=stats))
    assert stats.finished == {"max_turns": 1} and stats.turns == 2 and rollouts[0].reward == 0.0
    first = len(TOK.apply_chat_template(env.prompt(task), tools=[{"function": {"name": "x"}}]))
    stats = EpisodeStats()
    # room for one turn only: the second prompt does not fit under seq_len
    rollouts = asyncio.run(
        run_episode(Scripted(CALL % "1+1"), env, task, TOK, _settings(seq_len=first + 300), stats=stats)
    )
    assert stats.finished == {"budget": 1} and rollouts[0].num_tokens <= first + 300


def test_truncating_context_branches_and_each_branch_shares_the_episode_reward(chat_tokenizer):
    tok = chat_tokenizer
    env = ToolUseEnv(num_tasks=2, kinds=["calc"], max_turns=6)
    task = env.dataset(0)[0]
    agent = Scripted(CALL % "1+1", CALL % "2+2", CALL % "3+3", CALL % "4+4", f"\\boxed{{{task['answer']}}}", tok=tok)
    stats = EpisodeStats()
    settings = _settings(context=ContextConfig(strategy="truncate", keep_turns=2))
    rollouts = asyncio.run(run_episode(agent, env, task, tok, settings, episode_id=4, stats=stats))
    assert stats.context_edits == 2 and len(rollouts) == 3 == stats.branches
    assert {r.reward for r in rollouts} == {1.0} and {r.episode_id for r in rollouts} == {4}
    # edits before turns 4 and 5 (3 turns seen, 2 kept): each branch restarts from the trimmed view, rendered
    # fresh: system + question + the last 2 turns
    for r, dropped, kept in zip(rollouts[1:], ("1+1", "2+2"), ("2+2", "3+3")):
        text = tok.decode(r.prompt_ids, skip_special_tokens=False)
        assert task["question"] in text and dropped not in text and kept in text
    # the samples hold exactly what the agent was prompted with
    assert [r.prompt_ids for r in rollouts] == [agent.prompts[0], agent.prompts[3], agent.prompts[4]]
    assert rollouts[0].prompt_ids + rollouts[0].completion_ids == agent.prompts[2] + tok.encode(CALL % "3+3") + [
        tok.eos_token_id
    ]
    # advantages count the episode once: with one other episode of reward 0, all 3 branches get +0.5
    other = asyncio.run(run_episode(Scripted("\\boxed{0}", tok=tok), env, task, tok, _settings(), episode_id=5))
    group = rollouts + other
    compute_advantages([group], AdvantageConfig())
    assert [r.advantage for r in group] == pytest.approx([0.5, 0.5, 0.5, -0.5])
    (batch,) = build_step_batches(group, 0, 1, 4096, 1.0, tok.pad_token_id)
    assert batch.loss_tokens_total == sum(r.num_trained for r in group)


def test_summarise_context_policy_is_deterministic():
    cfg = ContextConfig(strategy="summarise", keep_turns=1)
    view = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "first try\nmore"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "second"},
        {"role": "tool", "content": "43"},
    ]
    policy = ContextPolicy(cfg)
    assert policy.should_edit(view, 2, 10)
    out = policy.edit(view, 2)
    assert out[:2] == view[:2] and out[3:] == view[4:]
    assert out[2] == {"role": "user", "content": SUMMARY_HEADER + "- assistant: first try\n- tool: 42"}
    assert ContextPolicy(cfg).edit(view, 2) == out
    # a later summary carries the earlier one over whole
    again = policy.edit(out + [{"role": "assistant", "content": "third"}], 2)
    assert again[2]["content"] == SUMMARY_HEADER + "- assistant: first try\n- tool: 42\n- assistant: second\n- tool: 43"
    assert not ContextPolicy(ContextConfig(strategy="truncate", keep_turns=1, trigger_tokens=100)).should_edit(
        view, 2, 50
    )
    assert extractive_summary([{"role": "tool", "content": "x" * 120}], width=10) == "- tool: xxxxxxxxxx..."


class FlakyEnv(ToolEnv):
    """Fails `fail_setups` setups (or hangs them), then works."""

    name = "flaky"
    max_turns = 2

    def __init__(self, fail_setups: int = 0, hang: bool = False, fail_score: bool = False) -> None:
        self.fail_setups, self.hang, self.fail_score, self.setups = fail_setups, hang, fail_score, 0

    def dataset(self, seed):
        return [{"id": 0, "question": "q"}]

    def prompt(self, task):
        return [{"role": "user", "content": task["question"]}]

    async def setup(self, task):
        self.setups += 1
        if self.setups <= self.fail_setups:
            if self.hang:
                await asyncio.sleep(3600)
            raise ConnectionError("sandbox unavailable")
        return await super().setup(task)

    async def score_episode(self, task, state, messages):
        if self.fail_score:
            raise RuntimeError("verifier crashed")
        return {"correct": 1.0}


@pytest.mark.parametrize("hang", [False, True])
def test_failing_environment_is_retried_then_recovers(hang):
    env, stats = FlakyEnv(fail_setups=1, hang=hang), EpisodeStats()
    (r,) = asyncio.run(
        run_episode(Scripted("hi"), env, env.dataset(0)[0], TOK, _settings(timeout=0.2, retries=1), stats=stats)
    )
    assert r.reward == 1.0 and not r.score_failed
    assert stats.retries == 1 and stats.timeouts == int(hang) and stats.failed == 0


def test_environment_failing_for_good_is_scored_zero_or_skipped_and_counted():
    env, stats = FlakyEnv(fail_setups=5), EpisodeStats()
    (r,) = asyncio.run(run_episode(Scripted("hi"), env, env.dataset(0)[0], TOK, _settings(retries=2), stats=stats))
    assert r.score_failed and r.reward == 0.0 and r.completion_ids == [] and r.prompt_ids
    assert stats.failed == 1 and stats.retries == 2 and stats.finished == {"env_failed": 1}
    env, stats = FlakyEnv(fail_score=True), EpisodeStats()
    (r,) = asyncio.run(run_episode(Scripted("hi"), env, env.dataset(0)[0], TOK, _settings(retries=0), stats=stats))
    assert r.score_failed and r.completion_ids and sum(r.completion_mask) == len(r.completion_ids)
    env, stats = FlakyEnv(fail_setups=5), EpisodeStats()
    out = asyncio.run(
        run_group_episodes(
            Scripted("a", "b"),
            env,
            env.dataset(0)[0],
            TOK,
            _settings(retries=0, on_failure="skip"),
            2,
            seed=0,
            stats=stats,
        )
    )
    assert out == [] and stats.skipped == 2 and stats.figures()["env/skipped"] == 2


def test_single_turn_scoring_retries_and_skips():
    class Crashy:
        name, calls = "crashy", 0

        def dataset(self, seed):
            return [{"id": 0}]

        def prompt(self, task):
            return [{"role": "user", "content": "x"}]

        def reference(self, task):
            return None

        async def score(self, task, completion):
            Crashy.calls += 1
            if Crashy.calls % 3:  # two failures, then a success, repeating
                raise ValueError("flaky")
            return {"ok": 1.0}

    async def generate(prompt_ids, n, max_tokens, temperature, top_p, seed=None):
        return [Completion([65, TOK.eos_token_id], [0.0, 0.0], [0, 0], "A", "stop") for _ in range(n)]

    spec = GroupSpec({"id": 0}, [1, 2], seed=0)
    stats = EnvStats()
    cfg = EnvironmentConfig(retries=2, timeout=5)
    (r,) = asyncio.run(
        generate_group(None, Crashy(), spec, 1, 4, 1.0, 1.0, {}, 5.0, generate=generate, env_cfg=cfg, stats=stats)
    )
    assert r.reward == 1.0 and stats.retries == 2
    cfg = EnvironmentConfig(retries=0, on_failure="skip")
    out = asyncio.run(
        generate_group(None, Crashy(), spec, 3, 4, 1.0, 1.0, {}, 5.0, generate=generate, env_cfg=cfg, stats=stats)
    )
    assert len(out) == 1 and stats.skipped == 2  # calls 4 and 5 fail (no retry): skipped; call 6 scores
    with pytest.raises(EnvFailure, match="after 2 attempts"):
        asyncio.run(guarded("x", Crashy().score, {}, "", timeout=1, retries=1))


def test_generate_group_dispatches_multi_turn_environments():
    env = load_environment(EnvironmentConfig(id="tool_use", args={"num_tasks": 4, "kinds": ["lookup"]}))
    assert is_multi_turn(env) and not is_multi_turn(MathEnv(num_tasks=1))
    task = env.dataset(0)[0]
    name = task["question"].split(" of ")[-1].split(" founded")[0].rstrip("?").removeprefix("In which year was ")
    search = f'<tool_call>{{"name": "search", "arguments": {{"query": "{name}"}}}}</tool_call>'
    agent = Scripted(search, f"\\boxed{{{task['answer']}}}", search, "dunno", "\\boxed{0}")
    spec = GroupSpec(task, [], seed=3, group_id=1)
    out = asyncio.run(
        generate_group(None, env, spec, 2, 128, 1.0, 1.0, {}, 5.0, generate=agent, tokenizer=TOK, seq_len=1024)
    )
    assert sorted(r.reward for r in out) == [0.0, 1.0] and {r.group_id for r in out} == {1}
    assert len({r.episode_id for r in out}) == 2
    assert any(task["answer"] in TOK.decode(p) for p in agent.prompts)  # the search result reached the agent
    assert any(TOK.decode(p).endswith(f"{env.nudge}\nassistant\n") for p in agent.prompts)  # "dunno" was nudged


def test_process_penalty_gives_per_turn_rewards():
    env = ToolUseEnv(num_tasks=2, kinds=["calc"], process_penalty=0.5)
    task = env.dataset(0)[0]
    (r,) = asyncio.run(
        run_episode(
            Scripted("<tool_call>oops</tool_call>", f"\\boxed{{{task['answer']}}}"), env, task, TOK, _settings()
        )
    )
    (first_end, first), (last_end, last) = r.turn_rewards
    assert first == -0.5 and last == pytest.approx(r.reward) and last_end == len(r.completion_ids)
    compute_advantages([[r]], AdvantageConfig())
    assert r.token_advantages[0] < r.token_advantages[-1]


# --- math --------------------------------------------------------------------------------------------------


def test_math_answer_extraction_and_exact_comparison():
    assert extract_answer("so \\boxed{\\frac{7}{2}} done") == "\\frac{7}{2}"
    assert extract_answer("x \\boxed{1} then \\boxed{{2}}") == "{2}"
    assert extract_answer("work\nThe answer is 3/4.") == "3/4"
    assert extract_answer("") is None and extract_answer("no numbers") is None
    assert parse_number("\\dfrac{-3}{6}") == Fraction(-1, 2)
    assert parse_number("1,234") == 1234 and parse_number("0.5") == Fraction(1, 2) and parse_number("$12$") == 12
    assert parse_number("1/0") is None and parse_number("abc") is None
    assert is_correct("\\boxed{0.5}", "1/2") and is_correct("it is 14", "14")
    assert not is_correct("\\boxed{0.333}", "1/3") and not is_correct("14 or 15", "14")


def test_math_dataset_is_deterministic_and_solvable():
    env = MathEnv(num_tasks=50, difficulty=2)
    tasks = env.dataset(1)
    assert tasks == env.dataset(1) and tasks != env.dataset(2)
    assert {t["kind"] for t in tasks} == {"arithmetic", "fraction", "linear", "word", "percent"}
    for t in tasks:
        assert asyncio.run(env.score(t, env.reference(t))) == {"correct": 1.0}
        assert asyncio.run(env.score(t, "\\boxed{999999}"))["correct"] == 0.0 or t["answer"] == "999999"
    with pytest.raises(ValueError, match="unknown kinds"):
        MathEnv(kinds=["calculus"])
    built = load_environment(EnvironmentConfig(id="math", args={"num_tasks": 3, "kinds": ["linear"]}))
    assert isinstance(built, MathEnv) and all(t["kind"] == "linear" for t in built.dataset(0))


# --- tool_use ----------------------------------------------------------------------------------------------


def test_calculator_is_exact_and_safe():
    assert calculator("(12 + 30) * 7 / 4") == "73.5"
    assert calculator("1/3") == "1/3" and calculator("2^10") == "1024" and calculator("-7 // 2") == "-4"
    assert calculator("0.1 + 0.2") == "0.3"
    for bad in (
        "__import__('os').system('true')",
        "x + 1",
        "(1).real",
        "[1, 2]",
        "open('f')",
        "lambda: 1",
        "9 ** 9 ** 9",
        "10 ** 1000",
        "1 / 0",
        "2 ** 0.5",
        "'a' * 3",
        "1 if 1 else 2",
        "a" * 201,
    ):
        with pytest.raises(CalculatorError):
            calculator(bad)


def test_bm25_search_finds_the_town():
    index = BM25(["Varmon is a town on the Amber river.", "Holtek has a population of 900.", "The Amber river floods."])
    assert index.top("population of Holtek", 2)[0][0] == 1
    assert index.top("amber", 3)[0][0] in (0, 2) and index.top("zzz", 3) == []
    env = ToolUseEnv(num_tasks=1)
    town = env.towns[5]
    assert env.search(town["name"]).startswith(f"{town['name']} is a town on the {town['river']} river")


def test_invalid_tool_calls_are_answered_and_counted():
    env = ToolUseEnv(num_tasks=1)
    task = env.dataset(0)[0]

    async def run():
        state = await env.setup(task)
        msgs = env.prompt(task) + [
            {
                "role": "assistant",
                "content": (
                    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                    '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
                ),
            }
        ]
        return state, await env.step(task, state, msgs)

    state, result = asyncio.run(run())
    assert isinstance(result, StepResult) and not result.done
    contents = [m["content"] for m in result.messages]
    assert "unknown tool 'nope'" in contents[0] and "bad arguments" in contents[1] and "division by zero" in contents[2]
    assert contents[3] == "42" and state.invalid_calls == 3 and state.tool_calls == 4


def test_tool_use_demonstrations_are_correct_episodes_and_sft_examples():
    from arbor.config.sft import SFTConfig
    from arbor.trainer.sft_data import load_examples

    env = ToolUseEnv(num_tasks=6)
    for task in env.dataset(0):
        messages = env.demonstration(task)
        final = messages[-1]["content"]
        assert asyncio.run(env.score(task, final))["correct"] == 1.0
        assert (
            task["answer"] in "".join(m["content"] for m in messages if m["role"] == "tool") or task["kind"] == "calc"
        )
    cfg = SFTConfig(steps=1, seq_len=1024, environment=EnvironmentConfig(id="tool_use", args={"num_tasks": 6}))
    examples = load_examples(cfg, TOK)
    assert len(examples) == 6
    ids, mask = examples[2]  # lookup_calc: two tool calls and the answer are the targets
    targets = TOK.decode([t for t, m in zip(ids, mask) if m])
    assert targets.count("<tool_call>") == 2 and targets.endswith("}") and "tool_response" not in targets
