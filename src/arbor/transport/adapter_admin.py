"""vLLM's dynamic-LoRA API as arbor's servers speak it (the local server and the vLLM proxy alike).

- `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true, "version": int}` loads a PEFT
  adapter directory under a name, or replaces the loaded adapter of that name with a new version, without
  pausing requests for other adapters. `version` is arbor's extension (the per-token policy versions of that
  adapter's completions); absent, it is the loaded version + 1 (0 for a new name). Versions only go up per
  adapter: lower is a 409, equal a no-op answering the loaded version. `lora_path` passes the same check as
  `/update_weights` paths (arbor.transport.admin.WeightUpdates: allowed roots, symlinks resolved, one refusal).
  Without `load_inplace` a name already loaded is a 400, as in vLLM.
- `POST /v1/unload_lora_adapter {"lora_name"}` removes it (404 when it is not loaded).
Both are admin routes (`arbor.transport.admin.ADMIN_UNDER_V1`) and answer JSON `{"lora_name", "version"}`.
Loads and unloads are serialized, so racing loads cannot both pass the version check.

A completion whose `model` names a loaded adapter is generated with it (`requested_adapter`); any other `model`
(the base model's name, none, anything else) is served by the base model, as arbor's servers always did.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from arbor.transport.admin import MAX_VERSION, WeightUpdates
from arbor.transport.http import BadRequest, HTTPError, get_field, get_int, read_json_object

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""What an adapter name may be (it travels as a completion's `model`)."""


@dataclass(frozen=True)
class AdapterLoad:
    name: str
    path: Path
    """The adapter directory, symlinks resolved."""
    version: int


def read_name(body: dict[str, Any]) -> str:
    name = get_field(body, "lora_name", (str,), None)
    if name is None or not ADAPTER_NAME.match(name):
        raise BadRequest("lora_name must be 1-128 characters of letters, digits, '.', '_' or '-'", "lora_name")
    return name


class AdapterUpdates:
    """The load/unload policy of one server: paths as `weights` allows them, versions upwards per adapter."""

    def __init__(self, weights: WeightUpdates) -> None:
        self.weights = weights
        self._lock = asyncio.Lock()

    def read_load(self, body: dict[str, Any], loaded: dict[str, int]) -> AdapterLoad | None:
        """The load a body asks for, given the loaded adapters' versions; None when it names the loaded version."""
        name = read_name(body)
        path = get_field(body, "lora_path", (str,), None)
        if path is None:
            raise BadRequest("lora_path (a PEFT adapter directory) is required", "lora_path")
        inplace = get_field(body, "load_inplace", (bool,), False)
        current = loaded.get(name)
        if current is not None and not inplace:
            raise BadRequest(f"adapter {name!r} is already loaded: send load_inplace true to replace it", "lora_name")
        default = 0 if current is None else min(current + 1, MAX_VERSION)
        version = get_int(body, "version", default, 0, MAX_VERSION)
        if current is not None and version < current:
            raise HTTPError(
                409, f"version {version} of adapter {name!r} is older than the loaded version {current}", "version"
            )
        if current is not None and version == current and "version" in body:
            return None
        return AdapterLoad(name, self.weights.directory(path), version)

    async def load(
        self,
        request: web.Request,
        loaded: Callable[[], dict[str, int]],
        do_load: Callable[[AdapterLoad], Awaitable[int]],
    ) -> web.Response:
        body = await read_json_object(request)
        async with self._lock:
            update = self.read_load(body, loaded())
            if update is None:
                name = read_name(body)
                return web.json_response({"lora_name": name, "version": loaded()[name]})
            version = await do_load(update)
        return web.json_response({"lora_name": update.name, "version": version})

    async def unload(
        self, request: web.Request, loaded: Callable[[], dict[str, int]], do_unload: Callable[[str], Awaitable[Any]]
    ) -> web.Response:
        name = read_name(await read_json_object(request))
        async with self._lock:
            versions = loaded()
            if name not in versions:
                raise HTTPError(404, f"adapter {name!r} is not loaded", "lora_name", "not_found_error")
            await do_unload(name)
        return web.json_response({"lora_name": name, "version": versions[name]})


def requested_adapter(body: dict[str, Any], adapters: Container[str]) -> str | None:
    """The loaded adapter a completion body's `model` names, or None (the base model)."""
    model = body.get("model")
    return model if isinstance(model, str) and model in adapters else None


def model_cards(base: str, created: int, max_model_len: int, adapters: dict[str, int]) -> list[dict[str, Any]]:
    """`/v1/models` entries: the base model, then each loaded adapter (`parent`: the base, as vLLM lists them)."""
    card = {"object": "model", "created": created, "owned_by": "arbor", "max_model_len": max_model_len}
    return [{"id": base, **card, "root": base, "parent": None}] + [
        {"id": name, **card, "root": name, "parent": base, "version": version} for name, version in adapters.items()
    ]
