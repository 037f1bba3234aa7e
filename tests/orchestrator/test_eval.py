"""The eval core against hand-computed avg@k / pass@k, and the `eval` entry point on the local engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from arbor.config.eval import EvalSettings
from arbor.config.model import ModelConfig
from arbor.eval import main as eval_main
from arbor.models import build_tokenizer
from arbor.orchestrator.evaluator import evaluate


def test_avg_and_pass_at_k_by_hand():
    cfg = EvalSettings(num_tasks=2, k=2, environments=[{"id": "reverse_text", "args": {"min_len": 3, "max_len": 3}}])
    from arbor.environments import load_environment

    tasks = load_environment(cfg.environments[0]).dataset(cfg.seed)[:2]
    answers = {t["text"]: t["answer"] for t in tasks}
    tok = build_tokenizer(ModelConfig(name="qwen3-test"))
    calls = []

    async def generate(prompt, n, max_tokens, temperature, top_p, seed=None):
        text = tok.decode(prompt)
        calls.append(seed)
        task_text = next(k for k in answers if k in text)
        # Task 0: one exact answer and one empty string; task 1: two empty strings.
        texts = [answers[task_text], ""] if task_text == tasks[0]["text"] else ["", ""]
        return [_completion(tok, t) for t in texts]

    figures = asyncio.run(evaluate(generate, tok, cfg))
    assert figures["eval/reverse_text/avg@2"] == pytest.approx(0.25)  # rewards 1, 0, 0, 0
    assert figures["eval/reverse_text/pass@2"] == pytest.approx(0.5)
    assert figures["eval/reverse_text/pass@1"] == pytest.approx(0.25)
    assert len(set(calls)) == 2  # a distinct sampling seed per task


def _completion(tok, text):
    from arbor.orchestrator.client import Completion

    ids = tok.encode(text) + [tok.eos_token_id]
    return Completion(ids, [0.0] * len(ids), [0] * len(ids), text, "stop")


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def adder_env():
    """A multi-turn tool environment: the answer needs one `add` call (built lazily: tests import this module)."""
    from arbor.environments.multiturn import ToolEnv

    class Adder(ToolEnv):
        name = "adder"
        max_turns = 3

        def dataset(self, seed):
            return [{"id": i, "a": 10 + i, "b": 20 + i} for i in range(3)]

        def prompt(self, task):
            return [{"role": "user", "content": f"{task['a']}+{task['b']}?"}]

        def tools(self, task):
            return [add]

        async def score_episode(self, task, state, messages):
            final = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
            return {"correct": float(f"\\boxed{{{task['a'] + task['b']}}}" in final)}

    return Adder()


def test_multi_turn_eval_plays_whole_episodes():
    """A multi-turn environment is evaluated on whole episodes: the tool runs, its result comes back, and the
    episode's final answer is scored (a scripted agent: right on tasks 0 and 1, wrong on task 2)."""
    import re

    cfg = EvalSettings(num_tasks=3, k=2, max_tokens=64, environments=[{"id": "test_eval:adder_env"}])
    tok = build_tokenizer(ModelConfig(name="qwen3-test"))
    turns = []

    async def generate(prompt, n, max_tokens, temperature, top_p, seed=None):
        text = tok.decode(prompt)
        a, b = map(int, re.search(r"(\d+)\+(\d+)\?", text).groups())
        if "<tool_response>" not in text:  # first turn: call the tool
            call = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
            turns.append("call")
            return [_completion(tok, call) for _ in range(n)]
        result = int(re.findall(r"<tool_response>\s*(-?\d+)", text)[-1])
        turns.append("answer")
        answer = result if a != 12 else result + 1  # task 2 answers wrong
        return [_completion(tok, f"\\boxed{{{answer}}}") for _ in range(n)]

    figures = asyncio.run(evaluate(generate, tok, cfg, seq_len=512))
    assert figures["eval/adder_env/avg@2"] == pytest.approx(2 / 3)
    assert figures["eval/adder_env/pass@2"] == pytest.approx(2 / 3)
    assert turns.count("call") == turns.count("answer") == 6  # 3 tasks x 2 episodes, two turns each
    with pytest.raises(ValueError, match="multi-turn"):
        asyncio.run(evaluate(generate, tok, cfg))


def test_eval_entry_point_on_local_engine(tmp_path, capsys):
    rc = eval_main(
        [
            "--model.name",
            "qwen3-test",
            "--output-dir",
            str(tmp_path),
            "--num-tasks",
            "3",
            "--k",
            "2",
            "--max-tokens",
            "6",
            "--seq-len",
            "64",
            "--num-threads",
            "1",
            "--environments",
            '[{ id = "reverse_text", args = { min_len = 2, max_len = 4 } }]',
        ]
    )
    assert rc == 0
    (record,) = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert 0 <= record["eval/reverse_text/avg@2"] <= 1
    assert record["eval/reverse_text/pass@1"] <= record["eval/reverse_text/pass@2"]
    assert eval_main(["--k", "0"]) == 2  # bad config: one line naming the field
    assert "k" in capsys.readouterr().err
