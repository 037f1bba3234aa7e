"""The router's view of its backends: which are in rotation, which one serves a request, and their health.

Every backend's /health is polled; `eject_after` consecutive failures (or one refused connection on the request
path) eject it; the first success re-admits it, after replaying the last weight update, adapter loads and pause
state the fleet received (`remember`), so a restarted replica never serves stale weights. A backend already past
that record (it loaded an update whose fan-out failed on another backend, so none was recorded) is admitted as it
is: versions only go up, and a replay of the older one would be refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from arbor.config.admin import bearer_headers
from arbor.config.inference import RouterConfig

log = logging.getLogger("arbor.inference.router.app")


def rendezvous(key: str, urls: list[str]) -> str:
    """Highest-random-weight hashing: stable per key, and removing a backend moves only the keys it held."""
    return max(urls, key=lambda u: hashlib.blake2b(f"{u}|{key}".encode(), digest_size=8).digest())


@dataclass
class Backend:
    url: str
    healthy: bool = True
    outstanding: int = 0
    fails: int = 0
    requests: int = 0
    errors: int = 0
    policy_version: int = 0
    health: dict[str, Any] = field(default_factory=dict)


class Fleet:
    """The backends behind one router, with their ejection/re-admission counters and the fleet state
    (last weight update, pause) a recovering backend is brought up to."""

    def __init__(self, urls: list[str], cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self.ejections = self.readmissions = 0
        self.last_update: dict[str, Any] | None = None  # replayed on re-admission
        self.paused = False
        self.adapters: dict[str, dict[str, Any]] = {}
        """The last load of each adapter loaded now, by name: replayed on re-admission."""
        self.auth = bearer_headers(cfg.admin_token)
        """The admin header the replays carry: the router's token, else the last accepted call's own header."""
        self._rr = itertools.count()

    def pick(self, key: str | None, exclude: set[str]) -> Backend | None:
        live = [b for b in self.backends if b.healthy and b.url not in exclude]
        if not live:
            return None
        policy = self.cfg.policy
        if policy == "consistent_hash" and key is not None:
            # Hash over the whole fleet's healthy members, not minus `exclude`, so a retry goes to the backend
            # the session would move to if its own backend were ejected.
            url = rendezvous(key, [b.url for b in live])
            return next(b for b in live if b.url == url)
        start = next(self._rr)
        if policy == "least_outstanding":
            n = len(live)
            return min((live[(start + i) % n] for i in range(n)), key=lambda b: b.outstanding)
        return live[start % len(live)]

    def failed(self, b: Backend, refused: bool) -> None:
        """Counts a failure; ejects the backend on a refused connection or `eject_after` failures in a row."""
        b.errors += 1
        b.fails += 1
        if b.healthy and (refused or b.fails >= self.cfg.eject_after):
            b.healthy = False
            self.ejections += 1
            log.warning("ejected %s (%s)", b.url, "connection refused" if refused else f"{b.fails} failures")

    def remember(self, path: str, body: bytes, auth: dict[str, str], answers: Sequence[Any] = ()) -> None:
        """Records an admin call every backend accepted (and the admin header it went with), to replay it on
        re-admission. An adapter load is recorded at the version the backends answered, in place: replayed as
        sent, a load without a version would bump the version of a backend that still holds the adapter (its
        tokens then tagged apart from the others'), and one without `load_inplace` would be refused there (400,
        already loaded), keeping a backend that was only unreachable for a while out of rotation for good."""
        self.auth = auth
        if path == "/update_weights":
            self.last_update = json.loads(body)
        elif path in ("/pause", "/resume"):
            self.paused = path == "/pause"
        elif path == "/v1/load_lora_adapter":
            load = json.loads(body)
            versions = [a["version"] for a in answers if isinstance(a, dict) and type(a.get("version")) is int]
            if versions:  # they differ only after earlier versionless loads: the newest, since versions only go up
                load = {**load, "version": max(versions), "load_inplace": True}
            self.adapters[load["lora_name"]] = load
        elif path == "/v1/unload_lora_adapter":
            self.adapters.pop(json.loads(body)["lora_name"], None)

    async def health_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            results = await asyncio.gather(*(self._check(session, b) for b in self.backends), return_exceptions=True)
            for b, r in zip(self.backends, results):
                if isinstance(r, Exception):  # one backend's odd answer must not end every backend's checks
                    log.error("health check of %s failed: %s: %s", b.url, type(r).__name__, r)
            await asyncio.sleep(self.cfg.health_interval)

    async def _check(self, session: aiohttp.ClientSession, b: Backend) -> None:
        """One /health poll: a 200 keeps (or brings back) the backend; anything else (no answer, or a non-200
        such as a dead engine's 503) is a failure."""
        try:
            async with session.get(
                b.url + "/health", timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout)
            ) as r:
                ok = r.status == 200
                data = await r.json(content_type=None) if ok else {}
        except (TimeoutError, aiohttp.ClientError, ValueError, RecursionError):
            ok, data = False, {}
        if not ok:
            self.failed(b, refused=False)
            return
        b.health = data if isinstance(data, dict) else {}  # vLLM's own /health has an empty body
        version = b.health.get("policy_version", 0)
        b.policy_version = version if isinstance(version, int) and not isinstance(version, bool) else 0
        if not b.healthy:
            if not await self._catch_up(session, b):
                return
            b.healthy = True
            self.readmissions += 1
            log.warning("re-admitted %s", b.url)
        b.fails = 0

    async def _catch_up(self, session: aiohttp.ClientSession, b: Backend) -> bool:
        """Brings a recovering backend to the fleet's state (weights, adapters, pause) before it serves again.
        A backend already past the fleet's record (it loaded an update whose fan-out failed elsewhere, so the
        router never recorded it) is admitted as it is: versions only go up, and a replay of the older record
        would be refused (409) every time, keeping it out of rotation until the next update."""
        target = self.last_update.get("version") if self.last_update is not None else None
        if isinstance(target, int) and b.policy_version < target:
            status, data = await post_json(
                session, b, "/update_weights", json.dumps(self.last_update).encode(), self.auth
            )
            if status != 200:
                log.warning("%s is back but could not load %s: %s", b.url, self.last_update, data)
                return False
            b.policy_version = target
        for load in list(self.adapters.values()):
            status, data = await post_json(session, b, "/v1/load_lora_adapter", json.dumps(load).encode(), self.auth)
            if status == 409:  # it holds a newer version of that adapter (the same story as the weights above)
                log.info(
                    "%s is back with a newer version of adapter %s than %s",
                    b.url,
                    load.get("lora_name"),
                    load.get("version"),
                )
            elif status != 200:
                log.warning("%s is back but could not load adapter %s: %s", b.url, load.get("lora_name"), data)
                return False
        if self.paused:
            status, _ = await post_json(session, b, "/pause", b"{}", self.auth)
            if status != 200:
                return False
        return True


async def post_json(
    session: aiohttp.ClientSession, b: Backend, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POSTs a JSON body to one backend (with `headers`, e.g. the admin token): (status, parsed JSON or text), or
    (0, the error) if it is unreachable."""
    try:
        async with session.post(
            b.url + path, data=body, headers={"Content-Type": "application/json", **(headers or {})}
        ) as r:
            text = await r.read()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text.decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError) as e:
        return 0, f"{type(e).__name__}: {e}"
