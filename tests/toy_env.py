"""A test-only environment added the way a new one is: this one module (the environment and its arguments model)
plus one entry in arbor.registry.ENVIRONMENTS (tests/environments/test_registry.py patches it in)."""

from __future__ import annotations

from pydantic import Field

from arbor.config.base import Int
from arbor.config.env_args import EnvArgs
from arbor.environments.protocol import Task


class RepeatArgs(EnvArgs):
    """The keyword arguments of RepeatEnv, with its defaults."""

    word: str = Field("ab", min_length=1)
    times: Int = Field(2, ge=1, le=9)


class RepeatEnv:
    """Repeat a word `times` times; reward 1 for the exact repetition."""

    name = "repeat"

    def __init__(self, word: str = "ab", times: int = 2) -> None:
        self.word, self.times = word, times

    def dataset(self, seed: int) -> list[Task]:
        return [{"id": 0, "prompt": [{"role": "user", "content": f"Repeat {self.word} {self.times} times"}]}]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        return task["prompt"]

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        return {"exact": float(completion.strip() == self.word * self.times)}

    def reference(self, task: Task) -> str | None:
        return self.word * self.times
