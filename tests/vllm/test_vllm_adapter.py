"""The vLLM backend without vLLM: command line, request rendering, and the proxy against a fake vLLM server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from arbor.config.inference import InferenceConfig
from arbor.config.loader import ConfigError
from arbor.inference.vllm import launch as vllm_launch
from arbor.inference.vllm import model_dir as vllm_model
from arbor.inference.vllm import server as vllm_server
from arbor.inference.vllm.launch import E8M0_ENV, dry_run_command, render_extra, serve_argv, serve_env
from arbor.inference.vllm.proxy import VLLMProxy, rpc_request
from arbor.inference.vllm.reassemble import render_request
from arbor.models import PRESETS
from arbor.models.hf import hf_config
from arbor.models.tokenizer import ByteTokenizer
from arbor.run_dir import broadcast_dir, broadcasts_root
from arbor.transport.http import start_site


def _flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        if argv[i].startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[argv[i]] = nxt
            i += 2 if nxt is not None else 1
        else:
            i += 1
    return out


def test_serve_command_line_renders_every_option() -> None:
    cfg = InferenceConfig.model_validate(
        {
            "model": {"name": "/models/qwen"},
            "seq_len": 4096,
            "seed": 7,
            "router_replay": True,
            "vllm": {
                "tensor_parallel_size": 2,
                "data_parallel_size": 4,
                "enable_expert_parallel": True,
                "gpu_memory_utilization": 0.8,
                "dtype": "bfloat16",
                "enforce_eager": True,
                "enable_prefix_caching": False,
                "max_num_seqs": 256,
                "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                "kv_offloading_backend": "native",
                "kv_offloading_size": 64,
                "extra_args": {
                    "max_num_batched_tokens": 8192,
                    "enable_chunked_prefill": True,
                    "disable_log_stats": False,
                    "compilation_config": {"level": 3},
                    "api_key": None,
                },
            },
        }
    )
    argv = serve_argv(cfg, "/models/qwen", 9123)
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/qwen"]
    f = _flags(argv)
    assert f["--host"] == "127.0.0.1" and f["--port"] == "9123" and f["--served-model-name"] == "/models/qwen"
    assert f["--tensor-parallel-size"] == "2" and f["--data-parallel-size"] == "4" and "--enable-expert-parallel" in f
    assert f["--gpu-memory-utilization"] == "0.8" and f["--max-model-len"] == "4096" and f["--dtype"] == "bfloat16"
    assert f["--seed"] == "7" and f["--logprobs-mode"] == "processed_logprobs"
    assert f["--worker-extension-cls"] == "arbor.inference.vllm.worker.WeightUpdateExtension"
    assert "--enforce-eager" in f and "--no-enable-prefix-caching" in f and "--enable-prefix-caching" not in f
    assert f["--max-num-seqs"] == "256"
    assert json.loads(f["--kv-transfer-config"]) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert f["--kv-offloading-backend"] == "native" and f["--kv-offloading-size"] == "64.0"
    assert "--enable-return-routed-experts" in f and "--skip-tokenizer-init" not in f
    assert f["--max-num-batched-tokens"] == "8192" and "--enable-chunked-prefill" in f
    assert "--disable-log-stats" not in f and "--api-key" not in f
    assert json.loads(f["--compilation-config"]) == {"level": 3}
    plain = _flags(serve_argv(InferenceConfig(), "/tmp/m", 1, skip_tokenizer=True))
    assert "--enable-prefix-caching" in plain and "--enforce-eager" not in plain and "--skip-tokenizer-init" in plain
    assert "--kv-transfer-config" not in plain and "--enable-return-routed-experts" not in plain
    assert render_extra({"x": [1, 2]}) == ["--x", "1", "2"]
    assert serve_env({})["VLLM_SERVER_DEV_MODE"] == "1"
    assert "vllm" not in sys.modules, "rendering must not import vLLM"


def test_cpu_build_defaults_and_dry_run(monkeypatch) -> None:
    """The CPU build: eager mode and the model's dtype unless set, KV space and thread binding in the
    environment; `rl --dry-run` shows the command with its environment."""
    import importlib

    cfg = InferenceConfig.model_validate({"model": {"name": "qwen3-tiny"}, "vllm": {"cpu_kvcache_space": 3}})
    cpu = _flags(serve_argv(cfg, "/m", 1, cpu=True))
    assert "--enforce-eager" in cpu and cpu["--dtype"] == "float32" and "--no-enable-chunked-prefill" in cpu
    gpu = _flags(serve_argv(cfg, "/m", 1))
    assert "--enforce-eager" not in gpu and gpu["--dtype"] == "auto" and "--no-enable-chunked-prefill" not in gpu
    set_cfg = InferenceConfig.model_validate({"vllm": {"enforce_eager": False, "dtype": "bfloat16"}})
    assert "--enforce-eager" not in _flags(serve_argv(set_cfg, "/m", 1, cpu=True))
    env = serve_env({}, cfg, cpu=True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert "VLLM_CPU_KVCACHE_SPACE" not in serve_env({}, cfg)
    monkeypatch.setattr(vllm_launch, "vllm_build", lambda: "cpu")
    line = dry_run_command(cfg)
    prefix = "ARBOR_VLLM_FP32_ROUTER=1 ARBOR_VLLM_VOCAB_SIZE=259 "  # the router plugin's switch, the padding bound
    assert line.startswith(prefix) and line.startswith("VLLM_CPU_KVCACHE_SPACE=3 ", len(prefix))
    assert "vllm.entrypoints.openai.api_server --model " in line
    # the preset's head (264 rows) outgrows the byte tokenizer (259 ids): the dry run shows the padding mask too
    assert f"--logits-processors {vllm_launch.PADDING_MASK}" in line
    assert str(vllm_launch.materialized_path(cfg, False)) in line and "--enforce-eager" in line
    assert importlib.import_module("arbor.inference.vllm.worker").WeightUpdateExtension.__name__ in line


def test_padding_rows_are_masked_when_the_head_outgrows_the_tokenizer(tmp_path) -> None:
    """A preset's head has 264 rows for the byte tokenizer's 259 ids: the server gets the padding mask and its
    bound; a checkpoint whose head matches its tokenizer, or one served on ids only, gets neither."""
    preset = InferenceConfig.model_validate({"model": {"name": "qwen3-tiny"}})
    assert vllm_launch.padding_bound(preset, skip_tokenizer=False) == 259
    argv = serve_argv(preset, "/m", 1, mask_padding=True)
    assert (
        _flags(argv)["--logits-processors"] == vllm_launch.PADDING_MASK == "arbor.inference.vllm.logits:PaddingRowsMask"
    )
    assert serve_env({}, preset, vocab=259)[vllm_launch.VOCAB_ENV] == "259"
    assert "--logits-processors" not in serve_argv(preset, "/m", 1) and vllm_launch.VOCAB_ENV not in serve_env({})
    exact = tmp_path / "exact"  # a checkpoint directory whose head has exactly the tokenizer's rows
    exact.mkdir()
    (exact / "config.json").write_text(
        json.dumps(hf_config(dataclasses.replace(PRESETS["qwen3-test"], vocab_size=259)))
    )
    ByteTokenizer().save(exact)
    assert vllm_launch.padding_bound(InferenceConfig.model_validate({"model": {"name": str(exact)}}), False) is None
    assert vllm_launch.padding_bound(preset, skip_tokenizer=True) is None
    # vLLM 0.32 refuses custom logits processors under speculative decoding: no mask there
    speculative = InferenceConfig.model_validate({"model": {"name": "qwen3-tiny"}, "speculative": {"enabled": True}})
    assert vllm_launch.padding_bound(speculative, skip_tokenizer=False) is None


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="kv_offloading_size"):
        InferenceConfig.model_validate({"vllm": {"kv_offloading_backend": "native"}})
    with pytest.raises(ValueError, match="weights.kind"):
        InferenceConfig.model_validate({"weights": {"kind": "nccl"}})
    InferenceConfig.model_validate({"backend": "vllm", "weights": {"kind": "nccl"}})
    with pytest.raises(ValueError, match="nccl_inference_ranks"):
        InferenceConfig.model_validate({"backend": "vllm", "replicas": 2, "weights": {"kind": "nccl"}})


def test_request_rendering() -> None:
    body = {"prompt": [1, 2], "max_tokens": 4, "n": 2}
    out = render_request(body, chat=False, cache_salt="policy-3", router_replay=True)
    assert out["stream"] and out["stream_options"] == {"include_usage": True} and out["return_token_ids"]
    assert out["cache_salt"] == "policy-3" and out["logprobs"] == 0 and out["return_routed_experts"]
    assert "stream" not in body, "the caller's body is not modified"
    mine = render_request({**body, "cache_salt": "policy-9"}, chat=True, cache_salt="policy-3", router_replay=False)
    assert mine["cache_salt"] == "policy-9" and "logprobs" not in mine and "return_routed_experts" not in mine
    assert rpc_request("arbor_load_dir", ["/p", True, 5.0], 30) == {
        "method": "arbor_load_dir",
        "args": ["/p", True, 5.0],
        "kwargs": {},
        "timeout": 30,
    }


@pytest.mark.slow
def test_missing_vllm_fails_with_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(vllm_server.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="uv sync --extra gpu"):
        vllm_server.require_vllm()
    # Both entry points, in a fresh interpreter where vLLM is not importable even if installed.
    for module, extra in (("arbor.inference.server", []), ("arbor.launch.rl", ["--output-dir", str(tmp_path / "r")])):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import importlib.util as u, sys; _f = u.find_spec; "
                "u.find_spec = lambda n, *a, **k: None if n == 'vllm' else _f(n, *a, **k); "
                f"from {module} import main; sys.exit(main(sys.argv[1:]))",
                "--backend" if module.endswith("server") else "--inference.backend",
                "vllm",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "vllm" in proc.stderr.lower(), proc.stderr


class FakeVLLM:
    """Streams completions chunk by chunk like `vllm serve` (token ids, logprobs, routed experts)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.rpcs: list[dict[str, Any]] = []
        self.resets = 0
        self.tick = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.requests.append(body)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chat = request.path.endswith("chat/completions")
            if body.get("prompt") == [666]:
                await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                return resp
            if chat and body.get("tools"):  # a model calling the first tool, its call in the text (no parser)
                name = body["tools"][0]["function"]["name"]
                call = f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>'
                chunk = {
                    "id": "x",
                    "created": 1,
                    "model": "m",
                    "choices": [{"index": 0, "token_ids": [5], "delta": {"content": call}, "finish_reason": "stop"}],
                }
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
                return resp
            for j in range(body["max_tokens"]):
                if body["max_tokens"] > 4 and j == 3:
                    await self.tick.wait()  # the test updates weights while this request is in flight
                c: dict[str, Any] = {
                    "index": 0,
                    "token_ids": [10 + j],
                    "routed_experts": [[j, j + 1]],
                    "finish_reason": "length" if j == body["max_tokens"] - 1 else None,
                }
                if chat:
                    c["delta"] = {"content": chr(97 + j)}
                    c["logprobs"] = {
                        "content": [{"token": chr(97 + j), "logprob": -0.5 * j, "bytes": [97 + j], "top_logprobs": []}]
                    }
                else:
                    c["text"] = chr(97 + j)
                    c["logprobs"] = {
                        "tokens": [chr(97 + j)],
                        "token_logprobs": [-0.5 * j],
                        "top_logprobs": [{chr(97 + j): -0.5 * j}],
                    }
                chunk = {"id": "x", "created": 1, "model": "m", "choices": [c]}
                if j == 0:
                    chunk["choices"][0]["prompt_token_ids"] = body["prompt"] if not chat else None
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0)
            await resp.write(
                b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": %d}}\n\n'
                % body["max_tokens"]
            )
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def rpc(request: web.Request) -> web.Response:
            self.rpcs.append(await request.json())
            return web.json_response({"results": [3]})

        async def reset(request: web.Request) -> web.Response:
            self.resets += 1
            return web.Response(text="")

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="")

        app.add_routes(
            [
                web.post("/v1/completions", completions),
                web.post("/v1/chat/completions", completions),
                web.post("/collective_rpc", rpc),
                web.post("/reset_prefix_cache", reset),
                web.get("/health", health),
            ]
        )
        return app


def test_proxy_tags_tokens_with_versions_and_updates_through_collective_rpc(tmp_path) -> None:
    async def go() -> None:
        fake = FakeVLLM()
        up_runner, up = await start_site(fake.app(), "127.0.0.1", 0)
        cfg = InferenceConfig.model_validate(
            {"backend": "vllm", "router_replay": True, "replica": 1, "vllm": {"tensor_parallel_size": 2}}
        )
        runner, url = await start_site(VLLMProxy(up, cfg).app(), "127.0.0.1", 0)
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200 and (await r.json())["policy_version"] == 0
            fake.tick.set()
            async with s.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "logprobs": 0}) as r:
                data = await r.json()
            (c,) = data["choices"]
            assert c["token_ids"] == [10, 11, 12] and c["policy_versions"] == [0, 0, 0] and c["text"] == "abc"
            assert c["logprobs"]["token_logprobs"] == [0.0, -0.5, -1.0] and c["logprobs"]["text_offset"] == [0, 1, 2]
            assert c["routed_experts"] == [[0, 1], [1, 2], [2, 3]] and c["finish_reason"] == "length"
            assert c["prompt_token_ids"] == [1, 2] and data["usage"]["completion_tokens"] == 3
            assert fake.requests[-1]["cache_salt"] == "policy-0" and fake.requests[-1]["stream"]
            fake.tick.clear()
            pending = asyncio.create_task(
                s.post(
                    url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "logprobs": True},
                )
            )
            while len(fake.requests) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # three tokens have streamed at version 0
            async with s.post(url + "/update_weights", json={"path": str(tmp_path), "version": 4}) as r:
                assert r.status == 200 and (await r.json())["policy_version"] == 4
            fake.tick.set()
            async with await pending as r:
                data = await r.json()
            (c,) = data["choices"]
            assert c["policy_versions"] == [0, 0, 0, 4, 4, 4] and c["message"]["content"] == "abcdef"
            assert len(c["logprobs"]["content"]) == 6
            assert fake.rpcs == [
                {"method": "arbor_load_dir", "args": [str(tmp_path), True, 600.0], "kwargs": {}, "timeout": 600.0}
            ]
            assert fake.resets == 1
            async with s.post(url + "/update_weights", json={"path": str(tmp_path / "missing"), "version": 5}) as r:
                assert r.status == 400 and "missing" in (await r.json())["error"]["message"]
            async with s.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}) as r:
                assert (await r.json())["choices"][0]["logprobs"] is None  # not asked for, not returned
            assert fake.requests[-1]["cache_salt"] == "policy-4"
            async with s.post(url + "/v1/completions", json={"prompt": [666], "max_tokens": 2}) as r:
                assert r.status == 500 and "engine died" in (await r.json())["error"]["message"]
            async with s.post(url + "/pause") as r:
                assert (await r.json())["paused"]
            held = asyncio.create_task(s.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}))
            await asyncio.sleep(0.2)
            assert not held.done() and len(fake.requests) == 4  # held in the proxy
            await s.post(url + "/resume")
            async with await held as r:
                assert r.status == 200
        await runner.cleanup()
        await up_runner.cleanup()

    asyncio.run(go())


def test_proxy_renders_tools_upstream_and_answers_tool_calls_as_the_local_server() -> None:
    """vLLM runs without a tool parser: the proxy forwards `tool_choice: "none"` (the template still renders the
    tools) and parses the reply's `<tool_call>` blocks itself, as the local server does; a forced call is refused
    before vLLM sees it."""

    async def go() -> None:
        fake = FakeVLLM()
        up_runner, up = await start_site(fake.app(), "127.0.0.1", 0)
        runner, url = await start_site(
            VLLMProxy(up, InferenceConfig.model_validate({"backend": "vllm"})).app(), "127.0.0.1", 0
        )
        body = {
            "messages": [{"role": "user", "content": "add"}],
            "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "add"}}],
        }
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                (c,) = (await r.json())["choices"]
            assert fake.requests[-1]["tool_choice"] == "none" and fake.requests[-1]["tools"] == body["tools"]
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
            assert [t["function"] for t in c["message"]["tool_calls"]] == [{"name": "add", "arguments": "{}"}]
            async with s.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none"}) as r:
                (c,) = (await r.json())["choices"]
            assert "<tool_call>" in c["message"]["content"] and "tool_calls" not in c["message"]
            sent = len(fake.requests)
            async with s.post(url + "/v1/chat/completions", json={**body, "tool_choice": "required"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "tool_choice"
            assert len(fake.requests) == sent
        await runner.cleanup()
        await up_runner.cleanup()

    asyncio.run(go())


def test_nccl_update_sends_the_workers_group_coordinates(tmp_path) -> None:
    async def go() -> None:
        fake = FakeVLLM()
        up_runner, up = await start_site(fake.app(), "127.0.0.1", 0)
        cfg = InferenceConfig.model_validate(
            {
                "backend": "vllm",
                "replicas": 2,
                "replica": 1,
                "vllm": {"tensor_parallel_size": 2},
                "weights": {"kind": "nccl", "nccl_port": 4000, "nccl_inference_ranks": 4},
            }
        )
        runner, url = await start_site(VLLMProxy(up, cfg).app(), "127.0.0.1", 0)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/update_weights", json={"path": str(tmp_path), "version": 1}) as r:
                assert r.status == 200
        # replica 1 with TP=2: its workers are ranks 3 and 4 of a 5-rank group (the trainer is rank 0)
        assert fake.rpcs[0]["method"] == "arbor_load_nccl"
        assert fake.rpcs[0]["args"] == [str(tmp_path), "127.0.0.1", 4000, 3, 5, 600.0]
        await runner.cleanup()
        await up_runner.cleanup()

    asyncio.run(go())


def test_proxy_guards_admin_and_vllm_routes_and_loads_only_newer_versions_from_the_run(tmp_path) -> None:
    async def go() -> None:
        fake = FakeVLLM()
        fake.tick.set()
        up_runner, up = await start_site(fake.app(), "127.0.0.1", 0)
        step1, outside = broadcast_dir(tmp_path, 1), tmp_path / "outside"
        step1.mkdir(parents=True)
        outside.mkdir()
        (broadcasts_root(tmp_path) / "step_2").symlink_to(outside)
        cfg = InferenceConfig.model_validate({"backend": "vllm", "output_dir": str(tmp_path), "admin_token": "tok"})
        runner, url = await start_site(VLLMProxy(up, cfg).app(), "127.0.0.1", 0)
        auth = {"Authorization": "Bearer tok"}
        async with aiohttp.ClientSession() as s:
            for path, body in [
                ("/update_weights", {"path": str(step1), "version": 1}),
                ("/pause", {}),
                ("/resume", {}),
                ("/abort_requests", {"request_ids": "all"}),
                ("/collective_rpc", {"method": "anything"}),
                ("/reset_prefix_cache", {}),
            ]:
                for headers in ({}, {"Authorization": "Bearer nope"}):
                    async with s.post(url + path, json=body, headers=headers) as r:
                        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error", path
            assert fake.rpcs == [] and fake.resets == 0  # nothing reached vLLM
            async with s.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}) as r:
                assert r.status == 200  # the OpenAI routes stay open
            async with s.get(url + "/health") as r:
                assert r.status == 200
            answers = []
            for path in [
                str(outside),
                str(broadcasts_root(tmp_path) / "step_2"),
                f"{step1}/../../outside",
                str(broadcasts_root(tmp_path) / "step_7"),
            ]:
                async with s.post(url + "/update_weights", json={"path": path, "version": 1}, headers=auth) as r:
                    assert r.status == 400
                    answers.append((await r.json())["error"]["message"].replace(repr(path), "<path>"))
            assert len(set(answers)) == 1 and fake.rpcs == []
            async with s.post(url + "/update_weights", json={"path": str(step1), "version": 1}, headers=auth) as r:
                assert r.status == 200 and (await r.json())["policy_version"] == 1
            assert fake.rpcs[-1]["args"][0] == str(step1.resolve())
            for version, status in [(1, 200), (0, 409), (2**70, 400)]:  # equal: a no-op; older: refused
                async with s.post(
                    url + "/update_weights", json={"path": str(step1), "version": version}, headers=auth
                ) as r:
                    assert r.status == status, version
            assert len(fake.rpcs) == 1
            async with s.post(url + "/reset_prefix_cache", headers=auth) as r:
                assert r.status == 200  # vLLM's own routes, with the token
        await runner.cleanup()
        await up_runner.cleanup()

    asyncio.run(go())


def test_a_kept_preset_directory_gets_the_current_tokenizer_export(tmp_path, monkeypatch) -> None:
    """vLLM serves a preset from a directory written once and kept across runs (and arbor versions): its
    tokenizer export (the chat template vLLM renders) is refreshed at each start, the weights left alone."""
    monkeypatch.setattr(vllm_launch.tempfile, "gettempdir", lambda: str(tmp_path))
    cfg = InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "qwen3-test"}})
    out = Path(vllm_model.model_dir(cfg)[0])
    config = out / "tokenizer_config.json"
    current = config.read_text()
    config.write_text(json.dumps({**json.loads(current), "chat_template": "{{ messages }}"}))  # an older export
    weights = {p: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    assert vllm_model.model_dir(cfg)[0] == str(out)
    assert config.read_text() == current
    assert weights and {p: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == weights


def test_fp8_serving_holds_vllm_to_the_trainers_float_scales():
    """vLLM's DeepGEMM path rounds FP8 scales to powers of two (UE8M0) unless told otherwise; the trainer's are
    float32 (arbor.models.fp8). An FP8 server gets the setting explicitly, over an inherited environment's value,
    and it shows in the dry run's command line; a bf16 server is left as it is."""
    fp8 = InferenceConfig(backend="vllm", model={"name": "qwen3-tiny", "fp8": "block"})
    assert serve_env({E8M0_ENV: "1"}, fp8)[E8M0_ENV] == "0"
    assert f"{E8M0_ENV}=0" in dry_run_command(fp8)
    plain = InferenceConfig(backend="vllm", model={"name": "qwen3-tiny"})
    assert E8M0_ENV not in serve_env({}, plain)
    assert serve_env({E8M0_ENV: "1"}, plain)[E8M0_ENV] == "1"
