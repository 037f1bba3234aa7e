"""Fakes for the orchestrator parts' unit tests (no server, no model): a tiny environment whose prompts are as
many tokens as their text has characters, a tokenizer to match, and a scripted fleet."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from arbor.config.orchestrator import OrchestratorConfig
from arbor.orchestrator.client import Completion
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.episode import EpisodeStats
from arbor.orchestrator.generation import GenerationPool
from arbor.orchestrator.main import Slices, slice_config
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.scheduler import build_mode
from arbor.orchestrator.state import OrchestratorState
from arbor.orchestrator.tasks import TaskSource


def make_cfg(**over: Any) -> OrchestratorConfig:
    """batch_size 4, group_size 2 (two groups a step), max_tokens 8, unless overridden."""
    return OrchestratorConfig.model_validate(
        {"model": {"name": "qwen3-test"}, "batch_size": 4, "group_size": 2, "sampling": {"max_tokens": 8}, **over}
    )


def make_slices(**over: Any) -> Slices:
    """Each part's settings from `make_cfg(**over)`, as the orchestrator hands them out."""
    return slice_config(make_cfg(**over))


def seed_of(cfg: Any, step: int, k: int) -> int:
    """The sampling seed of the step's k-th launch (arbor.orchestrator.tasks); `cfg`: anything with the run's
    `seed` (the config, or the task source's settings)."""
    return zlib.crc32(f"{cfg.seed}/{step}/{k}".encode()) & 0x7FFFFFFF


class FakeTokenizer:
    pad_token_id = 0

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: Any = None):
        return [7] * len(messages[-1]["content"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class FakeEnv:
    """Tasks of the given prompt lengths; a completion scores 1 when it is "abc"."""

    name = "fake"

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def dataset(self, seed: int) -> list[dict[str, Any]]:
        return [{"id": i, "text": "x" * n} for i, n in enumerate(self.lengths)]

    def prompt(self, task: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": task["text"]}]

    async def score(self, task: dict[str, Any], completion: str) -> dict[str, float]:
        return {"match": float(completion == "abc")}

    def reference(self, task: dict[str, Any]) -> str | None:
        return None


async def settle(rounds: int = 500) -> None:
    """Lets every runnable coroutine run to its next real wait (a held fleet request, an event): many rounds of
    the event loop, however slow the machine. A wall-clock sleep is not enough: under CPU load it can end while
    a chain of ready callbacks is still halfway through."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Fleet:
    """Answers "abc" (3 tokens, policy `version`) at once; a request whose seed is in `slow` gets one token and
    waits until it is aborted (then answers that token, finish_reason "abort")."""

    def __init__(self) -> None:
        self.version = 0
        self.slow: set[int] = set()
        self.hold: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []

    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, request_id=None):
        if seed in self.slow and request_id not in self.aborted:
            version = self.version
            self.hold[request_id] = ev = asyncio.Event()
            await ev.wait()
            return [Completion([70], [-0.5], [version], "F", "abort") for _ in range(n)]
        return [
            Completion([65, 66, 67][:max_tokens], [-0.1] * 3, [self.version] * 3, "abc", "length") for _ in range(n)
        ]

    async def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            self.aborted.append(rid)
            if rid in self.hold:
                self.hold.pop(rid).set()


def group(group_id: int, rewards: list[float], version: int = 0) -> list[Rollout]:
    """A finished group: one rollout per reward, every token sampled by `version`."""
    return [
        Rollout(group_id, [1, 2], [65, 66], [-0.1, -0.2], [version, version], "ab", "stop", reward=r, group_id=group_id)
        for r in rewards
    ]


def make_pool(**over: Any) -> GenerationPool:
    """A generation pool over ten 4-token tasks of FakeEnv, with a fresh task source and counts, under the
    configured scheduling mode."""
    parts = make_slices(**over)
    env, tokenizer = FakeEnv([4] * 10), FakeTokenizer()
    source = TaskSource(parts.tasks, env, tokenizer, OrchestratorState())
    return GenerationPool(parts.generation, build_mode(parts.mode), env, tokenizer, source, Counts(), EpisodeStats())


def admit_once(pool: GenerationPool, fleet: Fleet, need: int = 2) -> int:
    """How many groups `pool` launches for a fresh step 0 on `fleet` (then stops them)."""

    async def go() -> int:
        pool.use(fleet)
        n = pool.admit(0, 0, need, 0, 0)
        await pool.stop()
        return n

    return asyncio.run(go())
