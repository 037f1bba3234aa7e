"""reverse_text with a skewed, difficulty-dependent scoring latency: a stand-in for agent environments whose
tool calls and sandboxes take seconds, used by `benchmarks/async_vs_sync.py` and the scheduler tests.

Scoring a completion sleeps for a lognormal time whose median grows with the task's length (longer texts are
the harder tasks here), and with probability `straggler_p` for `straggler_x` times as long. The draw is seeded
by the task and the completion, so a rerun sees the same latencies. Rewards are exactly reverse_text's.
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib

from arbor.environments.base import Task
from arbor.environments.reverse_text import ReverseTextEnv


class SkewedLatencyEnv(ReverseTextEnv):
    name = "skewed_latency"

    def __init__(
        self,
        median_s: float = 0.2,
        sigma: float = 0.8,
        straggler_p: float = 0.02,
        straggler_x: float = 20.0,
        **reverse_text_args,
    ) -> None:
        super().__init__(**reverse_text_args)
        if median_s < 0 or sigma < 0 or not 0 <= straggler_p <= 1 or straggler_x < 1:
            raise ValueError("need median_s >= 0, sigma >= 0, 0 <= straggler_p <= 1, straggler_x >= 1")
        self.median_s, self.sigma, self.straggler_p, self.straggler_x = median_s, sigma, straggler_p, straggler_x

    def latency(self, task: Task, completion: str) -> float:
        rng = random.Random(zlib.crc32(f"{task.get('id')}/{completion}".encode()))
        scale = len(task["text"]) / self.min_len  # harder (longer) tasks are slower
        seconds = rng.lognormvariate(math.log(max(self.median_s * scale, 1e-9)), self.sigma)
        if rng.random() < self.straggler_p:
            seconds *= self.straggler_x
        return seconds

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        await asyncio.sleep(self.latency(task, completion))
        return await super().score(task, completion)
