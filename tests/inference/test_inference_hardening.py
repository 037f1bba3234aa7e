"""The local inference server never dies of a request: every bad field is a 4xx naming it, a failure inside the
engine fails one request only, a dead engine loop shows on /health (503) and ends the process; plus a fuzz run."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
from typing import Any

import aiohttp
import pytest
from fuzz_requests import check_answer, encode, malformed, send
from test_inference import SEQ_LEN, TOK, http, make_model, running_engine, server

from arbor.config.inference import InferenceConfig
from arbor.inference.engine import slots
from arbor.inference.engine.params import SamplingParams
from arbor.inference.server import serve

CHAT = [{"role": "user", "content": "hi"}]


async def _post_all(url: str, requests: list[tuple[str, bytes, dict[str, str]]]) -> list[tuple[int, Any]]:
    conn = aiohttp.TCPConnector(force_close=True)  # an unreadable body ends its connection
    async with aiohttp.ClientSession(connector=conn) as s:
        return [await send(s, url + path, body, headers) for path, body, headers in requests]


def test_each_bad_field_is_a_400_naming_it_and_the_engine_lives_on() -> None:
    cases: list[tuple[str, bytes, dict[str, str], str | None]] = [
        ("/v1/completions", encode({"prompt": "x", "seed": 2**64}), {}, "seed"),
        ("/v1/completions", encode({"prompt": "x", "seed": -1}), {}, "seed"),
        ("/v1/chat/completions", encode({"messages": CHAT, "seed": 2**64}), {}, "seed"),
        ("/v1/completions", encode({"prompt": "x", "temperature": float("nan")}), {}, "temperature"),
        ("/v1/completions", encode({"prompt": "x", "temperature": float("inf")}), {}, "temperature"),
        ("/v1/completions", encode({"prompt": "x", "temperature": 1e308}), {}, "temperature"),
        ("/v1/completions", encode({"prompt": "x", "temperature": 1e-40}), {}, "temperature"),
        ("/v1/completions", encode({"prompt": "x", "top_p": float("nan")}), {}, "top_p"),
        ("/v1/completions", encode({"prompt": [1, 10**9]}), {}, "prompt"),
        ("/v1/completions", encode({"prompt": [[1], [-1]]}), {}, "prompt"),
        ("/v1/completions", encode({"prompt": "x", "max_tokens": 10**30}), {}, "max_tokens"),
        ("/v1/completions", encode({"prompt": "x", "n": 10**6}), {}, "n"),
        ("/v1/completions", encode({"prompt": "x", "stop": ["s"] * 100}), {}, "stop"),
        ("/v1/completions", encode({"prompt": "x", "request_id": "r" * 1000}), {}, "request_id"),
        ("/v1/completions", encode({"prompt": "a\udcffb"}), {}, "prompt"),
        ("/v1/chat/completions", encode({"messages": [{"role": "user", "content": "\ud800"}]}), {}, "messages"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, None),
        ("/v1/completions", b'{"prompt": ' + b"[" * 70 + b"]" * 70 + b"}", {}, "prompt"),
        ("/v1/completions", b"\x1f\x8b\x08\x00garbage", {"Content-Encoding": "gzip"}, None),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', {}, None),
        ("/update_weights", encode({"path": "/nope", "version": 2**70}), {}, "version"),
        ("/abort_requests", encode({"request_ids": [1, 2]}), {}, "request_ids"),
    ]
    with server() as (url, engine):
        results = asyncio.run(_post_all(url, [(p, b, h) for p, b, h, _ in cases]))
        for (path, body, _, param), (status, data) in zip(cases, results):
            assert status == 400, (path, body[:80], status, data)
            assert data["error"]["param"] == param, (body[:80], data)
            assert data["error"]["type"] == "invalid_request_error", (body[:80], data)
        assert engine.alive
        plain = gzip.compress(json.dumps({"prompt": "x", "max_tokens": 2}).encode())
        ((status, data),) = asyncio.run(_post_all(url, [("/v1/completions", plain, {"Content-Encoding": "gzip"})]))
        assert status == 200 and data["usage"]["completion_tokens"] == 2
        assert http(url + "/health")[0] == 200


def test_a_request_failing_inside_the_engine_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    real_seq, calls = slots.Seq, []

    def seq_failing_once(req, index, slot, device):
        calls.append(index)
        if len(calls) == 2:  # the second sample of the first request: one slot is already taken
            raise OverflowError("injected: a seed the generator cannot take")
        return real_seq(req, index, slot, device)

    monkeypatch.setattr(slots, "Seq", seq_failing_once)
    with server(max_batch_size=2) as (url, engine):
        status, err = http(url + "/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 2, "temperature": 0.5})
        assert status == 500 and err["error"]["type"] == "internal_error"
        assert "POST /v1/completions" in err["error"]["message"] and "injected" in err["error"]["message"]
        assert engine.alive and engine.stats().running == 0
        status, r = http(url + "/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 2})  # both slots free
        assert status == 200 and len(r["choices"]) == 2

        def broken_abort(ids: Any) -> int:
            raise RuntimeError("injected abort failure")

        monkeypatch.setattr(engine._scheduler, "abort", broken_abort)
        status, err = http(url + "/abort_requests", {"request_ids": "all"})
        assert status == 500 and "injected abort failure" in err["error"]["message"]
        assert engine.alive and http(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


def _kill_loop(engine: Any) -> None:
    """Makes the engine loop itself fail (outside any one request's handling), as a bug in it would."""

    def broken() -> None:
        raise RuntimeError("injected engine loop failure")

    engine._scheduler.drop_abandoned = broken
    engine.submit(TOK.encode("x"), SamplingParams())


def test_a_dead_engine_loop_shows_on_health_and_answers_503() -> None:
    with server() as (url, engine):
        _kill_loop(engine)
        engine._thread.join(10)
        assert not engine.alive and "injected" in repr(engine.failure)
        status, health = http(url + "/health")
        assert status == 503 and health["status"] == "failed" and "injected" in health["error"]
        status, err = http(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and err["error"]["type"] == "unavailable"


def test_the_server_process_exits_1_when_its_engine_loop_dies() -> None:
    cfg = InferenceConfig.model_validate({"model": {"name": "qwen3-test"}, "port": 0, "seq_len": SEQ_LEN})
    with running_engine(make_model()) as engine:

        async def go() -> int:
            served = asyncio.create_task(serve(cfg, engine, TOK))
            await asyncio.sleep(0.3)
            _kill_loop(engine)
            return await asyncio.wait_for(served, 30)

        assert asyncio.run(go()) == 1


@pytest.mark.slow
def test_fuzzed_requests_never_get_a_5xx_nor_kill_the_engine() -> None:
    rng = random.Random(13)
    valid = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 2, "temperature": 0},
        "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
        "/abort_requests": {"request_ids": ["nobody"]},
        "/update_weights": {"path": "/nope", "version": 1},
        "/resume": {},
        "/no/such/route": {},
    }
    requests = []
    for _ in range(320):
        path = rng.choice(list(valid))
        body, headers = malformed(rng, valid[path])
        requests.append((path, body, headers))
    with server() as (url, engine):
        results = asyncio.run(_post_all(url, requests))
        for (path, body, headers), (status, data) in zip(requests, results):
            check_answer(status, data, (path, body[:100], headers))
        assert sum(400 <= s < 500 for s, _ in results) > 200
        assert engine.alive and engine.stats().running == 0
        assert http(url + "/health")[0] == 200
        status, r = http(url + "/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 4, "temperature": 1.0})
        assert status == 200 and len(r["choices"]) == 4
