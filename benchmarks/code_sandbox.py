"""Throughput of the `code` environment's scoring: reference solutions of generated tasks scored through the
sandbox (one confined interpreter per completion, with every isolation layer this host offers), concurrently,
with hostile completions (an infinite loop and a fork bomb) mixed in as a real run would see them. The figure is
correct completions scored per second; the target (10/s) keeps scoring well below the time a CPU rollout group
takes to generate. Also printed: the median latency of one correct completion and the hostile ones' wall time.

    uv run python benchmarks/code_sandbox.py [--tasks 48] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from smoke import parse_args

from arbor.environments.code import CodeEnv
from arbor.environments.sandbox import detect_isolation

HOSTILE = [
    "while True:\n    pass\n",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
]


async def timed(coro):
    start = time.monotonic()
    result = await coro
    return result, time.monotonic() - start


async def main(args: argparse.Namespace) -> dict:
    env = CodeEnv(num_tasks=args.tasks, max_concurrency=args.concurrency, wall_seconds=3, cpu_seconds=2)
    tasks = env.dataset(0)
    await env.sandbox.run("pass")  # isolation probe and first start outside the measurement
    start = time.monotonic()
    good = [timed(env.score(t, env.reference(t))) for t in tasks]
    bad = [timed(env.score(tasks[i], f"```python\n{h}```")) for i, h in enumerate(HOSTILE)]
    results = await asyncio.gather(*good, *bad)
    wall = time.monotonic() - start
    good_results, bad_results = results[: len(tasks)], results[len(tasks) :]
    assert all(r["pass"] == 1.0 for r, _ in good_results), "a reference solution failed"
    assert all(r["pass"] == 0.0 for r, _ in bad_results), "a hostile completion passed"
    value = len(tasks) / wall
    return {
        "benchmark": "code_sandbox",
        "value": round(value, 2),
        "target": 10.0,
        "ok": value >= 10.0,
        "unit": "correct completions scored per second",
        "median_latency_s": round(statistics.median(s for _, s in good_results), 3),
        "hostile_wall_s": [round(s, 2) for _, s in bad_results],
        "concurrency": args.concurrency,
        "isolation": detect_isolation().mode,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    print(json.dumps(asyncio.run(main(parse_args(parser, tasks=4, concurrency=2)))))
