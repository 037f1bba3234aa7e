"""HTTP plumbing shared by arbor's servers (the inference server, the router and the agents' gateway).

One error shape, `{"error": {"message", "type", "param"}}` as OpenAI and vLLM answer; a middleware that turns
every failure into it (client input a 4xx naming the field, anything else a logged 500) so a server never dies
on a request; strict parsing of JSON bodies and typed fields; binding an app (`start_site`) and announcing its URL in a ready
file (`write_ready_file`). Shared here so that no server package imports another for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from arbor.run_dir import write_text_atomic

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HTTPError(Exception):
    """A request the server refuses: answered with `status` and a message naming `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class BadRequest(HTTPError):
    """Invalid client input: a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param)


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param}}, status=status)


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
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return error_response(e.status, f"{e.reason}: {request.method} {request.path}", None, kind)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("request %s %s failed", request.method, request.path)
            return error_response(500, str(e) or type(e).__name__, None, "internal_error")

    return errors


async def read_json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
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
    return value


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Binds `app`; returns the runner and the base URL (with the real port when `port` is 0)."""
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its engine request.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
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
