"""reverse_text with a skewed, difficulty-dependent scoring latency: a stand-in for agent environments whose
tool calls and sandboxes take seconds, used by `benchmarks/async_vs_sync.py` and the scheduler tests.

Scoring a completion sleeps for a lognormal time whose median grows with the task's length (longer texts are
the harder tasks here), and with probability `straggler_p` for `straggler_x` times as long. The k-th scoring of
a task draws its cost from a generator seeded by the task and k, not by the completion: two runs that score
the same tasks (the two arms of benchmarks/async_vs_sync.py, a rerun) meet the same costs, whatever their
policies wrote (common random numbers: a comparison's spread then comes from the schedules, not from which run
drew the rare compute-bound stragglers). Rewards are exactly reverse_text's.

With `compute_p > 0`, that share of the scorings is compute-bound instead of latency-bound: the drawn time is
spent as CPU time (hashing in a worker thread, which releases the GIL, like a verifier running tests), so it
competes for the cores with the trainer and the inference engine instead of overlapping them for free.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
import zlib

from arbor.environments.protocol import Task
from arbor.environments.reverse_text import ReverseTextEnv


class SkewedLatencyEnv(ReverseTextEnv):
    name = "skewed_latency"

    def __init__(
        self,
        median_s: float = 0.2,
        sigma: float = 0.8,
        straggler_p: float = 0.02,
        straggler_x: float = 20.0,
        compute_p: float = 0.0,
        **reverse_text_args,
    ) -> None:
        super().__init__(**reverse_text_args)
        if median_s < 0 or sigma < 0 or not 0 <= straggler_p <= 1 or straggler_x < 1 or not 0 <= compute_p <= 1:
            raise ValueError(
                "need median_s >= 0, sigma >= 0, 0 <= straggler_p <= 1, straggler_x >= 1, 0 <= compute_p <= 1"
            )
        self.median_s, self.sigma, self.straggler_p, self.straggler_x = median_s, sigma, straggler_p, straggler_x
        self.compute_p = compute_p
        self.scorings: dict[str, int] = {}
        """Scorings so far per task id: the next one's draw."""

    def cost(self, task: Task, draw: int) -> tuple[float, bool]:
        """Seconds that the `draw`-th scoring of `task` takes, and whether they are CPU time (True) or waiting
        (False)."""
        rng = random.Random(zlib.crc32(f"{task.get('id')}/{draw}".encode()))
        scale = len(task["text"]) / self.min_len  # harder (longer) tasks are slower
        seconds = rng.lognormvariate(math.log(max(self.median_s * scale, 1e-9)), self.sigma)
        if rng.random() < self.straggler_p:
            seconds *= self.straggler_x
        return seconds, rng.random() < self.compute_p

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        key = str(task.get("id"))
        draw = self.scorings.get(key, 0)
        self.scorings[key] = draw + 1
        seconds, compute = self.cost(task, draw)
        if compute:
            await asyncio.to_thread(burn_cpu, seconds)
        else:
            await asyncio.sleep(seconds)
        return await super().score(task, completion)


def burn_cpu(seconds: float) -> None:
    """Spends `seconds` of this thread's CPU time; hashlib releases the GIL on large buffers, so the event loop
    keeps running while the work takes a core."""
    block = bytes(1 << 16)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(block).digest()
