"""vLLM's sleep mode behind arbor's proxy, the GPU half of a colocated run (`inference.colocate`): `/sleep`
(level 1: weights to host memory, KV cache dropped) gives the GPU's memory back, `/wake_up` takes it again, and a
weight update loaded into the woken engine is served exactly (the trainer's logprobs of vLLM's samples, fp32,
mismatch KL < 1e-3), through the same routes the local engine's CPU path serves (tests/inference/
test_engine_sleep.py, tests/e2e/test_colocate_e2e.py). vLLM's sleep mode needs CUDA (its allocator's pool)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_vllm_backend import mismatch_kl, perturbed, trainer_logprobs
from vllm_server import get_json, post_json, vllm_server

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.tokenizer import ByteTokenizer
from arbor.weights.transport import FilesystemTransport

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = ByteTokenizer().encode("reverse: abcdef")


def _sample_kl(url: str, model: torch.nn.Module, version: int) -> float:
    out = post_json(
        url,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 24, "n": 4, "temperature": 1.0, "logprobs": 0, "seed": version},
    )
    kls = []
    for c in out["choices"]:
        assert c["policy_versions"] == [version] * len(c["token_ids"])
        ref = trainer_logprobs(model, PROMPT, c["token_ids"])
        kls.append(mismatch_kl(ref, torch.tensor(c["logprobs"]["token_logprobs"])))
    return float(torch.cat(kls).mean())


def _free_gb() -> float:
    return torch.cuda.mem_get_info()[0] / 1e9


@pytest.mark.gpu(reason="vLLM's sleep mode (CuMemAllocator) exists on its CUDA build only")
def test_vllm_sleeps_wakes_and_serves_the_weights_loaded_in_between(tmp_path: Path) -> None:
    model = build_model(ModelConfig(name="qwen3-tiny"))
    with vllm_server(tmp_path, "qwen3-tiny", 256, "--colocate", "true") as url:
        assert _sample_kl(url, model, 0) < 1e-3
        awake = _free_gb()
        assert post_json(url, "/sleep", {})["sleeping"] == 1
        assert get_json(url, "/health")["sleeping"] == 1
        asleep = _free_gb()
        perturbed(model, 1)  # the trainer's step, while the engine sleeps
        path = FilesystemTransport().publish(tmp_path / "run", 1, model.state_dict(), model.args)
        assert post_json(url, "/wake_up", {})["sleeping"] == 0
        woken = _free_gb()
        assert post_json(url, "/update_weights", {"path": str(path), "version": 1}) == {"policy_version": 1}
        kl = _sample_kl(url, model, 1)
    print(f"GPU free: awake {awake:.2f} GB, asleep {asleep:.2f} GB, woken {woken:.2f} GB; KL after update {kl:.2e}")
    assert asleep - awake > 1.0  # the KV cache (0.3 of the GPU, less the weights) came back to the device
    assert woken < asleep - 1.0
    assert kl < 1e-3
