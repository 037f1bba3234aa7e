"""Malformed requests for the servers' fuzz tests, from a seeded RNG: the kinds a hostile client sends (random
bytes, deep nesting, bad gzip, lone surrogates, NaN and Infinity, out-of-range seeds and sizes, wrong types,
non-object JSON, invalid UTF-8), and the check every answer must pass."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
from typing import Any

import aiohttp

BAD_VALUES: list[Any] = [
    None,
    0,
    -1,
    1.5,
    True,
    "x",
    "",
    [],
    {},
    [1, "a"],
    {"role": 3},
    "\udcff",
    "a\ud800b",
    10**30,
    -(10**30),
    2**64,
    2**63,
    [[1]],
    [{"a": {}}],
    float("nan"),
    float("inf"),
    -float("inf"),
    1e308,
    -1e308,
    1e-30,
    [10**9],
    [-5],
    "é" * 50,
    ["\udc80"],
    {"content": "\udfff"},
    [[1, 2], "x"],
    2**31,
    -(2**63),
]
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "stream",
    "request_id",
    "return_token_ids",
    "skip_special_tokens",
    "cache_salt",
    "tools",
    "stream_options",
    "path",
    "version",
    "request_ids",
    "reward",
    "components",
]
SPECIAL: list[dict[str, Any]] = [  # the cases measured on main, each in every fuzz run
    {"seed": 2**64},
    {"seed": 2**63},
    {"seed": -1},
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"temperature": 1e308},
    {"temperature": 1e-40},
    {"top_p": float("nan")},
    {"prompt": "\udcff"},
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"prompt": [10**9]},
    {"prompt": [-1]},
    {"max_tokens": 10**30},
    {"n": 10**6},
    {"stop": ["x"] * 1000},
]


def encode(body: Any) -> bytes:
    # ensure_ascii writes lone surrogates as \u escapes and NaN/Infinity as their literals, as a hostile client may
    return json.dumps(body, ensure_ascii=True).encode()


def malformed(rng: random.Random, valid: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """One bad request (body, extra headers) built around a `valid` body."""
    kind = rng.randrange(12)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))), {}
    if kind == 1:
        depth = rng.choice([65, 200, 1000, 5000, 20000])
        nested = b"[" * depth + b"]" * depth
        return (nested if rng.random() < 0.5 else b'{"prompt": ' + nested + b"}"), {}
    if kind == 2:
        payload = rng.choice([b"not gzip", b"\x1f\x8b\x08\x00garbage", gzip.compress(encode(valid))[:12]])
        return payload, {"Content-Encoding": rng.choice(["gzip", "deflate"])}
    if kind == 3:
        return encode({**valid, rng.choice(FIELDS): rng.choice(["\udcff", "x\ud800", ["\udc80"]])}), {}
    if kind == 4:
        return encode({**valid, **rng.choice(SPECIAL)}), {}
    if kind == 5:
        return b'{"seed": ' + b"9" * rng.choice([20, 5000]) + b', "prompt": "x"}', {}
    if kind == 6:
        return encode(rng.choice([[valid], "prompt", 3, None, True])), {}
    if kind == 7:
        return b'{"prompt": "\xff\xfe\xc3"}', {}
    body = dict(valid)
    for field in rng.sample(FIELDS, rng.randrange(1, 5)):
        body[field] = rng.choice(BAD_VALUES)
    return encode(body), {}


async def send(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    async with session.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as r:
        text = await r.read()
        ctype = r.content_type
    return r.status, (json.loads(text) if ctype == "application/json" else text)


def check_answer(status: int, data: Any, context: Any) -> None:
    """No 5xx, and every refusal in the one JSON error shape."""
    assert status < 500, (context, status, data)
    if status >= 400:
        assert isinstance(data, dict) and set(data["error"]) >= {"message", "type", "param"}, (context, data)


async def raw_http(url: str, data: bytes) -> tuple[int, bytes, bytes]:
    """Sends `data` as-is to the server at `url` (bytes no HTTP client would send); answers the response's status,
    header block and body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    out = await reader.read()
    writer.close()
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, body
