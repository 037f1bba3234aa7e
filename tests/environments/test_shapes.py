"""The `shapes` environment (arbor.environments.shapes): the colour task's square shows in every quarter of its
image (each of the tiny vision tower's image tokens sees the colour), answers are scored by their first word, and
the layer configs/envs/shapes.toml lets the policy finish its longest answer (one token per byte, as arbor's byte
tokenizer writes it; `max_tokens` 4 once cut "green" and "yellow" short, so half the answers scored 0)."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import numpy as np
import pytest

from arbor.config.env_args import ShapesArgs
from arbor.environments.shapes import COLOURS, ShapesEnv, draw

ROOT = Path(__file__).resolve().parents[2]


def test_colour_square_fills_every_quarter_with_its_colour() -> None:
    env = ShapesEnv(num_tasks=64, kinds=("colour",))
    tasks = env.dataset(0)
    assert {t["answer"] for t in tasks} == set(COLOURS)
    for task in tasks:
        pixels = np.asarray(draw(task, env.size))
        colour = np.array(COLOURS[task["answer"]])
        for qy in (0, 16):
            for qx in (0, 16):
                quarter = pixels[qy : qy + 16, qx : qx + 16].reshape(-1, 3)
                coloured = (quarter == colour).all(-1).mean()
                assert coloured >= 0.25, (task, qx, qy, coloured)  # at least a quarter of each 16x16 quarter


def test_count_and_position_squares_stay_small_and_apart() -> None:
    env = ShapesEnv(num_tasks=64, kinds=("count", "position"))
    for task in env.dataset(1):
        white = (np.asarray(draw(task, env.size)) == 255).all(-1).sum()
        assert white == len(task["squares"]) * 8 * 8  # 8-pixel squares that never overlap
        if task["kind"] == "count":
            assert task["answer"] == str(len(task["squares"]))


def test_score_reads_the_first_word() -> None:
    env = ShapesEnv(num_tasks=1, kinds=("colour",))
    task = env.dataset(0)[0]
    other = next(c for c in COLOURS if c != task["answer"])
    scores = [asyncio.run(env.score(task, text))["correct"] for text in (f" {task['answer'].title()}.", other, "")]
    assert scores == [1.0, 0.0, 0.0]


def test_shapes_layer_leaves_room_for_every_answer() -> None:
    layer = tomllib.loads((ROOT / "configs/envs/shapes.toml").read_text())
    answers = [*COLOURS, "1", "2", "3", "4", "left", "right"]
    longest = max(len(a.encode()) for a in answers)
    assert layer["orchestrator"]["sampling"]["max_tokens"] >= longest + 1  # the answer and the end-of-turn token


def test_unknown_kind_is_one_line_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kinds"):
        ShapesArgs.model_validate({"kinds": ["size"]})
