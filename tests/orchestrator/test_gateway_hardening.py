"""The gateway never answers a 5xx to client input: the cases measured on main (seed 2**64, NaN temperature,
nested JSON, lone surrogates, bad gzip) each get a 400 naming the field, and a fuzz run against the real CPU engine
(the agent's sampling forwarded, not overridden) leaves the engine alive and the gateway serving."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp
from fuzz_requests import check_answer, encode, malformed, send
from test_inference import TOK, make_model, running_engine

from arbor.config.orchestrator import GatewayConfig
from arbor.inference.server import BackgroundServer
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.gateway.service import Gateway

CHAT = [{"role": "user", "content": "hi"}]


async def _with_gateway(backend_url: str, go: Any) -> Any:
    async with InferenceClient([backend_url], 60, 0) as client:
        cfg = GatewayConfig(override_sampling=False, max_request_bytes=64 * 1024)
        async with Gateway(client, TOK, cfg, temperature=1.0, top_p=1.0, max_tokens=4, seq_len=128) as gw:
            conn = aiohttp.TCPConnector(force_close=True)  # an unreadable body ends its connection
            async with aiohttp.ClientSession(connector=conn) as s:
                return await go(gw, s)


def test_the_measured_cases_are_400s_naming_the_field() -> None:
    cases: list[tuple[str, bytes, dict[str, str], str | None]] = [
        ("/chat/completions", encode({"messages": CHAT, "seed": 2**64}), {}, "seed"),
        ("/chat/completions", encode({"messages": CHAT, "temperature": float("nan")}), {}, "temperature"),
        ("/chat/completions", encode({"messages": CHAT, "temperature": float("inf")}), {}, "temperature"),
        ("/chat/completions", encode({"messages": CHAT, "temperature": 1e308}), {}, "temperature"),
        ("/chat/completions", encode({"messages": CHAT, "top_p": 0}), {}, "top_p"),
        ("/chat/completions", encode({"messages": [{"role": "user", "content": "\udcff"}]}), {}, "messages"),
        ("/chat/completions", b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}", {}, None),
        ("/chat/completions", b"\x1f\x8b\x08\x00garbage", {"Content-Encoding": "gzip"}, None),
        ("/chat/completions", encode({"messages": CHAT, "stop": ["x"] * 100}), {}, "stop"),
        ("/completions", encode({"prompt": [10**9]}), {}, "prompt"),
    ]
    deep_args = '{"a": ' * 3000 + "1" + "}" * 3000  # tool-call arguments nested past the JSON reader's limit
    echoed = [
        *CHAT,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_args}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    with running_engine(make_model()) as engine, BackgroundServer(engine, TOK) as backend:

        async def go(gw: Gateway, s: aiohttp.ClientSession) -> None:
            gw.open("a")
            for path, body, headers, param in cases:
                status, data = await send(s, gw.base_url("a") + path, body, headers)
                assert status == 400, (path, body[:80], data)
                assert data["error"]["param"] == param, (body[:80], data)
            status, data = await send(
                s, gw.base_url("a") + "/chat/completions", encode({"messages": echoed, "max_tokens": 2}), {}
            )
            assert status == 400 and data["error"]["param"] == "messages", data

        asyncio.run(_with_gateway(backend.url, go))
        assert engine.alive


def test_fuzzed_requests_to_the_gateway_never_get_a_5xx_nor_kill_the_engine() -> None:
    rng = random.Random(21)
    valid = {
        "/v1/sessions/f/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
        "/v1/sessions/f/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/sessions/f/reward": {"reward": 1.0},
        "/v1/sessions": {"id": "x1"},
        "/v1/work": {"wait": 0},
    }
    requests = []
    for _ in range(320):
        path = rng.choice(list(valid))
        requests.append((path, *malformed(rng, valid[path])))
    with running_engine(make_model()) as engine, BackgroundServer(engine, TOK) as backend:

        async def go(gw: Gateway, s: aiohttp.ClientSession) -> list[int]:
            gw.open("f")
            statuses = []
            for path, body, headers in requests:
                status, data = await send(s, gw.url + path, body, headers)
                check_answer(status, data, (path, body[:100], headers))
                statuses.append(status)
            gw.open("after")
            status, data = await send(
                s,
                gw.base_url("after") + "/chat/completions",
                encode({"messages": CHAT, "max_tokens": 2, "seed": 1}),
                {},
            )
            assert status == 200, data
            return statuses

        statuses = asyncio.run(_with_gateway(backend.url, go))
        assert sum(400 <= s < 500 for s in statuses) > 200
        # The engine thread retires a finished sequence just after its answer is sent: give it a moment.
        deadline = time.monotonic() + 10
        while engine.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.alive and engine.stats().running == 0
