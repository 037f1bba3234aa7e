"""Gateway overhead: what the gateway adds to each model call of many concurrent black-box agent sessions.

64 sessions run 4-turn conversations at once through the gateway (real aiohttp server, real HTTP clients,
template rendering, token-exact splicing, recording) in front of a backend that answers instantly, so the time
measured is the gateway's own. Prints calls/s (the target: at least 200, i.e. under 5 ms of the event loop per
call, negligible next to a generation) with every call recorded, and the median and p95 latency seen by the
agents (mostly queueing: 64 requests share one event loop).

    uv run python benchmarks/gateway.py [--sessions 64] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp
from smoke import parse_args

from arbor.config.orchestrator import GatewayConfig
from arbor.models.tokenizer import ByteTokenizer
from arbor.orchestrator.client import Completion
from arbor.orchestrator.gateway.service import Gateway

TOK = ByteTokenizer()


class InstantBackend:
    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, stop=None):
        ids = TOK.encode("reply text") + [TOK.eos_token_id]
        return [Completion(ids, [-0.1] * len(ids), [0] * len(ids), "reply text", "stop") for _ in range(n)]


async def run(sessions: int, turns: int) -> dict:
    latencies: list[float] = []
    async with Gateway(
        InstantBackend(), TOK, GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=16, seq_len=8192
    ) as gw:
        ids = [gw.open().id for _ in range(sessions)]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def agent(sid: str) -> None:
                msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "start"}]
                for t in range(turns):
                    t0 = time.perf_counter()
                    async with http.post(gw.base_url(sid) + "/chat/completions", json={"messages": msgs}) as r:
                        reply = (await r.json())["choices"][0]["message"]
                    latencies.append(time.perf_counter() - t0)
                    msgs += [reply, {"role": "user", "content": f"turn {t}"}]

            t0 = time.perf_counter()
            await asyncio.gather(*(agent(s) for s in ids))
            wall = time.perf_counter() - t0
        recorded = [len((await gw.finish(s)).turns) for s in ids]
    return {"wall": wall, "latencies": latencies, "recorded": sum(recorded)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    a = parse_args(p, sessions=4, turns=2)
    out = asyncio.run(run(a.sessions, a.turns))
    lat = sorted(out["latencies"])
    median, p95 = statistics.median(lat) * 1e3, lat[int(0.95 * (len(lat) - 1))] * 1e3
    calls = a.sessions * a.turns
    print(
        f"{calls} calls in {out['wall']:.2f}s: {calls / out['wall']:.0f} calls/s, median {median:.1f} ms, p95 "
        f"{p95:.1f} ms"
    )
    print(
        json.dumps(
            {
                "benchmark": "gateway",
                "value": round(calls / out["wall"], 1),
                "target": 200.0,
                "ok": calls / out["wall"] >= 200.0 and out["recorded"] == calls,
                "unit": "calls/s",
                "median_ms": round(median, 2),
                "p95_ms": round(p95, 2),
                "recorded": out["recorded"],
                "calls": calls,
                "sessions": a.sessions,
                "turns": a.turns,
            }
        )
    )


if __name__ == "__main__":
    main()
