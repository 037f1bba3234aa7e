"""The eval core against hand-computed avg@k / pass@k, and the `eval` entry point on the local engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from arbor.config.eval import EvalSettings
from arbor.config.model import ModelConfig
from arbor.models import build_tokenizer
from arbor.orchestrator.eval import evaluate, main as eval_main


def test_avg_and_pass_at_k_by_hand():
    cfg = EvalSettings(num_tasks=2, k=2, environments=[{"id": "reverse_text", "args": {"min_len": 3, "max_len": 3}}])
    from arbor.environments import load_environment

    tasks = load_environment(cfg.environments[0]).dataset(cfg.seed)[:2]
    answers = {t["text"]: t["answer"] for t in tasks}
    tok = build_tokenizer(ModelConfig(name="qwen3-test"))
    calls = []

    async def generate(prompt, n, seed):
        text = tok.decode(prompt)
        calls.append(seed)
        task_text = next(k for k in answers if k in text)
        # Task 0: one exact answer and one empty string; task 1: two empty strings.
        if task_text == tasks[0]["text"]:
            return [answers[task_text], ""]
        return ["", ""]

    figures = asyncio.run(evaluate(generate, tok, cfg))
    assert figures["eval/reverse_text/avg@2"] == pytest.approx(0.25)  # rewards 1, 0, 0, 0
    assert figures["eval/reverse_text/pass@2"] == pytest.approx(0.5)
    assert figures["eval/reverse_text/pass@1"] == pytest.approx(0.25)
    assert len(set(calls)) == 2  # a distinct sampling seed per task


def test_eval_entry_point_on_local_engine(tmp_path, capsys):
    rc = eval_main(["--model.name", "qwen3-test", "--output-dir", str(tmp_path), "--num-tasks", "3", "--k", "2",
                    "--max-tokens", "6", "--seq-len", "64", "--num-threads", "1",
                    "--environments", '[{ id = "reverse_text", args = { min_len = 2, max_len = 4 } }]'])
    assert rc == 0
    (record,) = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert 0 <= record["eval/reverse_text/avg@2"] <= 1
    assert record["eval/reverse_text/pass@1"] <= record["eval/reverse_text/pass@2"]
    assert eval_main(["--k", "0"]) == 2  # bad config: one line naming the field
    assert "k" in capsys.readouterr().err
