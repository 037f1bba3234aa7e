"""Multi-turn episodes with images (arbor.orchestrator.episode): a prompt image, then images that the
environment adds in later turns (a user turn, a ToolEnv tool's answer) accumulate in order; every call carries
all of them, each rollout its own, and on the CPU engine the trainer's logprobs over the whole episode equal the
engine's. A text model given a tool's image fails the episode in one counted line."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from arbor.config.environment import EnvironmentConfig
from arbor.config.model import ModelConfig
from arbor.environments.multiturn import ToolEnv
from arbor.environments.protocol import StepResult
from arbor.inference.engine.core import Engine
from arbor.inference.server import BackgroundServer
from arbor.models import build_model
from arbor.models.tokenizer import ByteTokenizer, load_tokenizer
from arbor.models.vision_tiny import write_tiny_vl
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.client import Completion, InferenceClient
from arbor.orchestrator.episode import EpisodeSettings, EpisodeStats, run_episode, run_group_episodes
from arbor.trainer.step import micro_batch_logprobs

RED, BLUE = Image.new("RGB", (32, 32), "red"), Image.new("RGB", (48, 32), "blue")
LOOK = '<tool_call>{"name": "look", "arguments": {"colour": "blue"}}</tool_call>'


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return str(write_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl"))


def _image(im: Image.Image) -> dict[str, Any]:
    return {"type": "image", "image": im}


class LookEnv(ToolEnv):
    """Calls `look` once (its answer an image), then answers; the reward counts the tool calls."""

    name = "look"
    max_turns = 3

    def __init__(self, prompt_image: bool = True) -> None:
        self.prompt_image = prompt_image

    def dataset(self, seed: int) -> list[dict[str, Any]]:
        return [{"id": 0}]

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        text = {"type": "text", "text": "which colour is the other square?"}
        return [{"role": "user", "content": [_image(RED), text] if self.prompt_image else [text]}]

    def tools(self, task: dict[str, Any]) -> list:
        def look(colour: str):
            """Shows a square.

            Args:
                colour: its colour
            """
            return Image.new("RGB", (48, 32), colour)

        return [look]

    async def score_episode(self, task, state, messages) -> dict[str, float]:
        return {"calls": float(state.tool_calls)}


def _settings(seq_len: int = 512) -> EpisodeSettings:
    return EpisodeSettings(64, 1.0, 1.0, seq_len, EnvironmentConfig())


def test_a_tools_image_joins_the_episodes_images_in_order(vl_dir) -> None:
    tok = load_tokenizer(vl_dir)
    calls = []

    async def generate(ids, n, max_tokens, temperature, top_p, seed=None, images=None, tokenizer=tok):
        calls.append((list(ids), images))
        text = LOOK if len(calls) == 1 else "blue"
        tokens = tokenizer.encode(text) + [tokenizer.eos_token_id]
        return [Completion(tokens, [-0.5] * len(tokens), [0] * len(tokens), text, "stop")]

    (r,) = asyncio.run(run_episode(generate, LookEnv(), {"id": 0}, tok, _settings(), seed=0))
    assert len(calls) == 2 and r.reward == 1.0 and not r.score_failed
    first, second = calls[0][1], calls[1][1]
    assert np.asarray(first["image_grid_thw"]).tolist() == [[1, 4, 4]]
    assert np.asarray(second["image_grid_thw"]).tolist() == [[1, 4, 4], [1, 4, 6]]  # the prompt's, then the tool's
    head = np.asarray(first["pixel_values"])
    assert np.array_equal(np.asarray(second["pixel_values"])[: len(head)], head)
    assert r.images is second  # the rollout trains with every image of its ids, as the last call sent them
    ids = r.prompt_ids + r.completion_ids
    assert ids[: len(calls[1][0])] == calls[1][0] and r.prompt_ids == calls[0][0]
    assert ids.count(tok.vision.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4 + 6
    sampled = [t for t, m in zip(r.completion_ids, r.completion_mask) if m]
    assert sampled == tok.encode(LOOK) + [tok.eos_token_id] + tok.encode("blue") + [tok.eos_token_id]

    # a text model: the tool's image cannot be rendered, the episode fails in one counted line
    text, stats, calls[:] = ByteTokenizer(), EpisodeStats(), []
    (r,) = asyncio.run(
        run_episode(
            lambda *a, **k: generate(*a, **k, tokenizer=text),
            LookEnv(prompt_image=False),
            {"id": 0},
            text,
            _settings(),
            seed=0,
            stats=stats,
        )
    )
    assert len(calls) == 1 and r.score_failed and r.images is None
    assert stats.failed == 1 and stats.finished == {"env_failed": 1}


class ShowTwoEnv:
    """Two turns: a red square in the prompt, a blue one in the user's second turn."""

    name = "show_two"
    max_turns = 2

    def dataset(self, seed: int) -> list[dict[str, Any]]:
        return [{"id": 0}]

    def prompt(self, task):
        return [{"role": "user", "content": [_image(RED), {"type": "text", "text": "colour?"}]}]

    def reference(self, task):
        return None

    def tools(self, task):
        return []

    async def setup(self, task):
        return {}

    async def step(self, task, state, messages) -> StepResult:
        if len(messages) > 2:
            return StepResult(done=True)
        return StepResult([{"role": "user", "content": [{"type": "text", "text": "and now?"}, _image(BLUE)]}])

    async def score_episode(self, task, state, messages) -> dict[str, float]:
        return {"turns": float(sum(m["role"] == "assistant" for m in messages))}


def test_image_episodes_on_the_engine_train_token_exactly(vl_dir) -> None:
    tok = load_tokenizer(vl_dir)
    model = build_model(ModelConfig(name=vl_dir, impl="transformers"))
    engine = Engine(model, tok, seq_len=256, max_batch_size=4, seed=0).start()

    async def episodes():
        async with InferenceClient([server.url], timeout=60, max_retries=0) as client:
            settings = EpisodeSettings(6, 1.0, 1.0, 256, EnvironmentConfig())
            return await run_group_episodes(client.generate, ShowTwoEnv(), {"id": 0}, tok, settings, 3, seed=5)

    try:
        with BackgroundServer(engine, tok) as server:
            rollouts = asyncio.run(episodes())
    finally:
        engine.stop()
    assert len(rollouts) == 3 and all(r.reward == 2.0 for r in rollouts)
    pad = tok.vision.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for r in rollouts:
        assert np.asarray(r.images["image_grid_thw"]).tolist() == [[1, 4, 4], [1, 4, 6]]
        assert (r.prompt_ids + r.completion_ids).count(pad) == 10 and r.prompt_ids.count(pad) == 4
    (batch,) = build_step_batches(rollouts, step=0, ranks=1, micro_batch_tokens=512, temperature=1.0, pad_id=0)
    assert sum(int(mb.image_grid_thw.shape[0]) for mb in batch.micro_batches if mb.pixel_values is not None) == 6
    for mb in batch.torch().micro_batches:  # as the trainer reads them
        with torch.no_grad():
            ours, _ = micro_batch_logprobs(model, mb, 1.0, torch.device("cpu"), with_entropy=False)
        assert (ours - mb.inference_logprobs)[mb.loss_mask].abs().max() <= 1e-4
