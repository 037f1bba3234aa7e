"""Group filters (zero advantage, online difficulty) and the easy / normal / hard curriculum sampler.

Filters run on each finished group as the scheduler hands it out, after its advantages: a dropped group is
counted and replaced by a newly generated one, so a batch always has `batch_size` rollouts. Dropping
zero-advantage groups is DAPO's dynamic sampling; the solve-rate band is online difficulty filtering.

`CurriculumSampler` keeps each task's recent solve rates (the last `history` groups), puts it in the easy pool
(mean >= easy_above), the hard pool (<= hard_below) or the normal pool (in between, or never seen), picks a
pool by the configured weights (renormalised over non-empty pools) and a task uniformly inside it. Its state
(the solve-rate history and the RNG position, as a draw count) is plain JSON for the orchestrator's resume file.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from arbor.config.orchestrator import CurriculumConfig, FilterConfig

POOLS = ("easy", "normal", "hard")


def solve_rate(group: list, threshold: float) -> float:
    return sum(r.reward >= threshold for r in group) / max(len(group), 1)


def filter_reason(group: list, cfg: FilterConfig) -> str | None:
    """Why a group (advantages already set) must be dropped, or None to keep it."""
    if cfg.drop_zero_advantage and all(
        abs(a) < 1e-8 for r in group for a in (r.token_advantages if r.token_advantages is not None else [r.advantage])
    ):
        return "zero_advantage"
    rate = solve_rate(group, cfg.solve_threshold)
    if not cfg.min_solve_rate <= rate <= cfg.max_solve_rate:
        return "difficulty"
    return None


def difficulty(rate: float | None, cfg: CurriculumConfig) -> str:
    if rate is None:
        return "normal"
    if rate >= cfg.easy_above:
        return "easy"
    if rate <= cfg.hard_below:
        return "hard"
    return "normal"


class CurriculumSampler:
    """Samples task indices from difficulty pools (see the module docstring)."""

    def __init__(self, tasks: list[dict[str, Any]], seed: int, cfg: CurriculumConfig, state: dict | None = None):
        if not tasks:
            raise ValueError("the environment's dataset is empty")
        self.tasks, self.cfg, self.seed = tasks, cfg, seed
        self.history: dict[int, deque[float]] = {}
        self.draws = 0
        self._rng = random.Random(seed)
        self._index = {id(t): i for i, t in enumerate(tasks)}
        if state:
            for k, rates in state.get("history", {}).items():
                self.history[int(k)] = deque(rates, maxlen=cfg.history)
            for _ in range(state.get("draws", 0)):  # replay the RNG to where it was
                self._draw()

    def rate(self, index: int) -> float | None:
        h = self.history.get(index)
        return sum(h) / len(h) if h else None

    def pools(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {p: [] for p in POOLS}
        for i in range(len(self.tasks)):
            out[difficulty(self.rate(i), self.cfg)].append(i)
        return out

    def _draw(self) -> tuple[float, float]:
        self.draws += 1
        return self._rng.random(), self._rng.random()

    def next_index(self) -> int:
        pools = self.pools()
        weights = [w if pools[p] else 0.0 for p, w in zip(POOLS, self.cfg.weights)]
        if sum(weights) <= 0:  # only pools with weight 0 are populated: fall back to all tasks
            weights = [float(bool(pools[p])) for p in POOLS]
        u, v = self._draw()
        acc, total = 0.0, sum(weights)
        for p, w in zip(POOLS, weights):
            acc += w / total
            if u < acc and pools[p]:
                return pools[p][int(v * len(pools[p]))]
        last = [p for p in POOLS if pools[p] and weights[POOLS.index(p)] > 0][-1]
        return pools[last][int(v * len(pools[last]))]

    def next(self) -> dict[str, Any]:
        return self.tasks[self.next_index()]

    def record(self, task: dict[str, Any], rate: float) -> None:
        i = self.index_of(task)
        self.history.setdefault(i, deque(maxlen=self.cfg.history)).append(rate)

    def index_of(self, task: dict[str, Any]) -> int:
        if id(task) not in self._index:
            raise KeyError("task not from this sampler's dataset")
        return self._index[id(task)]

    def state(self) -> dict[str, Any]:
        return {"history": {str(k): list(v) for k, v in self.history.items()}, "draws": self.draws}
