"""LoRA adapters in the local engine: per-request adapters in one decode batch equal a model with the adapter
merged into its weights (logprobs within 1e-5), hot-swapped versions, and the dynamic-LoRA HTTP routes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from arbor.config.model import LoRAConfig, ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.inference.server import BackgroundServer
from arbor.models import build_model, build_tokenizer
from arbor.models.lora import apply_lora, lora_parameters, merged_state
from arbor.models.lora_peft import adapter_config, save_adapter

PROMPT = [5, 6, 7, 8, 9]


def random_adapter(
    name: str, path: Path, seed: int, rank: int = 4, targets: list[str] | None = None
) -> tuple[torch.nn.Module, Path]:
    """A model with a random (non-zero) adapter, and that adapter written as a PEFT directory."""
    lora = LoRAConfig(rank=rank, alpha=2.0 * rank, **({"target_modules": targets} if targets else {}))
    cfg = ModelConfig(name=name, lora=lora)
    model = build_model(cfg)
    apply_lora(model, lora, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    adapters = dict(lora_parameters(model))
    save_adapter(path, adapter_config(lora, name, adapters), adapters)
    return model, path


def merged(name: str, model: torch.nn.Module) -> torch.nn.Module:
    out = build_model(ModelConfig(name=name))
    out.load_state_dict(merged_state(model))
    return out


def engine(model: torch.nn.Module, name: str) -> Engine:
    return Engine(model, build_tokenizer(ModelConfig(name=name)), seq_len=64, max_batch_size=8).start()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-test", "qwen3-moe-test", "dsa-test"])
def test_adapter_rows_match_merged_weights_in_one_batch(tmp_path: Path, name: str) -> None:
    """Requests for adapter a, adapter b and the base model decode together; each equals its own merged model."""
    model_a, dir_a = random_adapter(name, tmp_path / "a", seed=1)
    model_b, dir_b = random_adapter(name, tmp_path / "b", seed=2, rank=2, targets=["q_proj", "o_proj", "down_proj"])
    greedy = SamplingParams(max_tokens=12, temperature=0.0, n=2)
    with torch.inference_mode():
        served = engine(build_model(ModelConfig(name=name)), name)
        try:
            assert served.load_adapter("a", dir_a, 3).result() == 3
            assert served.load_adapter("b", dir_b, 7).result() == 7
            futures = {k: served.submit(PROMPT, greedy, adapter=k) for k in ("a", "b", None)}
            outs = {k: f.result() for k, f in futures.items()}
            assert served.stats().max_decode_batch == 6  # all three requests shared the decode batch
        finally:
            served.stop()
        refs = {"a": merged(name, model_a), "b": merged(name, model_b), None: build_model(ModelConfig(name=name))}
        for key, ref_model in refs.items():
            ref = engine(ref_model, name)
            try:
                want = ref.submit(PROMPT, greedy).result()
            finally:
                ref.stop()
            got = outs[key].completions[0]
            assert got.token_ids == want.completions[0].token_ids
            assert max(abs(x - y) for x, y in zip(got.logprobs, want.completions[0].logprobs)) < 1e-5
            assert got.policy_versions == [{"a": 3, "b": 7, None: 0}[key]] * len(got.token_ids)
    assert outs["a"].completions[0].token_ids != outs[None].completions[0].token_ids  # the adapter does something


@pytest.mark.slow
def test_new_adapter_version_recomputes_only_its_requests(tmp_path: Path) -> None:
    name = "qwen3-test"
    _, dir_1 = random_adapter(name, tmp_path / "v1", seed=1)
    model_2, dir_2 = random_adapter(name, tmp_path / "v2", seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    with torch.inference_mode():
        served = engine(build_model(ModelConfig(name=name)), name)
        try:
            served.load_adapter("a", dir_1, 1).result()
            served.pause().result()
            running = served.submit(PROMPT, params, adapter="a")
            other = served.submit(PROMPT, params)
            served.resume().result()
            while served.stats().decode_steps < 3:
                pass
            served.load_adapter("a", dir_2, 2).result()
            got, base = running.result().completions[0], other.result().completions[0]
            assert served.adapters == {"a": 2}
            assert served.unload_adapter("a").result() == 0 and served.adapters == {}
        finally:
            served.stop()
    versions = got.policy_versions
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
    assert base.policy_versions == [0] * len(base.token_ids)
    # the tokens tagged with version 2 are what version 2 computes given the prefix
    first = versions.index(2)
    ref_model = merged(name, model_2)
    with torch.no_grad():
        logits = ref_model(torch.tensor([PROMPT + got.token_ids]))[0].float()
    logp = torch.log_softmax(logits[:, : build_tokenizer(ModelConfig(name=name)).vocab_size], -1)  # the real ids
    for i in range(first, len(got.token_ids)):
        assert abs(float(logp[len(PROMPT) + i - 1, got.token_ids[i]]) - got.logprobs[i]) < 1e-4


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_dynamic_lora_routes(tmp_path: Path) -> None:
    name = "qwen3-test"
    _, dir_a = random_adapter(name, tmp_path / "a", seed=1)
    served = engine(build_model(ModelConfig(name=name)), name)
    try:
        with BackgroundServer(served, build_tokenizer(ModelConfig(name=name)), model_name=name) as server:
            url = server.url
            load = {"lora_name": "run-a", "lora_path": str(dir_a), "load_inplace": True, "version": 4}
            assert post(url, "/v1/load_lora_adapter", load) == (200, {"lora_name": "run-a", "version": 4})
            assert post(url, "/v1/load_lora_adapter", {**load, "version": 3})[0] == 409
            assert post(url, "/v1/load_lora_adapter", {**load, "load_inplace": False})[0] == 400
            status, err = post(url, "/v1/load_lora_adapter", {**load, "lora_path": str(tmp_path), "version": 5})
            assert status == 400 and err["error"]["param"] == "lora_path"  # not an adapter: version 4 stays
            with urllib.request.urlopen(url + "/v1/models") as r:
                models = json.loads(r.read())["data"]
            assert [(m["id"], m["parent"]) for m in models] == [(name, None), ("run-a", name)]
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
            status, out = post(url, "/v1/completions", {**body, "model": "run-a"})
            assert status == 200 and out["choices"][0]["adapter"] == "run-a"
            assert out["choices"][0]["policy_versions"] == [4] * 4
            status, out = post(url, "/v1/completions", {**body, "model": name})
            assert out["choices"][0]["adapter"] is None and out["choices"][0]["policy_versions"] == [0] * 4
            assert post(url, "/v1/unload_lora_adapter", {"lora_name": "run-a"}) == (
                200,
                {"lora_name": "run-a", "version": 4},
            )
            assert post(url, "/v1/unload_lora_adapter", {"lora_name": "run-a"})[0] == 404
            assert post(url, "/v1/unload_lora_adapter", {"lora_name": "../x"})[0] == 400
    finally:
        served.stop()
