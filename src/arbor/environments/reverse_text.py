"""reverse_text: the model must write the user's text backwards; reward = similarity to the exact reversal.

Tasks are generated locally from a seed (no download): short strings of lowercase letters and, optionally,
words. The reward is `difflib.SequenceMatcher.ratio` between the completion and the reversed text, in [0, 1],
so partially right answers earn partial credit, which is what lets a tiny model climb.
"""

from __future__ import annotations

import difflib
import random

from arbor.environments.protocol import Task

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class ReverseTextEnv:
    name = "reverse_text"

    def __init__(
        self,
        num_tasks: int = 20000,
        min_len: int = 3,
        max_len: int = 8,
        alphabet: str = LETTERS,
        system_prompt: str | None = None,
        instruction: str = "Reverse: ",
    ) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len})")
        self.num_tasks, self.min_len, self.max_len = num_tasks, min_len, max_len
        self.alphabet, self.system_prompt, self.instruction = alphabet, system_prompt, instruction

    def dataset(self, seed: int) -> list[Task]:
        rng = random.Random(seed)
        tasks = []
        for i in range(self.num_tasks):
            text = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
            tasks.append({"id": i, "text": text, "answer": text[::-1]})
        return tasks

    def prompt(self, task: Task) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": self.instruction + task["text"]}]

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        return {"similarity": difflib.SequenceMatcher(None, completion.strip(), task["answer"]).ratio()}

    def reference(self, task: Task) -> str | None:
        return task["answer"]
