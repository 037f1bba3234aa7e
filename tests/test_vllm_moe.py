"""A tiny MoE (`qwen3-moe-tiny`, 8 experts top-2) on a real vLLM server with routed experts returned (router
replay), one server for the module: the routes decode through arbor's client, and the trainer's logprobs
agree with vLLM's (fp32, mismatch KL per token < 1e-3) with and without replaying them, before and after
three consecutive weight updates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from test_vllm_backend import KL_TARGET, PROMPTS, mismatch_kl, perturbed, trainer_logprobs
from vllm_server import vllm_server

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.orchestrator.client import Completion, InferenceClient
from arbor.transport.weights import FilesystemTransport

pytestmark = pytest.mark.vllm

MODEL = "qwen3-moe-tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> str:
    with vllm_server(tmp_path_factory.mktemp("vllm-moe"), MODEL, 128, "--router-replay", "true") as url:
        yield url


def _generate(url: str, version: int) -> list[tuple[list[int], Completion]]:
    async def go() -> list[tuple[list[int], Completion]]:
        async with InferenceClient([url], timeout=600, max_retries=0) as client:
            outs = await asyncio.gather(*(client.generate(p, 2, 20, 1.0, 1.0, 100 * version + i)
                                          for i, p in enumerate(PROMPTS)))
        return [(p, c) for p, cs in zip(PROMPTS, outs) for c in cs]

    return asyncio.run(go())


def test_routed_experts_and_mismatch_with_and_without_replay_over_three_updates(server: str, tmp_path: Path) -> None:
    model = build_model(ModelConfig(name=MODEL))
    layers, k = len(model.args.moe_layers), model.args.num_experts_per_tok
    free, replayed, agree = [], [], []
    for version in range(4):
        if version:
            perturbed(model, version)
            path = FilesystemTransport().publish(tmp_path / "run", version, model.state_dict(), model.args)
            asyncio.run(_update(server, str(path), version))
        kl_free, kl_replay = [], []
        for prompt, c in _generate(server, version):
            assert c.policy_versions == [version] * len(c.token_ids)
            routes = c.routed_experts
            assert routes is not None and routes.shape == (len(prompt) + len(c.token_ids), layers, k)
            assert routes.max() < model.args.num_experts
            inf = torch.tensor(c.logprobs)
            kl_free.append(mismatch_kl(trainer_logprobs(model, prompt, c.token_ids), inf))
            own = model.last_routed_experts[0].numpy()  # the trainer's own routing of the tokens vLLM fed
            fed = routes.shape[0] - 1
            agree.append(float((np.sort(own[:fed], -1) == np.sort(routes[:fed], -1)).all(-1).mean()))
            replay = torch.from_numpy(routes.astype(np.int64))[None]
            kl_replay.append(mismatch_kl(trainer_logprobs(model, prompt, c.token_ids, routed_experts=replay), inf))
        free.append(float(torch.cat(kl_free).mean()))
        replayed.append(float(torch.cat(kl_replay).mean()))
    print(f"MoE mismatch KL per token, versions 0-3: without replay {free}, with replay {replayed}; "
          f"routes equal to the trainer's own: {np.mean(agree):.4f}")
    assert max(free) < KL_TARGET and max(replayed) < KL_TARGET, (free, replayed)
    assert np.mean(agree) > 0.95


async def _update(url: str, path: str, version: int) -> None:
    async with InferenceClient([url], timeout=600, max_retries=0) as client:
        await client.update_weights(path, version)
