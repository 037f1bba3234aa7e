"""The router in front of N inference servers: the built-in aiohttp router, or the `vllm-router` console script.

One address for the fleet: picking policies (round_robin, least_outstanding, consistent_hash on a session id),
health checks with ejection and re-admission (replaying the current weights first), failover of failed requests
to another backend, fan-out of the admin routes, the fleet's JSON error shape and Prometheus `/metrics`.
Generation requests are checked against the request schema (arbor.transport.fields) and refused with a 400 naming
the field rather than forwarded. Little added latency: bodies forwarded as bytes, responses streamed. The rules:
docs/inference.md, "Replicas and the router"."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import Any

import aiohttp
from aiohttp import web

from arbor.config.admin import bearer_headers, require_admin_token
from arbor.config.inference import RouterConfig
from arbor.config.loader import ConfigError, load_config, main_guard
from arbor.inference.router.backends import Backend, Fleet, post_json, rendezvous
from arbor.inference.router.run_routes import RUN_KEY, RunRoutes
from arbor.inference.router.tenants import FairShare, Meter, Run, Tenants, metric_lines
from arbor.transport import fields
from arbor.transport.admin import ADMIN_ROUTES, ADMIN_UNDER_V1
from arbor.transport.http import (
    BadRequest,
    error_middleware,
    error_response,
    parse_json,
    read_json_object,
    start_site,
    write_ready_file,
)
from arbor.transport.router_wire import METRIC_PREFIX, RUN_HEADER, use_vllm_router, vllm_router_argv

log = logging.getLogger("arbor.inference.router.app")

RETRYABLE_POST = {"/v1/completions": fields.COMPLETIONS, "/v1/chat/completions": fields.CHAT}
"""The generation routes (retried on another backend on failure) and their endpoint in the request schema."""
MAX_SLOTS_PER_REQUEST = fields.MAX_N
"""Slots one request is counted for at most."""
ADMIN = ADMIN_ROUTES
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
POISON_AFTER = 2
"""A request that failed this many times (5xx, timeout or hang-up, each on its own backend) is not retried."""

__all__ = ["Backend", "Router", "main", "rendezvous", "serve", "session_key"]


def session_key(headers: Any, body: bytes) -> str | None:
    """The session id of a request: the X-Session-Id header, else the JSON body's session_id or user."""
    key = headers.get("X-Session-Id")
    if key:
        return key
    try:
        data = parse_json(body)
    except BadRequest:  # no session to find; the backend answers the malformed body itself
        return None
    if isinstance(data, dict):
        for name in ("session_id", "user"):
            if isinstance(data.get(name), (str, int)):
                return str(data[name])
    return None


def _forward_headers(request: web.Request) -> dict[str, str]:
    """The client's headers as a backend gets them: no hop-by-hop ones, and no Content-Encoding, because aiohttp
    has already decoded the body. A value that is not valid UTF-8 (aiohttp reads those into lone surrogates,
    which no HTTP client can write back) is a 400 naming the header."""
    out = {}
    for k, v in request.headers.items():
        if k.lower() in _HOP or k.lower() == "content-encoding":
            continue
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"header {k} is not valid UTF-8", k) from None
        out[k] = v
    return out


async def _head(resp: aiohttp.ClientResponse) -> str:
    """The start of a failed response's body, for the client's error message."""
    try:
        return repr(await resp.content.read(200))
    except (TimeoutError, aiohttp.ClientError) as e:
        return f"(its body could not be read: {type(e).__name__})"


@dataclasses.dataclass
class _Failure:
    """One backend's failure to serve a request."""

    backend: Backend
    reason: str
    request_fault: bool
    """A failure the request may have caused (a 5xx, a timeout, a hang-up), unlike a refused connection."""
    answered: bool = False
    """The backend answered 5xx: counted against it only if the request turns out not to be poisonous."""


class Router(RunRoutes):
    """The aiohttp app in front of the fleet: request forwarding with failover, admin fan-out, health, metrics,
    and the runs sharing it (arbor.inference.router.run_routes)."""

    def __init__(self, backends: list[str], cfg: RouterConfig) -> None:
        if not backends:
            raise ConfigError("router.backends is empty: give at least one backend URL")
        self.cfg = cfg
        self.fleet = Fleet(backends, cfg)
        self.backends = self.fleet.backends
        self.retries = self.requests = self.poisoned = 0
        self.tenants = Tenants()
        self.meter = Meter()
        self.share = FairShare(self.tenants, self.meter, self.slots)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    def slots(self) -> int | None:
        """Sequences the backends in rotation take at once (None: no bound, `backend_slots` unset)."""
        live = sum(b.healthy for b in self.backends)
        return None if self.cfg.backend_slots is None or not live else self.cfg.backend_slots * live

    @property
    def ejections(self) -> int:
        return self.fleet.ejections

    @property
    def readmissions(self) -> int:
        return self.fleet.readmissions

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout), auto_decompress=False
        )
        self._health_task = asyncio.create_task(self.fleet.health_loop(self._session))

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard, error_middleware(log)], client_max_size=256 * 1024 * 1024)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                *[web.post(p, self.admin) for p in (*ADMIN, *ADMIN_UNDER_V1)],
                web.post("/runs/register", self.register),
                web.post("/runs/unregister", self.unregister),
                web.get("/runs", self.list_runs),
                web.route("*", "/{tail:.*}", self.forward),
            ]
        )

        async def on_startup(_: web.Application) -> None:
            await self.start()

        async def on_cleanup(_: web.Application) -> None:
            await self.close()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()  # decoded: a gzip body is forwarded plain (see _forward_headers)
        if request.method == "POST" and request.path in RETRYABLE_POST:
            run, slots, request_id = self._owner(request, body)
            await self.share.acquire(run, slots)
            run.requests += 1
            if request_id is not None:
                run.request_ids.add(request_id)
            try:
                return await self._forward(request, body, run)
            finally:
                run.request_ids.discard(request_id)
                self.share.release(run, slots)
        return await self._forward(request, body, None)

    def _owner(self, request: web.Request, body: bytes) -> tuple[Run, int, str | None]:
        """The run a generation request belongs to, the slots it takes (`n`) and its request id. The body is
        checked against the request schema first (arbor.transport.fields: types and bounds, no backend's
        capabilities): garbage is answered 400 here, naming the field, rather than forwarded."""
        data = parse_json(body)
        if not isinstance(data, dict):
            raise BadRequest(f"the JSON body must be an object, got {type(data).__name__}")
        fields.validate(data, RETRYABLE_POST[request.path])
        slots = min(data.get("n") or 1, MAX_SLOTS_PER_REQUEST)
        return self.tenants.owner(request.headers.get(RUN_HEADER), data.get("model")), slots, data.get("request_id")

    async def _forward(self, request: web.Request, body: bytes, run: Run | None) -> web.StreamResponse:
        retryable = request.method == "GET" or request.path in RETRYABLE_POST
        key = session_key(request.headers, body) if self.cfg.policy == "consistent_hash" else None
        headers = _forward_headers(request)
        self.requests += 1
        tried: set[str] = set()
        failures: list[_Failure] = []
        for attempt in range((self.cfg.max_retries if retryable else 0) + 1):
            if sum(f.request_fault for f in failures) >= POISON_AFTER:
                break  # failed alike on two backends: the request itself is the likely cause, spare a third
            b = self.fleet.pick(key, tried)
            if b is None:
                break
            if attempt:
                self.retries += 1
            tried.add(b.url)
            result = await self._attempt(request, b, body, headers, retryable, run)
            if not isinstance(result, _Failure):
                for f in failures:  # another backend served it: the 5xx answers were those backends' own fault
                    if f.answered:
                        self.fleet.failed(f.backend, refused=False)
                return result
            failures.append(result)
            log.warning(
                "request %s failed on %s (%s); %s",
                request.path,
                b.url,
                result.reason,
                "retrying" if retryable else "not retried",
            )
            if not retryable:
                break
        return self._give_up(request, failures)

    async def _attempt(
        self,
        request: web.Request,
        b: Backend,
        body: bytes,
        headers: dict[str, str],
        retryable: bool,
        run: Run | None = None,
    ) -> web.StreamResponse | _Failure:
        """Sends the request to one backend: its response relayed to the client, or why it failed. Connection
        errors and timeouts count against the backend at once; a 5xx of a retryable request once the request's
        outcome is known (`forward`); a 4xx never (it is the client's)."""
        assert self._session is not None
        b.outstanding += 1
        b.requests += 1
        try:
            try:
                resp = await self._session.request(
                    request.method, b.url + request.rel_url.raw_path_qs, data=body, headers=headers
                )
            except aiohttp.ClientConnectorError as e:  # never reached it: the backend's failure, not the request's
                self.fleet.failed(b, refused=True)
                return _Failure(b, f"{type(e).__name__}: {e}", request_fault=False)
            except (TimeoutError, aiohttp.ClientConnectionError) as e:  # it hung up, or never answered
                self.fleet.failed(b, refused=False)
                return _Failure(b, f"{type(e).__name__}: {e}", request_fault=True)
            async with resp:
                if resp.status >= 500 and retryable:
                    reason = f"answered {resp.status}: {await _head(resp)}"
                    return _Failure(b, reason, request_fault=True, answered=True)
                if resp.status >= 500:
                    self.fleet.failed(b, refused=False)
                else:  # a success or the client's own error: the backend is alive and well
                    b.fails = 0
                return await self._relay(request, resp, b, run if resp.status == 200 else None)
        finally:
            b.outstanding -= 1

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, b: Backend, run: Run | None = None
    ) -> web.StreamResponse:
        """Streams a backend's response to the client, chunk by chunk; a JSON answer to `run`'s generation
        request is also kept, to count its `usage` against the run."""
        kept: list[bytes] | None = [] if run is not None and resp.content_type == "application/json" else None
        out = web.StreamResponse(
            status=resp.status, headers={k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        )
        if resp.content_length is not None:
            out.content_length = resp.content_length
        await out.prepare(request)
        chunks = resp.content.iter_any()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except (TimeoutError, aiohttp.ClientError) as e:  # the backend broke off mid-response
                log.warning("%s broke off its response to %s: %s: %s", b.url, request.path, type(e).__name__, e)
                self.fleet.failed(b, refused=False)
                out.force_close()  # the client sees a cut-short response and a closed connection
                return out
            if kept is not None:
                kept.append(chunk)
            await out.write(chunk)  # a client that hung up ends the handler here: no fault of the backend's
        await out.write_eof()
        if kept is not None and run is not None:
            try:
                self.meter.used(run, json.loads(b"".join(kept)))
            except (ValueError, AttributeError):  # not the completion shape: nothing to count
                pass
        return out

    def _give_up(self, request: web.Request, failures: list[_Failure]) -> web.Response:
        """The answer when no backend served a request; the 5xx answers of a poisonous one count against none."""
        if sum(f.request_fault for f in failures) >= POISON_AFTER:
            self.poisoned += 1
            detail = "; ".join(f"{f.backend.url}: {f.reason}" for f in failures)
            return error_response(
                502,
                f"{request.path} failed on {len(failures)} backends and is not retried on "
                f"another (the request itself is the likely cause): {detail}"[:4000],
                None,
                "upstream_error",
            )
        for f in failures:
            if f.answered:
                self.fleet.failed(f.backend, refused=False)
        last = f"{failures[-1].backend.url}: {failures[-1].reason}" if failures else "no backend in rotation"
        return error_response(503, f"no backend served {request.path}: {last}", None, "unavailable")

    async def admin(self, request: web.Request) -> web.Response:
        """Sends the call to every backend; ejected ones too (best effort: they get it again on re-admission).
        A run's token holds the call to that run (`_scoped`)."""
        body = await request.read()
        # A malformed body is refused here, once, rather than by every backend (a pause may come with no body).
        data = await read_json_object(request) if body.strip() else {}
        run = request.get(RUN_KEY)
        if run is not None:
            scoped = self._scoped(request.path, run, data)
            if isinstance(scoped, web.Response):
                return scoped
            body = scoped
        # Without a fleet token, the client's own header goes on (a run's token means nothing to a backend).
        auth = (
            bearer_headers(self.cfg.admin_token)
            if self.cfg.admin_token is not None
            else {}
            if run
            else {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        )
        return await self._fan_out(request.path, body, auth)

    async def _fan_out(self, path: str, body: bytes, auth: dict[str, str]) -> web.Response:
        assert self._session is not None
        results = await asyncio.gather(*(post_json(self._session, b, path, body, auth) for b in self.backends))
        report = {
            b.url: {"status": s, "in_rotation": b.healthy, "body": d} for b, (s, d) in zip(self.backends, results)
        }
        live = [(b, s, d) for b, (s, d) in zip(self.backends, results) if b.healthy]
        for b, (s, d) in zip(self.backends, results):
            if s == 0 and b.healthy:
                self.fleet.failed(b, refused=True)
            if s == 200 and isinstance(d, dict) and isinstance(d.get("policy_version"), int):
                b.policy_version = d["policy_version"]
        ok = [s for _, s, _ in live if 200 <= s < 300]
        bad_request = [s for _, s, _ in live if 400 <= s < 500]
        if bad_request:  # e.g. a pruned weights directory: the caller's mistake, the same on every backend
            status = bad_request[0]
        elif ok and len(ok) == sum(1 for _, s, _ in live if s != 0):
            status = 200
        else:
            status = 502 if ok or any(s for _, s, _ in live) else 503
        if status == 200:
            self.fleet.remember(path, body, auth, [d for _, s, d in live if s == 200])
        message = None if status == 200 else f"{path} failed on some backends: " + json.dumps(report)[:2000]
        versions = [d.get("policy_version") for _, s, d in live if s == 200 and isinstance(d, dict)]
        out: dict[str, Any] = {"results": report}
        if versions and all(isinstance(v, int) for v in versions):
            out["policy_version"] = min(versions)
        if message:
            out["error"] = {"message": message, "type": "fanout_error", "param": None}
        return web.json_response(out, status=status)

    async def health(self, request: web.Request) -> web.Response:
        live = [b for b in self.backends if b.healthy]
        body = {
            "status": "ok" if live else "unavailable",
            "backends": {b.url: b.healthy for b in self.backends},
            "policy_version": min((b.policy_version for b in live), default=0),
        }
        return web.json_response(body, status=200 if live else 503)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "requests": self.requests,
            "retries": self.retries,
            "poisoned": self.poisoned,
            "ejections": self.ejections,
            "readmissions": self.readmissions,
            "backends_in_rotation": sum(b.healthy for b in self.backends),
            "queued": self.share.queued_total,
        }
        for i, b in enumerate(self.backends):
            out[f"outstanding_{i}"] = b.outstanding
        return out

    async def metrics(self, request: web.Request) -> web.Response:
        lines = []
        for name, value in self.stats().items():
            if not name.startswith("outstanding_"):
                lines.append(f"{METRIC_PREFIX}{name} {value}")
        for b in self.backends:
            lines.append(f'{METRIC_PREFIX}outstanding{{backend="{b.url}"}} {b.outstanding}')
            lines.append(f'{METRIC_PREFIX}backend_healthy{{backend="{b.url}"}} {int(b.healthy)}')
            lines.append(f'{METRIC_PREFIX}backend_requests{{backend="{b.url}"}} {b.requests}')
            lines.append(f'{METRIC_PREFIX}backend_errors{{backend="{b.url}"}} {b.errors}')
        lines += metric_lines(
            METRIC_PREFIX,
            self.tenants,
            self.meter,
            None if self.cfg.backend_slots is None else self.cfg.backend_slots * len(self.backends),
        )
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def serve(cfg: RouterConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    router = Router(cfg.backends, cfg)
    runner, url = await start_site(router.app(), cfg.host, cfg.port)
    try:
        if cfg.ready_file:
            write_ready_file(cfg.ready_file, url)
        log.info("router ready at %s (%s over %d backends)", url, cfg.policy, len(cfg.backends))
        await stop.wait()
    finally:
        await runner.cleanup()


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(RouterConfig, argv, prog="router")
    require_admin_token(cfg.host, cfg.admin_token, "admin_token")
    if not cfg.backends:
        raise ConfigError("backends: give at least one backend URL (--backends '[\"http://host:port\"]')")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exe = use_vllm_router(cfg)
    if exe is not None:
        os.execv(exe, vllm_router_argv(cfg, cfg.backends, cfg.port, exe))
    try:
        asyncio.run(serve(cfg))
    except OSError as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
