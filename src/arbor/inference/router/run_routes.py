"""The router's routes for several runs on one fleet (arbor.inference.router.tenants holds the registry and the
sharing): the admin guard that tells the fleet's token from a run's, registration, and the scoping of a run's
admin calls to its own adapter, queue and requests. A mixin of `arbor.inference.router.app.Router`, which supplies
`cfg`, `fleet`, `tenants`, `share` and `_fan_out`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from arbor.config.admin import bearer_headers
from arbor.config.inference import RouterConfig
from arbor.inference.router.backends import Fleet
from arbor.inference.router.tenants import FairShare, Run, Tenants, fleet_token_ok, sent_token
from arbor.transport.admin import ADMIN_UNDER_V1, needs_admin
from arbor.transport.http import BadRequest, HTTPError, error_response, read_json_object

log = logging.getLogger("arbor.inference.router.app")

RUN_KEY = web.RequestKey("run", Run | None)
"""The run whose token an admin request came with (None: the fleet's rights)."""


class RunRoutes:
    """Registration (`/runs/register`, `/runs/unregister`, GET `/runs`) and run-scoped admin calls."""

    cfg: RouterConfig
    fleet: Fleet
    tenants: Tenants
    share: FairShare
    slots: Callable[[], int | None]
    _fan_out: Callable[[str, bytes, dict[str, str]], Awaitable[web.Response]]
    """Sends an admin call to every backend (the Router's)."""

    @web.middleware
    async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Admin routes need the fleet's token (none set: any caller has the fleet's rights) or a run's own, which
        `request[RUN_KEY]` then names and the handlers hold the call to (arbor.inference.router.tenants)."""
        if needs_admin(request):
            sent = sent_token(request.headers)
            run = self.tenants.by_token(sent) if sent else None
            if run is None and not fleet_token_ok(request.headers, self.cfg.admin_token):
                return error_response(
                    401,
                    f"{request.path} is an admin route: send Authorization: Bearer "
                    "<admin_token> (the fleet's, or a registered run's own)",
                    None,
                    "authentication_error",
                )
            request[RUN_KEY] = run
        return await handler(request)

    def _scoped(self, path: str, run: Run, data: dict[str, Any]) -> web.Response | bytes:
        """A run's admin call, held to that run: its own adapter, its own queue, its own requests. Returns the
        body to fan out, or the answer when the router serves the call itself (a run's pause is its queue's)."""
        if path == "/update_weights":
            raise HTTPError(
                403,
                "a run's token may not change the fleet's base weights: load the run's adapter "
                "with /v1/load_lora_adapter",
                None,
                "permission_error",
            )
        if path in ("/pause", "/resume"):
            run.paused = path == "/pause"
            self.share.dispatch()
            return web.json_response({"run": run.name, "paused": run.paused})
        if path in ADMIN_UNDER_V1:
            if data.get("lora_name") != run.name:
                raise HTTPError(
                    403,
                    f"run {run.name!r} may load and unload only its own adapter (lora_name = {run.name!r})",
                    "lora_name",
                    "permission_error",
                )
            return json.dumps(data).encode()
        ids = data.get("request_ids", "all")
        if ids == "all":
            ids = sorted(run.request_ids)
        elif not isinstance(ids, list):
            raise BadRequest('request_ids must be a list of ids or "all"', "request_ids")
        if any(i in other.request_ids for other in self.tenants.runs.values() if other is not run for i in ids):
            raise HTTPError(403, f"run {run.name!r} may abort only its own requests", "request_ids", "permission_error")
        return json.dumps({"request_ids": ids}).encode()

    async def register(self, request: web.Request) -> web.Response:
        """Registers a run (fleet rights only): its name, weight and the token of its own admin calls."""
        if request.get(RUN_KEY) is not None:
            raise HTTPError(
                403, "registering a run needs the fleet's admin token, not a run's", None, "permission_error"
            )
        run = self.tenants.register(await read_json_object(request))
        log.info("registered run %s (weight %g)", run.name, run.weight)
        return web.json_response({"run": run.name, "token": run.token, "weight": run.weight, "slots": self.slots()})

    async def unregister(self, request: web.Request) -> web.Response:
        """Ends a run on the fleet (its own token, or the fleet's): its waiting requests fail, its adapter is
        unloaded everywhere; answers what it used."""
        data = await read_json_object(request)
        scope = request.get(RUN_KEY)
        name = data.get("run", scope.name if scope is not None else None)
        if scope is not None and name != scope.name:
            raise HTTPError(403, f"run {scope.name!r} may unregister only itself", "run", "permission_error")
        if not isinstance(name, str):
            raise BadRequest("run (the registered run's name) is required", "run")
        run = self.tenants.unregister(name)
        self.share.dispatch()
        if name in self.fleet.adapters:
            await self._fan_out(
                "/v1/unload_lora_adapter",
                json.dumps({"lora_name": name}).encode(),
                bearer_headers(self.cfg.admin_token),
            )
        log.info("unregistered run %s", name)
        return web.json_response(
            {
                "run": name,
                "requests": run.requests,
                "completion_tokens": run.completion_tokens,
                "slot_seconds": run.slot_seconds,
            }
        )

    async def list_runs(self, request: web.Request) -> web.Response:
        if request.get(RUN_KEY) is not None:
            raise HTTPError(403, "listing the runs needs the fleet's admin token", None, "permission_error")
        return web.json_response(
            {
                r.name: {
                    "weight": r.weight,
                    "requests": r.requests,
                    "in_flight": r.in_flight,
                    "queued": len(r.queue),
                    "paused": r.paused,
                }
                for r in self.tenants.runs.values()
                if r.name
            }
        )
