"""Latency the built-in router adds per request: p50/p99 through the router minus calling the backend directly.

A trivial aiohttp backend (a ~1 KB completion-shaped JSON answer, no compute) runs in its own process, the
router in another, and one client sends sequential requests (one in flight, pooled connections) first to
the backend, then through the router, interleaved in rounds so machine load affects both alike. Target: the
added p50 under 1 ms.

    uv run python benchmarks/router.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import time
import urllib.request

import aiohttp
from aiohttp import web
from smoke import parse_args

from arbor.config.inference import RouterConfig
from arbor.inference.router.app import serve

TARGET_MS = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(port: int) -> None:
    body = json.dumps(
        {"choices": [{"index": 0, "text": "x" * 200, "token_ids": list(range(100)), "policy_versions": [0] * 100}]}
    )

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text=body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "policy_version": 0})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", complete), web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _router(port: int, backend: str) -> None:
    asyncio.run(serve(RouterConfig(backends=[backend], port=port, policy="least_outstanding")))


async def _measure(url: str, n: int) -> list[float]:
    body = json.dumps({"prompt": list(range(50)), "max_tokens": 100}).encode()
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(50):  # warm-up: connections, caches
            async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
            out.append(time.perf_counter() - t0)
    return out


def _wait(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    a = parse_args(ap, requests=40, rounds=1)
    bport, rport = _free_port(), _free_port()
    backend, router = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{rport}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_backend, args=(bport,), daemon=True),
        ctx.Process(target=_router, args=(rport, backend), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        _wait(backend)
        _wait(router)
        direct, routed = [], []
        per = max(1, a.requests // a.rounds)
        for _ in range(a.rounds):
            direct += asyncio.run(_measure(backend + "/v1/completions", per))
            routed += asyncio.run(_measure(router + "/v1/completions", per))
    finally:
        for p in procs:
            p.terminate()
            p.join(5)
    d50, d99 = _pct(direct, 0.5) * 1e3, _pct(direct, 0.99) * 1e3
    r50, r99 = _pct(routed, 0.5) * 1e3, _pct(routed, 0.99) * 1e3
    added50, added99 = r50 - d50, r99 - d99
    print(
        f"direct p50 {d50:.3f} ms p99 {d99:.3f} ms | via router p50 {r50:.3f} ms p99 {r99:.3f} ms "
        f"| mean direct {statistics.mean(direct) * 1e3:.3f} ms routed {statistics.mean(routed) * 1e3:.3f} ms"
    )
    print(
        json.dumps(
            {
                "benchmark": "router",
                "value": round(added50, 3),
                "target": TARGET_MS,
                "ok": added50 < TARGET_MS,
                "unit": "ms added at p50",
                "added_p99_ms": round(added99, 3),
                "direct_p50_ms": round(d50, 3),
                "routed_p50_ms": round(r50, 3),
                "requests": len(routed),
            }
        )
    )


if __name__ == "__main__":
    main()
