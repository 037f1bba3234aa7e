"""The admin side of arbor's inference servers, shared by the local server, the vLLM proxy and the router.

Authentication: with an admin token set, every route but the open ones needs `Authorization: Bearer <token>`
(compared in constant time) or gets a 401 in the fleet's JSON error shape. Open: the OpenAI routes under `/v1/`
(bar the adapter-loading ones vLLM may expose there) and the read-only GET pages `/health`, `/metrics`, `/ping`,
`/version`. Everything else mutates a server: `/update_weights`, `/pause`, `/resume`, `/abort_requests`,
`/sleep` and `/wake_up` (a colocated run's phases: `sleep_level`), and whatever a vLLM server offers beside them
(its dev-mode `/collective_rpc` runs any worker method).

Weight updates (`WeightUpdates`, the one `/update_weights` both backends apply): `{"path", "version"}` where the
version is an int32 strictly above the loaded one (equal: a no-op answering the loaded version; lower: 409), and
the path an absolute directory without `..` segments that, symlinks resolved, lies inside an allowed root (the
run's `broadcasts/` and `inference.weight_roots`). Every refusal of a path, whether it lies outside, is missing,
is no directory or is spelt with `..`, is the same 400, so the answer never tells what exists on the machine. The
backend then loads the resolved path, so a symlink swapped after the check cannot redirect the load. Updates
are serialized: two racing ones cannot both pass the version check and regress the served policy. A frozen
server (`inference.frozen`, a distillation teacher) refuses every update with a 409.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import SecretStr

from arbor.config.base import INT_MAX
from arbor.config.inference import InferenceConfig
from arbor.run_dir import broadcasts_root
from arbor.transport.http import BadRequest, Handler, HTTPError, error_response, get_field, get_int, read_json_object

log = logging.getLogger("arbor.transport.admin")

MAX_VERSION = INT_MAX
"""Largest policy version `/update_weights` takes: the batch files store versions as int32."""
OPEN_GET = frozenset({"/health", "/metrics", "/ping", "/version"})
ADMIN_UNDER_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
ADMIN_ROUTES = ("/update_weights", "/pause", "/resume", "/abort_requests", "/sleep", "/wake_up")
"""The admin routes every arbor backend serves (and the router fans out)."""
REFUSED_PATH = (
    "is not a published weights directory this server may load (an absolute path, without '..', "
    "inside <output_dir>/broadcasts/ or inference.weight_roots)"
)


def needs_admin(request: web.Request) -> bool:
    """Whether a request reaches a route that changes the server (see the module docstring)."""
    path = request.path  # percent-decoded: `%2e%2e` is `..` here
    segments = path.split("/")
    # `/v1/../x` is not normalized by aiohttp, but a server it is forwarded to might: such a path is not /v1/.
    if path.startswith("/v1/") and ".." not in segments and "." not in segments:
        return path in ADMIN_UNDER_V1
    return not (request.method in ("GET", "HEAD") and path in OPEN_GET)


def has_token(request: web.Request, token: SecretStr) -> bool:
    given = request.headers.get("Authorization", "")
    sent = given[7:] if given[:7].lower() == "bearer " else ""
    # aiohttp reads header bytes that are not UTF-8 into lone surrogates: encode them back, never fail on them.
    return hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), token.get_secret_value().encode())


def admin_guard(token: SecretStr | None):
    """The middleware that answers 401 to a request for an admin route without the token (none: all open)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and needs_admin(request) and not has_token(request, token):
            return error_response(
                401,
                f"{request.path} is an admin route: send Authorization: Bearer <admin_token>",
                None,
                "authentication_error",
            )
        return await handler(request)

    return guard


@dataclass(frozen=True)
class WeightUpdate:
    path: Path
    """The directory to load, symlinks resolved."""
    version: int


class WeightUpdates:
    """The `/update_weights` policy: which directories may be loaded, and which versions."""

    def __init__(self, roots: Sequence[Path] | None, frozen: bool = False) -> None:
        self.roots = None if roots is None else [Path(r).resolve(strict=False) for r in roots]
        """Allowed roots, resolved; None: any directory (an in-process server whose caller owns the machine)."""
        self.frozen = frozen
        """No update at all (`inference.frozen`: a teacher's weights never change)."""
        self._lock = asyncio.Lock()

    @classmethod
    def of(cls, cfg: InferenceConfig) -> "WeightUpdates":
        """The roots of a server process: the run's `broadcasts/` and `weight_roots` (none configured: any)."""
        roots = [broadcasts_root(cfg.output_dir)] if cfg.output_dir is not None else []
        roots += cfg.weight_roots
        if not roots and not cfg.frozen:
            log.warning("no output_dir nor weight_roots: /update_weights loads any directory it is sent")
        return cls(roots or None, cfg.frozen)

    def directory(self, raw: str) -> Path:
        """The resolved directory `raw` names, or the one refusal (400) that does not say why."""
        path = Path(raw)
        if path.is_absolute() and ".." not in path.parts:
            try:
                resolved = path.resolve(strict=False)
                if self._allowed(resolved) and resolved.is_dir():
                    return resolved
            # A NUL byte (ValueError), a symlink loop (RuntimeError before Python 3.13), a name too long (OSError):
            # refused like any other path.
            except (OSError, ValueError, RuntimeError):
                pass
        raise BadRequest(f"{raw!r} {REFUSED_PATH}", "path")

    def _allowed(self, resolved: Path) -> bool:
        return self.roots is None or any(resolved.is_relative_to(r) for r in self.roots)

    def read(self, body: dict[str, Any], loaded: int) -> WeightUpdate | None:
        """The update a body asks for; None when it names the loaded version (nothing to do)."""
        if self.frozen:
            raise HTTPError(409, "this server's weights are frozen (inference.frozen = true): it takes no updates")
        path = get_field(body, "path", (str,), None)
        version = get_int(body, "version", None, 0, MAX_VERSION)
        if path is None:
            raise BadRequest("path (a published weights directory) is required", "path")
        if version is None:
            raise BadRequest(f"version (an int in [0, {MAX_VERSION}]) is required", "version")
        if version < loaded:
            raise HTTPError(409, f"version {version} is older than the loaded version {loaded}", "version")
        if version == loaded:
            return None
        return WeightUpdate(self.directory(path), version)

    async def handle(
        self, request: web.Request, loaded: Callable[[], int], load: Callable[[WeightUpdate], Awaitable[int]]
    ) -> web.Response:
        """Serves one `/update_weights`: checks it against the version `loaded()` returns, then `load`s it (which
        answers the version now served), one update at a time."""
        body = await read_json_object(request)
        async with self._lock:
            update = self.read(body, loaded())
            version = loaded() if update is None else await load(update)
        return web.json_response({"policy_version": version})


async def sleep_level(request: web.Request, default: int) -> int:
    """The level of a `/sleep {"level"}` (vLLM's: 1 releases the KV cache and offloads the weights to the host, 2
    discards the weights too); `default` (the backend's) when the body has none. Anything else: a 400."""
    body = await read_json_object(request) if request.can_read_body else {}
    level = body.get("level", default)
    if level not in (1, 2) or isinstance(level, bool):
        raise BadRequest(f"level must be 1 or 2, got {level!r}", "level")
    return level
