"""vLLM's LoRA support behind arbor: the rendered command line, the proxy's dynamic-LoRA routes against a fake
vLLM, and (GPU) adapter hot-swap on a real vLLM server giving the logprobs of the merged model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from test_lora_engine import PROMPT, merged, random_adapter
from vllm_server import post_json, vllm_server

from arbor.config.inference import InferenceConfig
from arbor.config.model import ModelConfig
from arbor.inference.vllm.launch import serve_argv, serve_env
from arbor.inference.vllm.proxy import VLLMProxy
from arbor.models import build_tokenizer
from arbor.transport.http import start_site

VLLM_MODEL = "qwen3-tiny"
"""The preset the vLLM tests serve (vLLM's CPU attention has no kernel for qwen3-test's 8-wide heads)."""


def test_lora_flags_and_runtime_updating_are_rendered() -> None:
    cfg = InferenceConfig.model_validate(
        {"model": {"name": "m", "lora": {"rank": 8}}, "max_loras": 3, "max_lora_rank": 24}
    )
    argv = serve_argv(cfg, "/models/m", 9000)
    i = argv.index("--enable-lora")
    assert argv[i + 1 : i + 5] == ["--max-loras", "3", "--max-lora-rank", "32"]  # rounded up to a rank vLLM takes
    assert serve_env({}, cfg)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = InferenceConfig.model_validate({"model": {"name": "m"}})
    assert "--enable-lora" not in serve_argv(plain, "/models/m", 9000)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in serve_env({}, plain)
    forced = InferenceConfig.model_validate({"model": {"name": "m"}, "vllm": {"enable_lora": True}})
    assert "--enable-lora" in serve_argv(forced, "/models/m", 9000)


class FakeLoRAVLLM:
    """Streams two tokens per completion and accepts vLLM's LoRA admin routes."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.admin: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.requests.append(body)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for j in range(2):
                c = {
                    "index": 0,
                    "token_ids": [7 + j],
                    "text": "x",
                    "finish_reason": "length" if j else None,
                    "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0], "top_logprobs": [{}]},
                }
                await resp.write(
                    b"data: "
                    + json.dumps({"id": "i", "created": 1, "model": body["model"], "choices": [c]}).encode()
                    + b"\n\n"
                )
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def admin(request: web.Request) -> web.Response:
            body = await request.json()
            self.admin.append((request.path, body))
            if body.get("lora_path", "").endswith("broken"):
                return web.json_response({"message": "not an adapter", "code": 400}, status=400)
            return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}'")

        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", completions),
                web.post("/v1/load_lora_adapter", admin),
                web.post("/v1/unload_lora_adapter", admin),
            ]
        )
        return app


def test_proxy_forwards_adapter_loads_and_tags_tokens_with_the_adapters_version(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "broken").mkdir()

    async def go() -> None:
        fake = FakeLoRAVLLM()
        up_runner, up = await start_site(fake.app(), "127.0.0.1", 0)
        cfg = InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "base", "lora": {}}})
        runner, url = await start_site(VLLMProxy(up, cfg).app(), "127.0.0.1", 0)
        async with aiohttp.ClientSession() as s:
            load = {"lora_name": "run", "lora_path": str(tmp_path / "v1"), "load_inplace": True, "version": 3}
            async with s.post(url + "/v1/load_lora_adapter", json=load) as r:
                assert r.status == 200 and await r.json() == {"lora_name": "run", "version": 3}
            async with s.post(url + "/v1/load_lora_adapter", json={**load, "version": 4}) as r:
                assert r.status == 200
            async with s.post(
                url + "/v1/load_lora_adapter", json={**load, "lora_path": str(tmp_path / "broken"), "version": 5}
            ) as r:
                assert r.status == 400  # vLLM refused it: version 4 stays
            assert [b.get("load_inplace") for _, b in fake.admin] == [False, True, True]
            assert all("version" not in b for _, b in fake.admin)  # arbor's field stays in the proxy
            body = {"prompt": [1], "max_tokens": 2, "logprobs": 0}
            async with s.post(url + "/v1/completions", json={**body, "model": "run"}) as r:
                (c,) = (await r.json())["choices"]
            assert fake.requests[-1]["model"] == "run" and c["policy_versions"] == [4, 4] and c["adapter"] == "run"
            async with s.post(url + "/v1/completions", json={**body, "model": "other"}) as r:
                (c,) = (await r.json())["choices"]
            assert fake.requests[-1]["model"] == "base" and c["policy_versions"] == [0, 0] and c["adapter"] is None
            async with s.post(url + "/v1/unload_lora_adapter", json={"lora_name": "run"}) as r:
                assert r.status == 200
            async with s.post(url + "/v1/unload_lora_adapter", json={"lora_name": "run"}) as r:
                assert r.status == 404
        await runner.cleanup()
        await up_runner.cleanup()

    asyncio.run(go())


def check_hot_swap(
    url: str, tmp_path: Path, tol: float, targets: list[str] | None = None, adapter: str = "run"
) -> None:
    """Loads two versions of an adapter by name into the server at `url`; each serves the logprobs of the merged
    model (within `tol`; with an adapter on the tied head, which cannot be merged, of the adapted model itself)
    and tags its tokens with its version and the adapter's name."""
    name = VLLM_MODEL
    vocab = build_tokenizer(ModelConfig(name=name)).vocab_size
    for version in (1, 2):
        model, path = random_adapter(name, tmp_path / f"v{version}", seed=version, rank=8, targets=targets)
        load = {"lora_name": adapter, "lora_path": str(path), "load_inplace": True, "version": version}
        assert post_json(url, "/v1/load_lora_adapter", load)["version"] == version
        out = post_json(
            url,
            "/v1/completions",
            {
                "model": adapter,
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 0,
                "return_token_ids": True,
            },
        )
        (c,) = out["choices"]
        assert c["adapter"] == adapter and c["policy_versions"] == [version] * len(c["token_ids"])
        with torch.no_grad():
            reference = model if targets and "lm_head" in targets else merged(name, model)
            logits = reference(torch.tensor([PROMPT + c["token_ids"]]))[0].float()
        # vLLM's processed logprobs are renormalised over the tokenizer's ids: the adapter masks the head's padding
        # rows (arbor.inference.vllm.logits)
        logp = torch.log_softmax(logits[..., :vocab], -1)
        want = [float(logp[len(PROMPT) + i - 1, t]) for i, t in enumerate(c["token_ids"])]
        assert max(abs(a - b) for a, b in zip(c["logprobs"]["token_logprobs"], want)) < tol


@pytest.mark.gpu(reason="vLLM's CUDA build serving LoRA adapters: bf16 Punica kernels on a GPU")
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_hot_swaps_adapters_with_merged_model_logprobs(tmp_path: Path) -> None:
    """On a GPU: vLLM serving a LoRA adapter through arbor's proxy gives (within kernel noise) the logprobs of the
    merged model, and a new version swaps in by name."""
    with vllm_server(tmp_path, VLLM_MODEL, 256, "--model.lora.rank", "8") as url:
        check_hot_swap(url, tmp_path, 1e-3)


@pytest.fixture(scope="module")
def vllm_lora_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM (CPU build here) server with LoRA enabled for the module's `vllm` tests."""
    with vllm_server(tmp_path_factory.mktemp("vllm-lora"), VLLM_MODEL, 256, "--model.lora.rank", "8") as url:
        yield url


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)  # the module's server starts inside this test's budget: minutes on busy CPU cores
def test_vllm_cpu_hot_swaps_adapters_with_merged_model_logprobs(vllm_lora_url: str, tmp_path: Path) -> None:
    """vLLM's CPU build serves adapters loaded at run time, in fp32: the merged model's logprobs, swapped by name."""
    check_hot_swap(vllm_lora_url, tmp_path, 1e-4)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_vllm_cpu_serves_an_adapter_on_the_tied_head(vllm_lora_url: str, tmp_path: Path) -> None:
    """An adapter with `lm_head` among its targets (the head's weight tied to the embeddings, as on the presets):
    vLLM applies it to the output projection only, as arbor's trainer and engine do."""
    check_hot_swap(vllm_lora_url, tmp_path, 1e-4, targets=["q_proj", "down_proj", "lm_head"], adapter="head")
