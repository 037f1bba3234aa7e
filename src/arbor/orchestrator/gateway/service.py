"""The gateway: an OpenAI-compatible server that records a black-box agent's model calls as training samples.

An agent that only knows the `openai` package is pointed at a session. The gateway renders each call with the
chat template itself, generates on the inference fleet, records the tokens token-exactly in the session's
trajectory and answers with ordinary OpenAI JSON (chat, Responses and completions APIs, streamed or not). Sampling
follows the run, not the agent, because the trainer's importance ratios assume the run's distribution. For a
vision-language model, chat `image_url` and Responses `input_image` parts (data URLs, local paths) are rendered
by its processor and their pixel inputs recorded beside the ids; a text model refuses them in one line.

Parts: the session store (.sessions), the OpenAI translation (.openai_wire), the handlers (.routes), and here the
server that composes them: the route table, auth and the body limit, start/stop, the session API for in-process use.
Details: docs/agents.md, "The gateway for black-box agents" and its subsections.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from arbor.config.orchestrator import LOOPBACK
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.gateway.openai_wire import RunSampling
from arbor.orchestrator.gateway.routes import OpenAIRoutes, SessionRoutes, session_url
from arbor.orchestrator.gateway.sessions import GatewayCounts, Session, SessionStore
from arbor.transport.http import Handler, error_middleware, error_response, start_site

if TYPE_CHECKING:
    from arbor.config.orchestrator import GatewayConfig
    from arbor.orchestrator.client import InferenceClient

__all__ = ["Gateway", "Session"]

log = logging.getLogger("arbor.orchestrator.gateway.service")


def _counter(counts: GatewayCounts):
    """The outermost middleware: counts every refused request by status class (after the JSON error shape)."""

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        resp = await handler(request)
        if resp.status >= 400:
            counts.rejected[f"{resp.status // 100}xx"] += 1
        return resp

    return count


def _guard(cfg: "GatewayConfig"):
    """The middleware that refuses a request without the API key (401) or with a declared oversize body (413)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = cfg.api_key
        if key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
            # aiohttp reads header bytes that are not UTF-8 into lone surrogates: encode them back, never fail
            if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode()):
                return error_response(
                    401, "missing or wrong API key (Authorization: Bearer <key>)", None, "authentication_error"
                )
        # aiohttp reads lazily: refuse a declared oversize body before reading any of it.
        if request.content_length is not None and request.content_length > cfg.max_request_bytes:
            return error_response(
                413, f"request body of {request.content_length} bytes exceeds {cfg.max_request_bytes}"
            )
        return await handler(request)

    return guard


class Gateway:
    """The session store served over HTTP; runs on the caller's event loop (the orchestrator's)."""

    def __init__(
        self,
        client: "InferenceClient",
        tokenizer: Tokenizer,
        cfg: "GatewayConfig",
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seq_len: int,
    ) -> None:
        self.client, self.tokenizer, self.cfg = client, tokenizer, cfg
        self.store = SessionStore(tokenizer, cfg.max_open_sessions)
        self.sessions: dict[str, Session] = self.store.sessions  # the store's own dict, kept current by it
        sampling = RunSampling(temperature, top_p, max_tokens, seq_len, cfg.override_sampling)
        self.openai = OpenAIRoutes(client, tokenizer, self.store, sampling, cfg.model_name, image_dirs(cfg))
        self.url = ""  # set by start(), once bound
        self._runner: web.AppRunner | None = None
        self.manage = SessionRoutes(self.store, lambda: self.url)

    @property
    def calls(self) -> int:
        """Model calls answered so far."""
        return self.openai.calls

    @property
    def open_sessions(self) -> int:
        """Sessions not closed yet (one closed by its reward no longer counts, though its owner still holds it)."""
        return self.store.open_count

    def figures(self) -> dict[str, int]:
        """The `gateway/...` figures of metrics.jsonl: calls, open sessions and the counters of GatewayCounts."""
        return {"gateway/calls": self.calls, "gateway/open_sessions": self.open_sessions, **self.store.counts.figures()}

    # -- session API for in-process users (the black_box environment), kept on the gateway for them --

    def open(self, session_id: str | None = None, task_id: int | str = -1, group_id: int = -1) -> Session:
        return self.store.open(session_id, task_id, group_id)

    def close(
        self, session_id: str, reward: float | None = None, components: dict[str, float] | None = None
    ) -> Session:
        return self.store.close(session_id, reward, components)

    def offer(self, session_id: str, task: str) -> None:
        """Queues a session for a remote agent to claim with POST /v1/work (pull mode)."""
        self.store.offer(session_id, task)

    async def wait_reward(self, session_id: str, timeout: float) -> bool:
        """Waits until the session is closed by a reward POST; False on timeout."""
        return await self.store.wait_reward(session_id, timeout)

    async def finish(self, session_id: str, ended: str = "abandoned") -> Session:
        """Closes (if open), waits for calls still generating, and forgets the session; returns it. Without a
        posted reward it is counted under `ended` (arbor.orchestrator.gateway.sessions.UNREWARDED)."""
        return await self.store.finish(session_id, ended)

    def abandon(self, session_id: str) -> None:
        """Forgets a session whose owner was cancelled, without waiting for its calls."""
        self.store.abandon(session_id)

    def base_url(self, session_id: str) -> str:
        """What an agent's OPENAI_BASE_URL should be for this session."""
        return session_url(self.url, session_id) + "/v1"

    def reward_url(self, session_id: str) -> str:
        """Where the session's agent POSTs its reward (`ARBOR_REWARD_URL` for a subprocess agent)."""
        return session_url(self.url, session_id) + "/reward"

    # -- the server --

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[_counter(self.store.counts), error_middleware(log), _guard(self.cfg)],
            client_max_size=self.cfg.max_request_bytes,
        )
        s, manage, openai = "/v1/sessions/{sid}", self.manage, self.openai
        app.add_routes(
            [
                web.get("/health", self.health),
                web.post("/v1/sessions", manage.open_session),
                web.post("/v1/work", manage.claim_work),
                web.get(s, manage.show_session),
                web.post(s + "/reward", manage.reward),
                web.post(s + "/v1/chat/completions", openai.chat),
                web.post(s + "/v1/responses", openai.responses),
                web.post(s + "/v1/completions", openai.completions),
                web.get(s + "/v1/models", openai.models),
                web.post("/v1/chat/completions", openai.chat),
                web.post("/v1/responses", openai.responses),
                web.post("/v1/completions", openai.completions),
                web.get("/v1/models", openai.models),
            ]
        )
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "open_sessions": self.open_sessions, "calls": self.calls})

    async def start(self) -> str:
        self._runner, self.url = await start_site(self.app(), self.cfg.host, self.cfg.port)
        log.info("gateway ready at %s (agents: OPENAI_BASE_URL=%s)", self.url, self.base_url("<session>"))
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "Gateway":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


def image_dirs(cfg: "GatewayConfig") -> list[Path] | None:
    """The directories agents' local image files must lie in (resolved), None for any (`image_dirs`' doc)."""
    if cfg.image_dirs is None:
        return None if cfg.host in LOOPBACK else []
    return [Path(d).resolve() for d in cfg.image_dirs]
