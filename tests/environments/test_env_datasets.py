"""Environment tasks from datasets (local parquet, jsonl and arrow files through the `datasets` library, never a
download): column mapping into the math and code environments' task fields, GSM8K- and MATH-style answer
checking, and one-line errors for a missing column, a malformed row or an absent library."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import datasets
import pytest

from arbor.config.env_args import check_env_args
from arbor.config.environment import EnvironmentConfig
from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.environments import load_environment
from arbor.environments.datasets import DatasetError, load_rows
from arbor.environments.math_problems import is_correct, reference_answer
from arbor.launch import preflight
from arbor.launch.preflight import PreflightError

GSM8K = [
    {
        "problem": "Ada has 3 pens and buys 2 boxes of 4 pens. How many pens does she have?",
        "solution": "She buys 2 * 4 = <<2*4=8>>8 pens.\nShe has 3 + 8 = <<3+8=11>>11 pens.\n#### 11",
    },
    {
        "problem": "A book costs $1,200 and is sold at half price. What is the price?",
        "solution": "Half of 1,200 is 600.\n#### 600",
    },
]
MATH = [
    {"problem": "Compute $\\sin 60^\\circ$.", "solution": "It is $\\boxed{\\dfrac{\\sqrt{3}}{2}}$."},
    {"problem": "Solve $2x = 7$.", "solution": "So $x = \\boxed{\\frac{7}{2}}$."},
]


def _score(env, task, completion: str) -> float:
    return asyncio.run(env.score(task, completion))["correct"]


def test_math_from_a_local_parquet_with_a_column_mapping(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_list(GSM8K).to_parquet(str(path))
    cfg = EnvironmentConfig(
        id="math", args={"dataset": str(path), "columns": {"question": "problem", "answer": "solution"}}
    )
    env = load_environment(cfg)
    tasks = env.dataset(seed=0)
    assert [t["answer"] for t in tasks] == ["11", "600"] and tasks[0]["question"] == GSM8K[0]["problem"]
    assert env.prompt(tasks[0])[-1]["content"] == GSM8K[0]["problem"]
    assert _score(env, tasks[0], "3 + 8 = 11, so the answer is \\boxed{11}") == 1.0
    assert _score(env, tasks[1], "The price is 600.") == 1.0
    assert _score(env, tasks[1], "\\boxed{1200}") == 0.0


def test_math_style_answers_from_jsonl_and_arrow(tmp_path):
    jsonl = tmp_path / "math.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in MATH))
    datasets.Dataset.from_list(MATH).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for source in (jsonl, arrow):
        env = load_environment(
            EnvironmentConfig(
                id="math",
                args={
                    "dataset": str(source),
                    "columns": {"question": "problem", "answer": "solution"},
                    "answer_format": "math",
                },
            )
        )
        tasks = env.dataset(seed=0)
        assert [t["answer"] for t in tasks] == ["\\dfrac{\\sqrt{3}}{2}", "\\frac{7}{2}"]
        assert _score(env, tasks[0], "So \\boxed{\\frac{\\sqrt{3}}{2}}.") == 1.0
        assert _score(env, tasks[0], "So \\boxed{\\frac{\\sqrt{2}}{2}}.") == 0.0
        assert _score(env, tasks[1], "x = \\boxed{3.5}") == 1.0


def test_reference_answer_formats():
    assert reference_answer("steps\n#### 1,234") == "1234"
    assert reference_answer("so $\\boxed{x^2 + 1}$") == "x^2 + 1"
    assert reference_answer(" 42 ", "plain") == "42"
    with pytest.raises(DatasetError, match="no '####'"):
        reference_answer("no marker", "gsm8k")
    assert is_correct("\\boxed{(1, 2)}", "(1,2)") and not is_correct("\\boxed{(2, 1)}", "(1,2)")
    assert is_correct("\\boxed{90^\\circ}", "90") and is_correct("\\boxed{\\text{(A)}}", "(A)")


def test_a_missing_column_is_one_line(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_list(GSM8K).to_parquet(str(path))
    env = load_environment(
        EnvironmentConfig(id="math", args={"dataset": str(path), "columns": {"question": "problem"}})
    )
    with pytest.raises(DatasetError) as e:
        env.dataset(seed=0)
    assert str(e.value) == (
        f"dataset {str(path)!r} has no column 'answer' for the task field 'answer' (its columns: "
        "problem, solution): set columns.answer"
    )
    args = [
        "--orchestrator.environment.id",
        "math",
        "--orchestrator.environment.args",
        json.dumps({"dataset": str(path), "columns": {"question": "problem"}}).replace('": ', '" = '),
        "--model.name",
        "qwen3-test",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    with pytest.raises(PreflightError, match="has no column 'answer'") as e:
        preflight.run_checks(load_config(RLConfig, args))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="columns.questoin"):
        load_config(RLConfig, [*args[:3], '{ dataset = "x.parquet", columns = { questoin = "problem" } }'])


def test_code_tasks_from_a_dataset_run_their_tests_in_the_sandbox(tmp_path):
    rows = [
        {
            "text": "Return the sum of two integers.",
            "name": "add",
            "cases": json.dumps([{"args": [1, 2], "expected": 3}, {"args": [-1, 1], "expected": 0}]),
            "solution": "def add(a, b):\n    return a + b\n",
        }
    ]
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    env = load_environment(
        EnvironmentConfig(
            id="code",
            args={
                "dataset": str(path),
                "columns": {"question": "text", "entry": "name", "tests": "cases", "answer": "solution"},
            },
        )
    )
    task = env.dataset(seed=0)[0]
    assert (
        "Return the sum of two integers." in env.prompt(task)[-1]["content"]
        and "`add`" in env.prompt(task)[-1]["content"]
    )
    assert asyncio.run(env.score(task, env.reference(task)))["pass"] == 1.0
    assert asyncio.run(env.score(task, "```python\ndef add(a, b):\n    return max(a + b, 1)\n```"))["pass"] == 0.5
    path.write_text(json.dumps({**rows[0], "cases": "[1, 2]"}) + "\n")
    with pytest.raises(DatasetError, match="row 0: tests must be a non-empty list"):
        env.dataset(seed=0)


def test_an_absent_library_or_file_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(str(tmp_path / "absent.parquet"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else find_spec(name, *a)
    )
    with pytest.raises(DatasetError, match="uv sync --extra datasets"):
        load_rows(str(tmp_path / "absent.parquet"))


def test_dataset_arguments_are_checked_with_the_config():
    check_env_args("math", {"dataset": "openai/gsm8k", "dataset_config": "main", "split": "train[:100]"})
    with pytest.raises(ValueError, match="answer_format"):
        check_env_args("math", {"answer_format": "gsm"})
