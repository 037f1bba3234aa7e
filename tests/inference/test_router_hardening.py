"""The router tells client errors from backend failures: a backend's 4xx goes back as it is and never counts
against it, a poisonous request is not retried on a third backend and ejects none, the router's own errors have
the JSON shape, a dead engine is ejected; plus a fuzz run through the router onto two real inference servers."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest
from fuzz_requests import check_answer, encode, malformed, raw_http, send
from test_inference import TOK, make_model, running_engine
from test_inference_hardening import _kill_loop
from test_router import FakeBackend, _fleet, _post

from arbor.config.inference import RouterConfig
from arbor.inference.router.app import Router
from arbor.inference.server import BackgroundServer
from arbor.transport.http import start_site
from arbor.transport.router_wire import parse_router_metrics


async def _stop(runner: Any, backends: list[FakeBackend]) -> None:
    await runner.cleanup()
    for b in backends:
        await b.stop()


def test_a_backends_4xx_goes_back_to_the_client_and_never_counts_against_it() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2, eject_after=1)
        for b in backends:
            b.fail_status = 422
        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                status, data = await _post(s, url + "/v1/completions", {"prompt": [1]})
                assert status == 422 and data == {"error": {"message": "boom"}}
        assert router.retries == 0 and router.ejections == 0
        assert all(b.healthy and b.fails == 0 for b in router.backends)
        assert sum(len(b.seen) for b in backends) == 6  # each went to one backend only
        await _stop(runner, backends)

    asyncio.run(go())


def test_a_poisonous_request_is_not_retried_on_a_third_backend_and_ejects_none() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(3, eject_after=1, max_retries=5)
        for b in backends:
            b.fail_status = 500
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                status, data = await _post(s, url + "/v1/completions", {"prompt": [1]})
                assert status == 502 and data["error"]["type"] == "upstream_error"
                assert "failed on 2 backends" in data["error"]["message"]
            assert sum(len(b.seen) for b in backends) == 6  # two backends per request, never a third
            assert router.ejections == 0 and all(b.healthy for b in router.backends)
            async with s.get(url + "/metrics") as r:
                assert parse_router_metrics(await r.text())["poisoned"] == 3
            # A backend failing requests another one serves is counted: with eject_after = 1, ejected at once.
            backends[0].fail_status = backends[2].fail_status = 0
            for _ in range(3):
                status, _ = await _post(s, url + "/v1/completions", {"prompt": [1]})
                assert status == 200
            assert not router.backends[1].healthy and router.ejections == 1
        await _stop(runner, backends)

    asyncio.run(go())


def test_the_routers_own_errors_have_the_json_shape() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2, eject_after=1)
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            status, data = await send(s, url + "/v1/completions", b"\x1f\x8bgarbage", {"Content-Encoding": "gzip"})
            assert status == 400 and "could not be read" in data["error"]["message"]
            for body in (b"{not json", b'{"path": "\\udcff", "version": 1}', b"[" * 5000 + b"]" * 5000):
                status, data = await send(s, url + "/update_weights", body, {})
                assert status == 400 and data["error"]["type"] == "invalid_request_error", data
            assert not any(b.admin for b in backends)  # refused at the router, sent to no backend
        host = url.removeprefix("http://")
        status, _, body = await raw_http(
            url,
            b"POST /v1/completions HTTP/1.1\r\nHost: "
            + host.encode()
            + b"\r\nConnection: close\r\nX-Odd: \xff\xfe\r\nContent-Length: 2\r\n\r\n{}",
        )
        assert status == 400 and b'"param": "X-Odd"' in body
        status, _, body = await raw_http(url, b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n")
        assert status == 400 and body.startswith(b'{"error"')
        assert router.ejections == 0 and not any(b.seen for b in backends)
        await _stop(runner, backends)

    asyncio.run(go())


def test_the_router_refuses_what_the_request_schema_refuses_and_forwards_the_rest() -> None:
    """The router checks a generation body against the request schema (arbor.transport.fields) and answers a
    malformed field itself, with a 400 naming it in the fleet's error shape, sending it to no backend; a valid
    body goes on as it is, whatever backend capability it asks for (the backend's to refuse)."""
    refused = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**19}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "return_token_ids": "yes"}, "return_token_ids"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": [], "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [], "request_id": 5}, "request_id"),
        ("/v1/chat/completions", {"messages": [], "temperature": -1}, "temperature"),
        ("/v1/completions", [1, 2], None),
        ("/v1/completions", "{not json", None),
    ]

    async def go() -> None:
        backends, router, runner, url = await _fleet(2)
        async with aiohttp.ClientSession() as s:
            for path, body, param in refused:
                raw = body.encode() if isinstance(body, str) else encode(body)
                status, data = await send(s, url + path, raw, {})
                assert status == 400 and data["error"]["param"] == param, (body, data)
                assert set(data["error"]) == {"message", "type", "param"}
            assert not any(b.seen for b in backends)
            ok = {"prompt": [1], "top_k": 5, "logprobs": 2, "request_id": "r", "unknown_field": {"x": 1}}
            status, data = await send(s, url + "/v1/completions", encode(ok), {})
            assert status == 200 and data["echo"] == ok
        await _stop(runner, backends)

    asyncio.run(go())


@pytest.mark.slow
def test_fuzzed_requests_through_the_router_never_get_a_5xx_nor_eject_a_backend() -> None:
    rng = random.Random(7)
    valid = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 2, "temperature": 0, "user": "u1"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/abort_requests": {"request_ids": ["nobody"]},
        "/update_weights": {"path": "/nope", "version": 1},
        "/resume": {},
        "/v1/embeddings": {},
    }
    requests = []
    for _ in range(320):
        path = rng.choice(list(valid))
        requests.append((path, *malformed(rng, valid[path])))
    with (
        running_engine(make_model()) as e0,
        running_engine(make_model()) as e1,
        BackgroundServer(e0, TOK) as s0,
        BackgroundServer(e1, TOK) as s1,
    ):

        async def go() -> None:
            cfg = RouterConfig(policy="consistent_hash", health_interval=0.05, eject_after=1)
            router = Router([s0.url, s1.url], cfg)
            runner, url = await start_site(router.app(), "127.0.0.1", 0)
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s:
                for path, body, headers in requests:
                    status, data = await send(s, url + path, body, headers)
                    check_answer(status, data, (path, body[:100], headers))
                assert router.ejections == 0 and all(b.healthy for b in router.backends)
                before = [e0.stats().requests, e1.stats().requests]
                for i in range(4):
                    status, data = await send(s, url + "/v1/completions", encode({"prompt": "x", "max_tokens": 2}), {})
                    assert status == 200, data
                assert e0.stats().requests > before[0] and e1.stats().requests > before[1]
                # A backend whose engine loop dies answers /health with 503: ejected, the other one serves.
                _kill_loop(e1)
                for _ in range(100):
                    if not router.backends[1].healthy:
                        break
                    await asyncio.sleep(0.05)
                assert not router.backends[1].healthy and router.backends[0].healthy
                for i in range(3):
                    status, _ = await send(s, url + "/v1/completions", encode({"prompt": "x", "max_tokens": 2}), {})
                    assert status == 200
            await runner.cleanup()

        asyncio.run(go())
        assert e0.alive
