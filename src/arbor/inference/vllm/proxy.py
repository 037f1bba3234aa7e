"""The vLLM backend's HTTP app: arbor's API in front of vLLM's OpenAI server (started by arbor.inference.vllm.server).

Completions are streamed upstream and reassembled so every token gets the policy version current when it arrived
(arbor.inference.vllm.reassemble), `/update_weights` goes through the worker extension's `collective_rpc` (files or
NCCL), and it serves `/abort_requests`, the dynamic-LoRA routes, `/pause`, `/resume`, `/sleep` and `/wake_up`. A
proxy because vLLM's own endpoints neither load a new directory every step with requests in flight nor track
per-token versions (docs/inference.md, "vLLM behind a proxy"). Imports without vLLM."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from arbor.config.inference import InferenceConfig
from arbor.inference.vllm.images import GENERATE_PATH, VisionLayout, completion_chunk, generate_request
from arbor.inference.vllm.reassemble import Reassembler, read_stream, render_request, stream_status
from arbor.transport import fields
from arbor.transport.adapter_admin import AdapterLoad, AdapterUpdates, requested_adapter
from arbor.transport.admin import WeightUpdate, WeightUpdates, admin_guard, sleep_level
from arbor.transport.chat import chat_tools
from arbor.transport.fields import CHAT, COMPLETIONS
from arbor.transport.http import (
    HTTPError,
    error_middleware,
    get_field,
    read_json_object,
    relayed_error,
)

log = logging.getLogger("arbor.inference.vllm")

ABORT_MEMORY = 65536
"""Aborted request ids the proxy remembers (for requests that arrive after their abort)."""
WORKER_METHODS = {"filesystem": "arbor_load_dir", "nccl": "arbor_load_nccl"}


def rpc_request(method: str, args: list[Any], timeout: float) -> dict[str, Any]:
    """A vLLM `/collective_rpc` body calling one worker-extension method on every worker."""
    return {"method": method, "args": args, "kwargs": {}, "timeout": timeout}


class VLLMProxy:
    """arbor's API in front of one vLLM server at `upstream`."""

    def __init__(self, upstream: str, cfg: InferenceConfig, vision: VisionLayout | None = None) -> None:
        self.upstream, self.cfg = upstream.rstrip("/"), cfg
        self.vision = vision
        """The served model's image layout (a vision-language model), for token prompts with `images`."""
        self.version = 0
        self._open = asyncio.Event()
        self._open.set()
        self._awake = asyncio.Event()  # cleared between /sleep and /wake_up: requests wait, vLLM holds no weights
        self._awake.set()
        self.sleeping = 0
        self.weights = WeightUpdates.of(cfg)
        self.lora = AdapterUpdates(self.weights)
        self.adapters: dict[str, int] = {}
        """Loaded LoRA adapters: name -> version."""
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[str | None, set[asyncio.Event]] = {}  # request id -> its abort signals
        self._aborted_ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[admin_guard(self.cfg.admin_token), error_middleware(log)], client_max_size=256 * 1024 * 1024
        )
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.completions),
                web.get("/health", self.health),
                web.post("/update_weights", self.update_weights),
                web.post("/pause", self.pause),
                web.post("/resume", self.resume),
                web.post("/sleep", self.sleep),
                web.post("/wake_up", self.wake_up),
                web.post("/abort_requests", self.abort_requests),
                web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
                web.route("*", "/{tail:.*}", self.forward),
            ]
        )

        async def startup(_: web.Application) -> None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
            )

        async def cleanup(_: web.Application) -> None:
            if self._session is not None:
                await self._session.close()

        app.on_startup.append(startup)
        app.on_cleanup.append(cleanup)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        chat = request.path.endswith("/chat/completions")
        body = await read_json_object(request)  # malformed, too deep, surrogates, NaN: a 400 before vLLM sees it
        fields.validate(body, CHAT if chat else COMPLETIONS)  # the request schema, as the local server and the router
        if get_field(body, "stream", (bool,), False):
            raise HTTPError(
                400,
                "stream is not supported: the proxy answers whole completions (with token ids, "
                "logprobs and policy versions)",
                "stream",
            )
        images = not chat and body.get("images") is not None
        if images and self.cfg.router_replay:
            raise HTTPError(400, "images with inference.router_replay are served by the local backend only", "images")
        await self._open.wait()
        await self._awake.wait()
        want = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        adapter = requested_adapter(body, self.adapters)
        if not chat and body.get("prompt_logprobs") is not None and not images:
            return await self._scored(request.path, body, adapter)
        path, forwarded, convert = self._upstream_request(request.path, body, chat, adapter, images)
        tools, parse_calls = chat_tools(body) if chat else (None, False)
        if tools is not None:
            # vLLM runs with no tool parser: "none" still renders the tools (its default) and leaves the calls in
            # the text, which the proxy parses as the local server does ("auto" would be refused upstream).
            forwarded["tool_choice"] = "none"
        acc = Reassembler(chat, want, adapter, parse_calls)
        rid = body.get("request_id") if isinstance(body.get("request_id"), str) else request.headers.get("X-Request-Id")
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        if rid is not None and rid in self._aborted_ids:
            acc.abort(n)
            return web.json_response(acc.response())
        stop = asyncio.Event()
        self._inflight.setdefault(rid, set()).add(stop)
        try:
            async with self._session.post(self.upstream + path, json=forwarded) as resp:
                if resp.status != 200:
                    return relayed_error(resp.status, await resp.read(), "vLLM")
                reader = asyncio.create_task(read_stream(resp.content, acc, lambda: self._version(adapter), convert))
                aborted = asyncio.create_task(stop.wait())
                await asyncio.wait({reader, aborted}, return_when=asyncio.FIRST_COMPLETED)
                if not reader.done():  # aborted: hang up on vLLM (it aborts the request) and answer what came
                    reader.cancel()
                    resp.close()
                    acc.abort(n)
                else:
                    aborted.cancel()
                    error = reader.result()
                    if error is not None:  # vLLM reports a failure inside the stream: its own code if a 4xx
                        return relayed_error(stream_status(error), json.dumps({"error": error}).encode(), "vLLM")
        finally:
            self._inflight[rid].discard(stop)
            if not self._inflight[rid]:
                del self._inflight[rid]
        return web.json_response(acc.response())

    def _upstream_request(
        self, path: str, body: dict[str, Any], chat: bool, adapter: str | None, images: bool
    ) -> tuple[str, dict[str, Any], Any]:
        """vLLM's route, the body sent there and the converter of its stream chunks (None: completions chunks
        already). A token prompt with `images` goes to vLLM's token-in route with the images' features
        (arbor.inference.vllm.images); anything else to the route it came to."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        salt = salt or f"policy-{self._version(adapter)}"
        # A loaded adapter by its name; any other model is the base (as the local engine does); vLLM checks it.
        model = adapter or self.cfg.model.name
        if not images:
            forwarded = render_request(body, chat, salt, self.cfg.router_replay)
            forwarded["model"] = model
            return path, forwarded, None
        version = f"{salt}/v{self._version(adapter)}"  # the weights vLLM holds, whatever the client's salt says
        forwarded = generate_request(body, self.vision, model, salt, version)
        if body.get("logprobs") is None:
            forwarded["sampling_params"]["logprobs"] = 0  # as render_request: dropped again below if unasked
        prompt_ids = body["prompt"]
        return GENERATE_PATH, forwarded, lambda chunk: completion_chunk(chunk, prompt_ids)

    async def _scored(self, path: str, body: dict[str, Any], adapter: str | None) -> web.Response:
        """A completion with `prompt_logprobs`, forwarded non-streamed (the module docstring); vLLM's reply with
        arbor's per-choice `policy_versions` and `adapter`, and `logprobs` only if asked."""
        assert self._session is not None
        version = self._version(adapter)
        forwarded = render_request(body, False, f"policy-{version}", self.cfg.router_replay)
        forwarded.pop("stream_options")
        forwarded["stream"] = False
        forwarded["model"] = adapter or self.cfg.model.name
        async with self._session.post(self.upstream + path, json=forwarded) as resp:
            if resp.status != 200:
                return relayed_error(resp.status, await resp.read(), "vLLM")
            data = await resp.json()
        for choice in data.get("choices") or []:
            choice["policy_versions"] = [version] * len(choice.get("token_ids") or [])
            choice["adapter"] = adapter
            if body.get("logprobs") is None:
                choice["logprobs"] = None
        return web.json_response(data)

    def _version(self, adapter: str | None) -> int:
        """The version a token is tagged with: its adapter's, else the base weights'."""
        return self.version if adapter is None else self.adapters.get(adapter, self.version)

    async def abort_requests(self, request: web.Request) -> web.Response:
        ids = (await read_json_object(request)).get("request_ids")
        if ids != "all" and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise HTTPError(400, 'request_ids must be a list of ids or "all"', "request_ids")
        keys = list(self._inflight) if ids == "all" else ids
        if ids != "all":
            for rid in ids:
                self._aborted_ids[rid] = None
            while len(self._aborted_ids) > ABORT_MEMORY:
                self._aborted_ids.popitem(last=False)
        hit = [ev for k in keys for ev in self._inflight.get(k, ())]
        for ev in hit:
            ev.set()
        return web.json_response({"aborted": len(hit)})

    async def _rpc(self, method: str, args: list[Any]) -> Any:
        assert self._session is not None
        timeout = self.cfg.vllm.rpc_timeout
        async with self._session.post(
            self.upstream + "/collective_rpc",
            json=rpc_request(method, args, timeout),
            timeout=aiohttp.ClientTimeout(total=timeout + 30),
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"vLLM collective_rpc {method} failed ({r.status}): {(await r.text())[:500]}")
            return await r.json()

    async def update_weights(self, request: web.Request) -> web.Response:
        return await self.weights.handle(request, lambda: self.version, self._load)

    async def _load(self, update: WeightUpdate) -> int:
        w = self.cfg.weights
        path = str(update.path)
        args: list[Any] = (
            [path, w.verify_checksums, w.timeout]
            if w.kind == "filesystem"
            else [
                path,
                w.nccl_host,
                w.nccl_port,
                1 + self.cfg.replica * self.workers(),
                w.nccl_inference_ranks + 1,
                w.timeout,
            ]
        )
        try:
            await self._rpc(WORKER_METHODS[w.kind], args)
            # The reload empties the workers' encoder cache but not the scheduler's record of it: a later image
            # the scheduler counts as encoded would miss (and kill the engine). Both are reset here.
            resets = ["/reset_prefix_cache", *(["/reset_encoder_cache"] if self.vision else [])]
            for route in resets:
                async with self._session.post(self.upstream + route) as r:  # type: ignore[union-attr]
                    await r.read()
        except (TimeoutError, RuntimeError, aiohttp.ClientError) as e:
            raise HTTPError(500, str(e), None, "internal_error") from None
        self.version = update.version
        return update.version

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self.lora.load(request, lambda: dict(self.adapters), self._load_adapter)

    async def _load_adapter(self, load: AdapterLoad) -> int:
        body = {"lora_name": load.name, "lora_path": str(load.path), "load_inplace": load.name in self.adapters}
        await self._upstream_admin("/v1/load_lora_adapter", body)
        self.adapters[load.name] = load.version
        return load.version

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        async def unload(name: str) -> None:
            await self._upstream_admin("/v1/unload_lora_adapter", {"lora_name": name})
            del self.adapters[name]

        return await self.lora.unload(request, lambda: dict(self.adapters), unload)

    async def _upstream_admin(self, path: str, body: dict[str, Any]) -> None:
        """POSTs to one of vLLM's own admin routes; its refusal (a bad adapter: 4xx) is this route's 400."""
        assert self._session is not None
        async with self._session.post(self.upstream + path, json=body) as r:
            text = await r.text()
        if r.status >= 500:
            raise HTTPError(500, f"vLLM {path} failed ({r.status}): {text[:500]}", None, "internal_error")
        if r.status != 200:
            raise HTTPError(400, f"vLLM refused {path} ({r.status}): {text[:500]}", "lora_path")

    def workers(self) -> int:
        return self.cfg.vllm.tensor_parallel_size * self.cfg.vllm.data_parallel_size

    async def pause(self, request: web.Request) -> web.Response:
        self._open.clear()
        return web.json_response({"paused": True})

    async def resume(self, request: web.Request) -> web.Response:
        self._open.set()
        return web.json_response({"paused": False})

    async def sleep(self, request: web.Request) -> web.Response:
        """vLLM's sleep mode (`--enable-sleep-mode`, which `inference.colocate` turns on): level 1 (the default)
        offloads the weights to host memory and drops the KV cache; 2 discards the weights too. Requests arriving
        meanwhile wait for `/wake_up`."""
        level = await sleep_level(request, 1)
        self._awake.clear()
        await self._upstream_post(f"/sleep?level={level}")
        self.sleeping = level
        return web.json_response({"sleeping": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        """Weights back on the GPU (level 1: from host memory), the KV cache allocated again and its prefix cache
        emptied; the `/update_weights` that follows in a colocated run loads the new policy in place."""
        await self._upstream_post("/wake_up")
        await self._upstream_post("/reset_prefix_cache")
        self.sleeping = 0
        self._awake.set()
        return web.json_response({"sleeping": 0})

    async def _upstream_post(self, path: str) -> None:
        """POSTs to one of vLLM's dev-mode routes, bounded by `vllm.rpc_timeout`; a failure is a 500 in one line."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.cfg.vllm.rpc_timeout)
        try:
            async with self._session.post(self.upstream + path, timeout=timeout) as r:
                text = await r.text()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise HTTPError(500, f"vLLM {path} failed: {e!r}", None, "internal_error") from None
        if r.status != 200:
            raise HTTPError(500, f"vLLM {path} failed ({r.status}): {text[:500]}", None, "internal_error")

    async def health(self, request: web.Request) -> web.Response:
        assert self._session is not None
        try:
            async with self._session.get(self.upstream + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                ok = r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        return web.json_response(
            {"status": "ok" if ok else "unavailable", "policy_version": self.version, "sleeping": self.sleeping},
            status=200 if ok else 503,
        )

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        async with self._session.request(
            request.method,
            self.upstream + request.rel_url.raw_path_qs,
            data=await request.read(),
            headers={"Content-Type": request.content_type},
        ) as r:
            if r.status >= 400:
                return relayed_error(r.status, await r.read(), "vLLM")
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
