"""vLLM serves the Llama and Qwen2 checkpoints arbor publishes (the native families beside Qwen3): a tiny random
model of each (Qwen2 with its q/k/v biases, Llama with `attention_bias` and `mlp_bias`) saved by arbor, served by a
real vLLM server (CPU or CUDA build, fp32), whose logprobs agree with arbor's (mismatch KL per token < 1e-3) before
and after a weight update published by the trainer's transport."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_vllm_backend import KL_TARGET, PROMPTS, mismatch_kl, perturbed, trainer_logprobs
from vllm_server import vllm_server

from arbor.models.args import ModelArgs
from arbor.models.hf import save_checkpoint_dir
from arbor.models.presets import BYTE_VOCAB
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.models.tokenizer import ByteTokenizer
from arbor.orchestrator.client import InferenceClient
from arbor.weights.transport import FilesystemTransport

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ARGS = dict(
    vocab_size=BYTE_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,  # a head size vLLM's CPU attention serves (arbor.inference.vllm.launch.CPU_HEAD_SIZES)
    rope_theta=10_000.0,
    max_position_embeddings=256,
    qk_norm="none",
)
FAMILIES = {
    "LlamaForCausalLM": dict(attention_bias=True, o_proj_bias=True, mlp_bias=True),
    "Qwen2ForCausalLM": dict(attention_bias=True),
}


def _random_model(arch: str) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(ModelArgs(**ARGS, **FAMILIES[arch], architecture=arch))
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases random too (init_weights zeroes them)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


async def _mismatch(client: InferenceClient, model: torch.nn.Module, version: int) -> float:
    outs = await asyncio.gather(*(client.generate(p, 2, 20, 1.0, 1.0, 10 * version + i) for i, p in enumerate(PROMPTS)))
    kls = []
    for prompt, completions in zip(PROMPTS, outs, strict=True):
        for c in completions:
            assert c.policy_versions == [version] * len(c.token_ids)
            kls.append(mismatch_kl(trainer_logprobs(model, prompt, c.token_ids), torch.tensor(c.logprobs)))
    return float(torch.cat(kls).mean())


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_vllm_serves_the_published_checkpoint_and_its_update_like_arbor(tmp_path: Path, arch: str) -> None:
    model = _random_model(arch)
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path / "ckpt", ByteTokenizer())

    async def go() -> list[float]:
        async with InferenceClient([url], timeout=600, max_retries=0) as client:
            before = await _mismatch(client, model, 0)
            perturbed(model, 1)
            path = FilesystemTransport().publish(tmp_path / "run", 1, model.state_dict(), model.args)
            await client.update_weights(str(path), 1)
            return [before, await _mismatch(client, model, 1)]

    with vllm_server(tmp_path, tmp_path / "ckpt", 128) as url:
        kls = asyncio.run(go())
    print(f"{arch}: mismatch KL per token before and after an update {kls}")
    assert max(kls) < KL_TARGET, kls
