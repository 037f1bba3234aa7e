"""HTTP plumbing shared by arbor's servers (the inference server, the router and the agents' gateway).

One error shape, `{"error": {"message", "type", "param"}}` as OpenAI and vLLM answer, for every failure: a
middleware turns client input into a 4xx naming the field and anything else into a logged 500 naming the request
(method, path, request id), so a server never dies on a request; `start_site` gives aiohttp's own error pages
(an unparseable request, a handler timeout) the same shape. Strict parsing of JSON bodies (`read_json_object`,
`parse_json`: malformed, too deeply nested, lone surrogates, non-finite numbers and unreadable compressed bodies
are all 400s) and of typed fields (`get_field`, `get_int`, `get_float`); binding an app (`start_site`) and
announcing its URL in a ready file (`write_ready_file`). Shared here so that no server package imports another
for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from arbor.run_dir import write_text_atomic
from arbor.transport.errors import BadRequest, HTTPError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a JSON body may have (tool schemas need a dozen levels at most)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param}}, status=status)


def error_kind(status: int) -> str:
    """The OpenAI error `type` of an HTTP status."""
    if status >= 500:
        return "internal_error"
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error"
    )


def relayed_error(status: int, raw: bytes, source: str) -> web.Response:
    """An upstream server's refusal (`source`: who answered) in the one error shape: an OpenAI-style error as it
    is (with `type` and `param` filled in where missing), anything else (FastAPI's `{"detail": ...}`, plain text)
    as the message."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return web.json_response({"error": {"type": error_kind(status), "param": None, **error}}, status=status)
    detail = body.get("detail") if isinstance(body, dict) else None
    message = detail if isinstance(detail, str) else raw.decode(errors="replace")[:500] or f"status {status}"
    return error_response(status, f"{source}: {message}", None, error_kind(status))


def error_middleware(log: logging.Logger, client_errors: tuple[type[Exception], ...] = ()):
    """Turns every failure into the JSON error shape. `client_errors` are further exception types that mean bad
    input (400 with `str(e)`, and `e.param` when they have one)."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HTTPError as e:
            return error_response(e.status, e.message, e.param, e.kind)
        except client_errors as e:
            return error_response(400, str(e), getattr(e, "param", None))
        except web.HTTPException as e:  # unknown routes, wrong methods, oversized bodies: from aiohttp itself
            if e.status < 400:
                raise
            message = f"{e.reason}: {request.method} {request.path}"
            if e.status == 413:
                message += f" ({e.text})"  # aiohttp's text names the limit and the size sent
            return error_response(e.status, message, None, error_kind(e.status))
        except web.RequestPayloadError as e:  # aiohttp could not decode the body (a bad gzip or deflate stream)
            return error_response(400, f"the request body could not be read: {_payload_reason(e)}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            ref = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
            log.exception("request %s %s (%s) failed", request.method, request.path, ref)
            return error_response(
                500,
                f"{request.method} {request.path} (request {ref}) failed: {type(e).__name__}: {e}",
                None,
                "internal_error",
            )

    return errors


def _payload_reason(e: BaseException) -> str:
    cause = e.__cause__
    return getattr(cause, "message", None) or str(cause or e).strip() or type(e).__name__


def parse_json(raw: bytes | str) -> Any:
    """`raw` as JSON, checked by `check_json`; malformed or unreadable text is a 400."""
    try:
        value = json.loads(raw)
    except RecursionError:  # the decoder's own recursion limit, far past MAX_JSON_DEPTH
        raise BadRequest(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of more digits than Python converts
        raise BadRequest(f"malformed JSON body: {e}") from None
    check_json(value)
    return value


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuses (400, naming the top-level field) JSON nested deeper than `max_depth`, a string or key holding a
    lone UTF-16 surrogate (no UTF-8 encoding exists: a tokenizer or a client encoding it would fail), and NaN or
    Infinity (Python's JSON reader takes them; no sampling or reward field means anything by them)."""
    stack: list[tuple[Any, int, str | None]] = [(value, 0, None)]
    while stack:
        node, depth, field = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise BadRequest(f"{field or 'the body'} holds a lone UTF-16 surrogate (not valid Unicode)", field)
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise BadRequest(f"{field or 'the body'} holds a non-finite number ({node})", field)
        elif isinstance(node, (list, dict)):
            if depth >= max_depth:
                raise BadRequest(f"{field or 'the body'} is nested deeper than {max_depth} levels", field)
            if isinstance(node, dict):
                for k, v in node.items():
                    name = field if depth else k
                    if _SURROGATE.search(k):
                        raise BadRequest(f"{name!r} holds a lone UTF-16 surrogate (not valid Unicode)", name)
                    if type(v) is not int:  # token-id lists are long: skip what needs no check
                        stack.append((v, depth + 1, name))
            else:
                stack.extend((v, depth + 1, field) for v in node if type(v) is not int)


async def read_json_object(request: web.Request) -> dict[str, Any]:
    body = parse_json(await request.read())
    if not isinstance(body, dict):
        raise BadRequest(f"the JSON body must be an object, got {type(body).__name__}")
    return body


def get_field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    """`body[name]` when it is one of `kinds` (absent or null: `default`), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass: accept it only where bool is asked for.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{name} must be {want}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{name} must be finite, got {value}", name)
    return value


def get_int(body: dict[str, Any], name: str, default: Any, lo: int, hi: int) -> Any:
    """An integer field within [lo, hi] (absent or null: `default`, unchecked), else a 400 naming it."""
    value = get_field(body, name, (int,), None)
    if value is None:
        return default
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def get_float(body: dict[str, Any], name: str, default: Any, lo: float, hi: float) -> Any:
    """A finite number within [lo, hi] as a float (absent or null: `default`), else a 400 naming it."""
    value = get_field(body, name, (int, float), None)
    if value is None:
        return default
    try:
        value = float(value)
    except OverflowError:  # an integer past the float range
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got an integer of {len(str(value))} digits", name) from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


class _JSONErrorProtocol(RequestHandler):
    """aiohttp's own error pages (a request its parser refuses, a handler timeout) in the JSON error shape."""

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response had begun
        text = message if message and status != 500 else HTTPStatus(status).phrase
        resp = error_response(status, text, None, error_kind(status))
        resp.force_close()
        return resp


class _JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JSONErrorProtocol(self, loop=self._loop, **self._kwargs)


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Binds `app`; returns the runner and the base URL (with the real port when `port` is 0)."""
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its engine request.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    # aiohttp offers no hook for the pages its protocol writes itself: its server (the connection factory) is
    # given a subclass that only builds connections whose `handle_error` answers in the JSON error shape.
    assert runner.server is not None and type(runner.server) is web.Server
    runner.server.__class__ = _JSONErrorServer
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(e.errno, f"cannot bind {host}:{port}: {e.strerror}") from None
    bound = runner.addresses[0][1]
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return runner, f"http://{shown}:{bound}"


def write_ready_file(path: str | Path, url: str) -> None:
    """Writes the URL atomically, so a launcher polling for the file never reads a partial one."""
    write_text_atomic(Path(path), url + "\n")
