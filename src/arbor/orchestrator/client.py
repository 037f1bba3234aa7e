"""HTTP client for the inference fleet: token ids in, token ids + logprobs + per-token policy versions out.

Speaks vLLM's field names, so it works against arbor's engine, vLLM or a router in front of either; retries
transient failures on the next server, raises a 4xx at once, waits for a restarted server (which gets the current
weights before it serves), sends admin calls with the fleet's token, salts every request's prefix cache with the
policy version, and names requests so partial rollouts can abort them (docs/inference.md, "The orchestrator's
client").
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
from pydantic import SecretStr

from arbor.config.admin import bearer_headers
from arbor.transport.expert_routes import decode_routes
from arbor.transport.images import encode_images
from arbor.transport.router_wire import ENGINE_PREFIX, METRIC_PREFIX, RUN_HEADER, parse_metrics

log = logging.getLogger("arbor.orchestrator.client")


class InferenceError(RuntimeError):
    """A request that failed for good (bad request, or retries exhausted)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The server's 4xx status when it rejected the request itself; None for failures after retries."""


RECONNECT_POLL = 0.5
"""Seconds between two /health checks of an unreachable server."""

STARTUP_POLL = 0.05
"""Seconds between two /health checks while the run starts (`wait_healthy`): the orchestrator's first generation
waits on the server, and a refused local connection costs well under a millisecond, where RECONNECT_POLL's
half second added 0.25 s on average to every start-up."""


class OutOfVocabulary(InferenceError):
    """A server sampled a token id outside the tokenizer's ids (a head wider than the tokenizer whose padding rows
    were not masked, e.g. vLLM under speculative decoding): the trainer's logprobs have no row for it. The group
    fails (skipped and counted like any failed generation) instead of reaching the trainer as an index error."""


def unreachable(e: BaseException) -> bool:
    """True for a refused, reset or dropped connection (the server process is gone or restarting), not for a
    slow answer: a timeout is an ordinary failed attempt."""
    gone = isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))  # payload: cut mid-answer
    return gone and not isinstance(e, asyncio.TimeoutError)


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    text: str
    finish_reason: str
    routed_experts: "np.ndarray | None" = None
    """MoE router replay payload `[prompt + completion tokens, moe_layers, top_k]`, decoded without a copy."""
    pieces: int = 1
    """Requests this completion was generated in: > 1 for a partial rollout resumed after aborts."""


class InferenceClient:
    def __init__(
        self,
        base_urls: list[str],
        timeout: float,
        max_retries: int,
        model: str = "arbor",
        admin_urls: list[str] | None = None,
        admin_token: SecretStr | None = None,
        adapter: str | None = None,
        reconnect_timeout: float = 600.0,
        vocab_size: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        if not base_urls:
            raise ValueError("orchestrator.client.base_urls is empty")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.admin_urls = [u.rstrip("/") for u in admin_urls] if admin_urls else self.base_urls
        self._admin_headers = bearer_headers(admin_token)
        self.policy_version = 0  # the cache salt's version; WeightSync raises it after each fleet update
        self.timeout, self.max_retries, self.model = timeout, max_retries, adapter or model
        self.adapter = adapter
        self._headers = {RUN_HEADER: adapter} if adapter is not None else None
        self._next = itertools.cycle(range(len(self.base_urls)))
        self._session: aiohttp.ClientSession | None = None
        self.retries = 0
        self.reconnect_timeout = reconnect_timeout
        self.vocab_size = vocab_size
        """The tokenizer's id count: a sampled id at or beyond it is refused (`OutOfVocabulary`); None: unchecked."""
        self.stop_token_ids = list(stop_token_ids)
        """The tokenizer's stop ids (`Tokenizer.stop_token_ids`), sent with every request: a completion ends at its
        chat template's turn end on every backend, whatever the served directory's generation config says."""
        self.out_of_vocab = 0
        """Completions refused for an out-of-vocabulary token, for the run's metrics."""
        self.reconnects = 0
        """Servers that came back after being unreachable (a restarted process), for the run's metrics."""
        self._down: dict[str, asyncio.Task[None]] = {}
        """Unreachable servers -> their recovery (wait for /health, then `catch_up`); requests to them await it."""
        self.catch_up: Callable[[str, int], Awaitable[None]] | None = None
        """Brings a server that came back (its URL, the policy version its /health reports) to the fleet's state
        before it serves again; its calls pass `gate=False`. Set by WeightSync."""

    async def __aenter__(self) -> "InferenceClient":
        conn = aiohttp.TCPConnector(limit=0)  # concurrency is bounded by the orchestrator, not the pool
        self._session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in list(self._down.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    async def _post(
        self,
        path: str,
        body: dict[str, Any],
        url: str | None = None,
        headers: dict[str, str] | None = None,
        gate: bool = True,
    ) -> dict[str, Any]:
        """POSTs to `url`, or to the next reachable server of `base_urls`, retrying as the module docstring says.
        `gate=False` (a recovery's own calls) neither waits for a recovery nor starts one."""
        return (await self._post_to(path, body, url, headers, gate))[1]

    async def _post_to(
        self,
        path: str,
        body: dict[str, Any],
        url: str | None = None,
        headers: dict[str, str] | None = None,
        gate: bool = True,
    ) -> tuple[str, dict[str, Any]]:
        """`_post`, with the server that answered."""
        assert self._session is not None, "use InferenceClient as an async context manager"
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            base = url or self._pick()
            if gate and base in self._down:
                # Shielded: a waiter cancelled (its group's timeout, the run's end) must not cancel the recovery
                # that the other waiters share. Raises when the server did not come back in time.
                await asyncio.shield(self._down[base])
            gone = False  # the server process is gone: wait for its return, not a backoff
            try:
                async with self._session.post(base + path, json=body, headers=headers) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status < 400:
                        return base, data
                    message = (data.get("error") or {}).get("message", data) if isinstance(data, dict) else data
                    if resp.status < 500:
                        raise InferenceError(
                            f"{base}{path} rejected the request ({resp.status}): {message}", resp.status
                        )
                    last = InferenceError(f"{base}{path} failed ({resp.status}): {message}")
                    if gate and resp.status == 503:  # a dead engine, or a router with no backend: wait for /health
                        self._recover(base)
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                last = e
                gone = gate and unreachable(e)
                if gone:
                    self._recover(base)
            if attempt < self.max_retries:
                self.retries += 1
                log.warning("request to %s%s failed (%s); retry %d/%d", base, path, last, attempt + 1, self.max_retries)
                if not gone:
                    await asyncio.sleep(min(0.5 * 2**attempt, 8.0))
        raise InferenceError(f"{path} failed after {self.max_retries + 1} attempts: {last}")

    def _pick(self) -> str:
        """The next server in rotation that is not recovering; when all are, the next one (then waited for)."""
        for _ in range(len(self.base_urls)):
            base = self.base_urls[next(self._next)]
            if base not in self._down:
                return base
        return self.base_urls[next(self._next)]

    def _recover(self, base: str) -> None:
        """Starts the recovery of `base` unless one is under way."""
        if base in self._down:
            return
        task = asyncio.create_task(self._await_return(base))
        self._down[base] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._down.get(base) is t:
                del self._down[base]
            if not t.cancelled():
                t.exception()  # retrieved: a recovery nobody waited for must not log "exception never retrieved"

        task.add_done_callback(done)

    async def _await_return(self, base: str) -> None:
        """Waits until `base` answers /health again, then runs `catch_up` on it before requests reach it."""
        log.warning(
            "inference server %s is unreachable: waiting up to %.0fs for it to come back", base, self.reconnect_timeout
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_timeout
        while (version := await self._health(base)) is None:
            if loop.time() > deadline:
                raise InferenceError(
                    f"inference server {base} was unreachable for {self.reconnect_timeout:.0f}s "
                    "(orchestrator.client.reconnect_timeout)"
                )
            await asyncio.sleep(RECONNECT_POLL)
        if self.catch_up is not None:
            await self.catch_up(base, version)
        self.reconnects += 1
        log.warning("inference server %s is back (it reports policy version %d)", base, version)

    async def _health(self, base: str) -> int | None:
        """The policy version `base`'s /health reports (0 when it reports none, as vLLM's), None while it is not
        healthy (no answer, or a 5xx). An API without /health (a 4xx) counts as answering, with version 0."""
        assert self._session is not None
        try:
            async with self._session.get(
                base + "/health", headers=self._headers, timeout=aiohttp.ClientTimeout(total=10)
            ) as r:
                if r.status >= 500:
                    return None
                data = await r.json(content_type=None) if r.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        version = data.get("policy_version", 0) if isinstance(data, dict) else 0
        return version if isinstance(version, int) and not isinstance(version, bool) else 0

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
        request_id: str | None = None,
        stop: list[str] | None = None,
        images: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """`n` completions of `prompt_ids`; `images` (`pixel_values`, `image_grid_thw`: a vision-language
        prompt's, its placeholders in the ids) travel as the `images` extension (arbor.transport.images)."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "cache_salt": f"policy-{self.policy_version}",
        }
        if seed is not None:
            body["seed"] = seed
        if request_id is not None:
            body["request_id"] = request_id
        if stop:
            body["stop"] = stop
        if self.stop_token_ids:
            body["stop_token_ids"] = self.stop_token_ids
        if images:
            body["images"] = encode_images(images["pixel_values"], images["image_grid_thw"])
        server, data = await self._post_to("/v1/completions", body, headers=self._headers)
        out = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            ids = choice["token_ids"]
            self._check_vocab(ids, server, choice["index"], request_id)
            lps = choice["logprobs"]["token_logprobs"]
            versions = choice.get("policy_versions") or [-1] * len(ids)
            if self.adapter is not None and choice.get("adapter") not in (None, self.adapter):
                # Another run's policy: training on it would corrupt this run (a fleet that mixed adapters up).
                raise InferenceError(
                    f"the fleet answered with adapter {choice.get('adapter')!r}, not this run's {self.adapter!r}"
                )
            if not (len(ids) == len(lps) == len(versions)):
                raise InferenceError(
                    f"inconsistent completion lengths: {len(ids)} ids, {len(lps)} logprobs, {len(versions)} versions"
                )
            routes = None
            if choice.get("routed_experts") is not None:
                try:
                    routes = decode_routes(choice["routed_experts"])
                except ValueError as e:
                    raise InferenceError(str(e)) from None
                if routes.shape[0] != len(prompt_ids) + len(ids):
                    raise InferenceError(
                        f"routed_experts covers {routes.shape[0]} tokens, expected {len(prompt_ids) + len(ids)}"
                    )
            out.append(
                Completion(
                    ids,
                    [float(x) for x in lps],
                    versions,
                    choice.get("text", ""),
                    choice.get("finish_reason", ""),
                    routes,
                )
            )
        return out

    def _check_vocab(self, ids: list[int], server: str, index: int, request_id: str | None) -> None:
        if self.vocab_size is None:
            return
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            self.out_of_vocab += 1
            raise OutOfVocabulary(
                f"{server} sampled token id {bad}, outside the tokenizer's {self.vocab_size} ids, in sample {index} "
                f"of request {request_id or '(unnamed)'}: its group is dropped (a head wider than the tokenizer "
                "whose padding rows the server did not mask)"
            )

    async def update_weights(self, path: str, version: int, urls: list[str] | None = None, gate: bool = True) -> None:
        """Loads a published weights directory on every server (each pauses, swaps, resumes), or on `urls` only
        (a recovery's replay, which leaves the fleet's version as it is)."""
        body = {"path": path, "version": version}
        await asyncio.gather(
            *(self._post("/update_weights", body, u, self._admin_headers, gate) for u in urls or self.admin_urls)
        )
        if urls is None:
            self.policy_version = max(self.policy_version, version)

    async def load_adapter(
        self, name: str, path: str, version: int, urls: list[str] | None = None, gate: bool = True
    ) -> None:
        """Loads (or replaces in place) LoRA adapter `name` from a published directory on every server, or on
        `urls` only (as `update_weights`)."""
        # Absolute: a shared fleet's servers run in a directory of their own.
        body = {"lora_name": name, "lora_path": os.path.abspath(path), "load_inplace": True, "version": version}
        await asyncio.gather(
            *(self._post("/v1/load_lora_adapter", body, u, self._admin_headers, gate) for u in urls or self.admin_urls)
        )
        if urls is None:
            self.policy_version = max(self.policy_version, version)

    async def abort_requests(self, request_ids: list[str] | None) -> None:
        """Finishes these requests (None: every request) on every server in `admin_urls` (a router fans out)."""
        body = {"request_ids": "all" if request_ids is None else list(request_ids)}
        await asyncio.gather(*(self._post("/abort_requests", body, u, self._admin_headers) for u in self.admin_urls))

    async def sleep(self) -> list[dict[str, Any]]:
        """Puts every server in `admin_urls` to sleep at its backend's level (a colocated run's train phase; a
        router fans out); their answers."""
        return list(await asyncio.gather(*(self._post("/sleep", {}, u, self._admin_headers) for u in self.admin_urls)))

    async def wake_up(self) -> list[dict[str, Any]]:
        """Wakes every server in `admin_urls` (a colocated run's generate phase); their answers."""
        return list(
            await asyncio.gather(*(self._post("/wake_up", {}, u, self._admin_headers) for u in self.admin_urls))
        )

    async def router_stats(self) -> dict[str, float]:
        """The router's fleet counters (retries, ejections, re-admissions) when `base_urls` is one router."""
        if len(self.base_urls) != 1:
            return {}
        return await self._metrics(self.base_urls[0], METRIC_PREFIX)

    async def engine_counters(self) -> dict[str, float]:
        """The local engines' cumulative decode counters (`arbor_*` on /metrics: decode tokens, seconds and
        sequence-steps, speculative drafts and acceptances), summed over `base_urls`; empty behind a router or
        with vLLM, whose pages carry none."""
        totals: dict[str, float] = {}
        for base in self.base_urls:
            for name, value in (await self._metrics(base, ENGINE_PREFIX)).items():
                if name.endswith("_total"):
                    totals[name] = totals.get(name, 0.0) + value
        return totals

    async def _metrics(self, base: str, prefix: str) -> dict[str, float]:
        assert self._session is not None
        try:
            async with self._session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return parse_metrics(await r.text(), prefix) if r.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError) as e:
            log.warning("metrics of %s unavailable: %s", base, e)
            return {}

    async def wait_healthy(self, timeout: float) -> int:
        """Waits until every server answers /health (`_health`); returns the lowest policy version they report."""
        deadline = asyncio.get_running_loop().time() + timeout
        versions = []
        for base in self.base_urls:
            while (version := await self._health(base)) is None:
                if asyncio.get_running_loop().time() > deadline:
                    raise InferenceError(f"inference server {base} is not healthy after {timeout:.0f}s")
                await asyncio.sleep(STARTUP_POLL)
            versions.append(version)
        return min(versions)
