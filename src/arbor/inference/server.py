"""The `inference` process: an OpenAI/vLLM-compatible HTTP server (aiohttp) in front of the local engine.

It serves completions and chat completions with arbor's extensions (per-token policy versions, routed experts,
prompt logprobs for a distillation teacher), the admin routes (weight updates, pause/resume, aborts, LoRA
adapters) and /health, /v1/models, /metrics. Every field is checked at the edge: bad input gets a 4xx naming the
field and never kills the server; a dead engine makes /health non-200 and the process exit 1, so that `rl`
restarts it. `main` hands the config to the backend `inference.backend` names (this server, or the vLLM proxy).

Details: docs/inference.md, "The HTTP API".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import SecretStr

from arbor.checkpoint_manifest import stop_cleanly
from arbor.colocate import host_memory, reset_peak
from arbor.config.admin import require_admin_token
from arbor.config.inference import InferenceConfig
from arbor.config.loader import load_config, main_guard
from arbor.inference import openai_api as api
from arbor.inference.engine.params import (
    EngineBusy,
    EngineUnavailable,
    InvalidRequest,
    SamplingParams,
    WeightUpdateError,
)
from arbor.models.tokenizer import Tokenizer
from arbor.monitor.heartbeat import beat, install
from arbor.transport import chat
from arbor.transport.adapter_admin import AdapterLoad, AdapterUpdates, model_cards, requested_adapter
from arbor.transport.admin import WeightUpdate, WeightUpdates, admin_guard, sleep_level
from arbor.transport.expert_routes import encode_routes
from arbor.transport.fields import CHAT, COMPLETIONS
from arbor.transport.http import (
    BadRequest,
    Handler,
    HTTPError,
    error_middleware,
    read_json_object,
    start_site,
    write_ready_file,
)

if TYPE_CHECKING:  # annotations only: the engine module loads torch, which `main` defers past the config
    from arbor.inference.engine.core import Engine, RequestOutput

log = logging.getLogger("arbor.inference.server")


def _usage(outputs: list["RequestOutput"]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.completions)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---- handlers ----


@web.middleware
async def _engine_unavailable(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A stopped or dead engine is a 503 (the router then tries another backend), not a 500."""
    try:
        return await handler(request)
    except EngineUnavailable as e:
        raise HTTPError(503, str(e), None, "unavailable") from None


class InferenceServer:
    """The aiohttp application around one started engine. `admin_token` guards the admin routes (None: open);
    `weights` is the /update_weights policy (default: any directory, for an in-process server)."""

    def __init__(
        self,
        engine: "Engine",
        tokenizer: Tokenizer,
        model_name: str,
        admin_token: SecretStr | None = None,
        weights: WeightUpdates | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.admin_token = admin_token
        self.weights = weights or WeightUpdates(None)
        self.lora = AdapterUpdates(self.weights)
        self.started = time.time()

    def app(self) -> web.Application:
        middlewares = [admin_guard(self.admin_token), error_middleware(log, (InvalidRequest,)), _engine_unavailable]
        app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/metrics", self.metrics),
                web.post("/update_weights", self.update_weights),
                web.post("/pause", self.pause),
                web.post("/resume", self.resume),
                web.post("/sleep", self.sleep),
                web.post("/wake_up", self.wake_up),
                web.post("/abort_requests", self.abort_requests),
                web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
            ]
        )
        return app

    async def _generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        param: str,
        request_id: str | None = None,
        adapter: str | None = None,
        images: dict | None = None,
    ) -> list["RequestOutput"]:
        for p in prompts:  # validate every prompt before queuing any, so a bad one leaves nothing running
            try:
                self.engine.check(p, params, adapter)
            except InvalidRequest as e:
                raise BadRequest(str(e), param if e.param == "prompt" else e.param) from None
        try:
            futures = [self.engine.submit(p, params, request_id, adapter, images) for p in prompts]
        except InvalidRequest as e:  # images for a text-only model
            raise BadRequest(str(e), "images") from None
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        finally:
            for f in futures:  # a disconnected client or a failed sibling: free the engine's slots
                f.cancel()

    async def completions(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        api.check_request(body, COMPLETIONS)
        prompts = api.prompts(body, self.tokenizer)
        logprobs = body.get("logprobs")
        params = api.sampling_params(body, body.get("max_tokens") or 16, logprobs or 0, self.engine.max_batch_size)
        prompt_lps = body.get("prompt_logprobs")
        params = dataclasses.replace(params, prompt_logprobs=prompt_lps)
        return_ids, as_ids = bool(body.get("return_token_ids")), bool(body.get("return_tokens_as_token_ids"))
        adapter = requested_adapter(body, self.engine.adapters)
        images = api.prompt_images(body, prompts)
        outputs = await self._generate(prompts, params, "prompt", api.request_id(request, body), adapter, images)
        choices = []
        for pi, out in enumerate(outputs):
            for c in out.completions:
                choice: dict[str, Any] = {
                    "index": pi * params.n + c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "logprobs": api.completion_logprobs(self.tokenizer, c, as_ids) if logprobs is not None else None,
                }
                if return_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                    choice["token_ids"] = c.token_ids
                if prompt_lps is not None:
                    choice["prompt_logprobs"] = api.prompt_logprobs(self.tokenizer, out.prompt_logprobs or [])
                choice["policy_versions"] = c.policy_versions
                choice["adapter"] = adapter
                if c.routed_experts is not None:  # arbor extension: router replay (MoE)
                    choice["routed_experts"] = encode_routes(c.routed_experts)
                choices.append(choice)
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(outputs),
            }
        )

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        api.check_request(body, CHAT)
        messages = chat.parse_messages(body)
        tools, parse_calls = chat.chat_tools(body)
        want_logprobs, top = bool(body.get("logprobs")), body.get("top_logprobs") or 0
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except Exception as e:  # a template that rejects these messages is the client's problem
            raise BadRequest(f"messages could not be rendered with the chat template: {e}", "messages") from None
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None:  # as vLLM: fill the rest of the context
            max_tokens = max(1, self.engine.seq_len - len(prompt))
        params = api.sampling_params(body, max_tokens, top if want_logprobs else 0, self.engine.max_batch_size)
        return_ids, as_ids = bool(body.get("return_token_ids")), bool(body.get("return_tokens_as_token_ids"))
        adapter = requested_adapter(body, self.engine.adapters)
        (out,) = await self._generate([prompt], params, "messages", api.request_id(request, body), adapter)
        choices = []
        for c in out.completions:
            message, finish = (
                chat.assistant_message(c.text, c.finish_reason)
                if parse_calls
                else ({"role": "assistant", "content": c.text}, c.finish_reason)
            )
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
                "logprobs": api.chat_logprobs(self.tokenizer, c, as_ids) if want_logprobs else None,
            }
            if return_ids:
                choice["token_ids"] = c.token_ids
            choice["policy_versions"] = c.policy_versions
            choice["adapter"] = adapter
            if c.routed_experts is not None:
                choice["routed_experts"] = encode_routes(c.routed_experts)
            choices.append(choice)
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage([out]),
        }
        if return_ids:
            response["prompt_token_ids"] = out.prompt_token_ids
        return web.json_response(response)

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.alive:  # the router ejects this backend; the process exits for `rl` to restart it
            failure = self.engine.failure
            return web.json_response(
                {
                    "status": "failed" if failure else "stopped",
                    "policy_version": self.engine.version,
                    "error": repr(failure) if failure else "inference engine stopped",
                },
                status=503,
            )
        return web.json_response(
            {"status": "ok", "policy_version": self.engine.version, "sleeping": self.engine.sleeping}
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": model_cards(self.model_name, int(self.started), self.engine.seq_len, self.engine.adapters),
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        s = self.engine.stats()
        rows = [
            ("running", "gauge", "Sequences being decoded", s.running),
            ("waiting", "gauge", "Sequences queued for a free KV-cache slot", s.waiting),
            ("paused", "gauge", "1 while scheduling is paused", int(s.paused)),
            ("sleeping", "gauge", "Sleep level: 0 awake, 1 KV cache released, 2 weights too", s.sleeping),
            ("policy_version", "gauge", "Policy version of the loaded weights", s.policy_version),
            ("max_decode_batch", "gauge", "Largest decode batch seen", s.max_decode_batch),
            ("generated_tokens_total", "counter", "Tokens generated", s.generated_tokens),
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled", s.prompt_tokens),
            ("requests_total", "counter", "Requests admitted", s.requests),
            ("decode_steps_total", "counter", "Batched decode steps", s.decode_steps),
            ("decode_tokens_total", "counter", "Tokens appended by decode steps", s.decode_tokens),
            ("decode_seq_steps_total", "counter", "Sequences decoded, summed over decode steps", s.decode_seq_steps),
            ("decode_seconds_total", "counter", "Seconds spent in decode steps", round(s.decode_seconds, 6)),
            (
                "decode_tokens_per_second",
                "gauge",
                "Decode tokens per second of decoding since start",
                s.decode_tokens / s.decode_seconds if s.decode_seconds > 0 else 0.0,
            ),
            ("spec_draft_tokens_total", "counter", "Speculative decoding: drafts verified", s.draft_tokens),
            ("spec_accepted_tokens_total", "counter", "Speculative decoding: drafts accepted", s.accepted_draft_tokens),
            (
                "spec_acceptance_rate",
                "gauge",
                "Speculative decoding: drafts accepted / verified since start",
                s.accepted_draft_tokens / s.draft_tokens if s.draft_tokens else 0.0,
            ),
            (
                "spec_mean_accepted_length",
                "gauge",
                "Tokens a sequence gains per decode step since start",
                s.decode_tokens / s.decode_seq_steps if s.decode_seq_steps else 0.0,
            ),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP arbor_{name} {help_text}", f"# TYPE arbor_{name} {kind}", f"arbor_{name} {value}"]
        return web.Response(
            body=("\n".join(lines) + "\n").encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def update_weights(self, request: web.Request) -> web.Response:
        return await self.weights.handle(request, lambda: self.engine.version, self._load)

    async def _load(self, update: WeightUpdate) -> int:
        try:
            return await asyncio.wrap_future(self.engine.update_weights(update.path, update.version))
        except WeightUpdateError as e:  # an allowed directory whose weights do not fit: the old ones stay
            raise BadRequest(str(e), "path") from None

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self.lora.load(request, lambda: self.engine.adapters, self._load_adapter)

    async def _load_adapter(self, load: AdapterLoad) -> int:
        try:
            return await asyncio.wrap_future(self.engine.load_adapter(load.name, load.path, load.version))
        except WeightUpdateError as e:  # an allowed directory that is no adapter for this model: nothing changes
            raise BadRequest(str(e), "lora_path") from None

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self.lora.unload(
            request, lambda: self.engine.adapters, lambda name: asyncio.wrap_future(self.engine.unload_adapter(name))
        )

    async def pause(self, request: web.Request) -> web.Response:
        return web.json_response({"paused": await asyncio.wrap_future(self.engine.pause())})

    async def abort_requests(self, request: web.Request) -> web.Response:
        ids = api.abort_ids(await read_json_object(request))
        return web.json_response({"aborted": await asyncio.wrap_future(self.engine.abort(ids))})

    async def resume(self, request: web.Request) -> web.Response:
        return web.json_response({"paused": await asyncio.wrap_future(self.engine.resume())})

    async def sleep(self, request: web.Request) -> web.Response:
        """A colocated run's train phase: the KV cache released, and by default (level 2) the weights too, which
        the run's next `/update_weights` fills again (on a CPU engine there is no other host to offload them to)."""
        level = await sleep_level(request, 2)
        awake = host_memory()  # the generate phase's resident memory, at its end and at its peak
        try:
            released = await asyncio.wrap_future(self.engine.sleep(level))
        except EngineBusy as e:
            raise HTTPError(409, str(e), None) from None
        reset_peak()
        figures = {f"awake_{k}": v for k, v in awake.items()}
        return web.json_response({"sleeping": level, "released_bytes": released, **figures})

    async def wake_up(self, request: web.Request) -> web.Response:
        asleep = host_memory()  # the train phase's, while the engine held nothing
        held = await asyncio.wrap_future(self.engine.wake_up())
        reset_peak()
        figures = {f"asleep_{k}": v for k, v in asleep.items()}
        return web.json_response({"sleeping": 0, "held_bytes": held, **figures})


# ---- running ----


class BackgroundServer:
    """Serves an engine from an event loop in a daemon thread (tests, notebooks); `url` once constructed."""

    def __init__(
        self,
        engine: "Engine",
        tokenizer: Tokenizer,
        model_name: str = "arbor",
        host: str = "127.0.0.1",
        port: int = 0,
        admin_token: SecretStr | None = None,
        weight_roots: list[Path] | None = None,
        frozen: bool = False,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="arbor-http", daemon=True)
        self._thread.start()
        app = InferenceServer(engine, tokenizer, model_name, admin_token, WeightUpdates(weight_roots, frozen)).app()
        try:
            self._runner, self.url = asyncio.run_coroutine_threadsafe(start_site(app, host, port), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._stop_loop()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def serve(cfg: InferenceConfig, engine: "Engine", tokenizer: Tokenizer) -> int:
    """Serves until SIGTERM or SIGINT (returns 0) or until the engine loop dies (returns 1, so that the launcher
    restarts this server)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = InferenceServer(engine, tokenizer, cfg.model.name, cfg.admin_token, WeightUpdates.of(cfg))
    runner, url = await start_site(server.app(), cfg.host, cfg.port)
    tasks: list[asyncio.Task] = []
    try:
        if cfg.ready_file:
            write_ready_file(cfg.ready_file, url)
        log.info("inference ready at %s", url)
        if cfg.output_dir is not None:
            tasks.append(loop.create_task(_heartbeats(cfg, engine)))
        signalled, died = loop.create_task(stop.wait()), loop.create_task(_until_dead(engine))
        tasks += [signalled, died]
        await asyncio.wait([signalled, died], return_when=asyncio.FIRST_COMPLETED)
        if not signalled.done():
            log.error(
                "the inference engine loop died (%r): exiting for the launcher to restart this server", engine.failure
            )
            return 1
        log.info("shutting down")
        # Stop the engine first: its unfinished requests fail at once instead of holding up the HTTP shutdown.
        await asyncio.to_thread(engine.stop)
        return 0
    finally:
        for t in tasks:
            t.cancel()
        await runner.cleanup()


async def _until_dead(engine: "Engine") -> None:
    """Returns once the engine loop has died on its own (never after a clean stop: that is `serve`'s own)."""
    while engine.failure is None:
        await asyncio.sleep(0.5)


async def _heartbeats(cfg: InferenceConfig, engine: "Engine") -> None:
    install(cfg.output_dir, "inference", "serving")
    while True:  # the event loop beats, so a blocked loop shows as a stale heartbeat
        s = engine.stats()
        beat(f"serving policy version {s.policy_version}: {s.running} running, {s.waiting} waiting")
        await asyncio.sleep(2.0)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(InferenceConfig, argv, prog="inference")  # before torch: a bad config fails fast
    require_admin_token(cfg.host, cfg.admin_token, "admin_token")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the backend loads its engine (torch, vLLM) only now; a model it cannot build is one line, no traceback
    return stop_cleanly(lambda: cfg.engine_backend().serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
