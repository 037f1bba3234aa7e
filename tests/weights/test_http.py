"""The HTTP plumbing every arbor server shares (arbor.transport.http, arbor.transport.fields): strict JSON bodies,
bounded fields, and one JSON error shape for handler failures, client input and aiohttp's own error pages."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fuzz_requests import raw_http

from arbor.transport.fields import MAX_SEED, read_seed, read_stop, read_temperature, read_top_p
from arbor.transport.http import (
    MAX_JSON_DEPTH,
    BadRequest,
    error_middleware,
    get_float,
    get_int,
    parse_json,
    read_json_object,
    start_site,
)

log = logging.getLogger("test_http")


def _refused(raw: bytes | str, param: str | None = None) -> str:
    with pytest.raises(BadRequest) as e:
        parse_json(raw)
    assert e.value.param == param
    return e.value.message


def test_parse_json_refuses_what_would_crash_a_handler() -> None:
    assert "malformed JSON" in _refused(b"{not json")
    assert "malformed JSON" in _refused(b'{"a": "\xff\xfe"}')  # invalid UTF-8
    assert "malformed JSON" in _refused(b'{"seed": ' + b"9" * 5000 + b"}")  # past Python's int digits limit
    assert "nested deeper" in _refused(b"[" * 100_000 + b"]" * 100_000)  # the decoder's own recursion limit
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert "nested deeper" in _refused('{"prompt": ' + deep + "}", "prompt")
    assert parse_json("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))
    assert "surrogate" in _refused('{"prompt": "a\\udcffb"}', "prompt")
    assert "surrogate" in _refused('{"messages": [{"content": "\\ud800"}]}', "messages")
    assert "surrogate" in _refused('{"\\udfff": 1}', "\udfff")
    assert "non-finite" in _refused('{"temperature": NaN}', "temperature")
    assert "non-finite" in _refused('{"stop": [1, -Infinity]}', "stop")
    assert parse_json('{"prompt": [1, 2, 3], "t": 0.5, "s": "\\u00e9\\ud83d\\ude00"}')["s"] == "é😀"


def test_bounded_fields_name_the_field() -> None:
    with pytest.raises(BadRequest) as e:
        get_int({"n": True}, "n", 1, 1, 4)
    assert e.value.param == "n"
    assert get_int({}, "n", 1, 1, 4) == 1 and get_int({"n": 4}, "n", 1, 1, 4) == 4
    with pytest.raises(BadRequest, match=r"\[1, 4\]"):
        get_int({"n": 5}, "n", 1, 1, 4)
    with pytest.raises(BadRequest, match="digits"):
        get_float({"t": 10**400}, "t", 1.0, 0.0, 2.0)
    for body in ({"seed": 2**64}, {"seed": MAX_SEED + 1}, {"seed": -1}, {"seed": 1.0}, {"seed": "1"}):
        with pytest.raises(BadRequest) as e:
            read_seed(body)
        assert e.value.param == "seed"
    assert read_seed({"seed": MAX_SEED}) == MAX_SEED and read_seed({}) is None
    for t in (float("nan"), float("inf"), 1e308, -0.5, 1e-30, 101):
        with pytest.raises(BadRequest) as e:
            read_temperature({"temperature": t}, 1.0)
        assert e.value.param == "temperature"
    assert read_temperature({"temperature": 0}, 1.0) == 0.0 and read_temperature({}, 0.7) == 0.7
    for p in (0, -0.1, 1.5, float("nan")):
        with pytest.raises(BadRequest):
            read_top_p({"top_p": p}, 1.0)
    for stop in (3, [""], ["x"] * 33, ["x" * 1025], [1]):
        with pytest.raises(BadRequest) as e:
            read_stop({"stop": stop})
        assert e.value.param == "stop"
    assert read_stop({"stop": "a"}) == ("a",) and read_stop({}) == ()


async def _app_server() -> tuple[web.AppRunner, str]:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await read_json_object(request))

    async def broken(request: web.Request) -> web.Response:
        raise KeyError("a bug")

    app = web.Application(middlewares=[error_middleware(log)], client_max_size=1024)
    app.add_routes([web.post("/echo", echo), web.post("/broken", broken)])
    return await start_site(app, "127.0.0.1", 0)


def test_every_error_has_the_json_shape_including_aiohttps_own() -> None:
    async def go() -> list[tuple[int, Any]]:
        runner, url = await _app_server()
        out = []
        conn = aiohttp.TCPConnector(force_close=True)  # an unreadable body ends its connection
        async with aiohttp.ClientSession(connector=conn) as s:
            for path, data, headers in [
                ("/echo", gzip.compress(b'{"a": 1}'), {"Content-Encoding": "gzip"}),
                ("/echo", b"not gzip at all", {"Content-Encoding": "gzip"}),
                ("/echo", b"x" * 5000, {}),
                ("/broken", b"{}", {"X-Request-Id": "req-42"}),
                ("/nowhere", b"{}", {}),
            ]:
                async with s.post(url + path, data=data, headers=headers) as r:
                    out.append((r.status, await r.json()))
        for raw in (b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n", b"\x16\x03\x01\x00\r\n\r\n"):
            status, head, body = await raw_http(url, raw)
            assert b"application/json" in head, head
            out.append((status, json.loads(body)))
        await runner.cleanup()
        return out

    results = asyncio.run(go())
    assert results[0] == (200, {"a": 1})
    for status, data in results[1:]:
        assert set(data["error"]) == {"message", "type", "param"}, data
    statuses = [s for s, _ in results[1:]]
    assert statuses == [400, 413, 500, 404, 400, 400]
    assert "could not be read" in results[1][1]["error"]["message"]
    assert "1024" in results[2][1]["error"]["message"]
    broken = results[3][1]["error"]
    assert broken["type"] == "internal_error" and "POST /broken (request req-42)" in broken["message"]
    assert "KeyError" in broken["message"]
