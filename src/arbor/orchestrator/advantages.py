"""Group-relative advantages (the GRPO family) behind one typed signature, selectable by name or dotted path.

`grpo` subtracts the group mean; with `std_normalize` it also divides by the group's standard deviation (the
original GRPO). Without it this is Dr. GRPO's unbiased estimator, the default because the std division
up-weights near-solved and near-failed groups.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from arbor.config.orchestrator import AdvantageConfig
from arbor.environments import load_object


class AdvantageFn(Protocol):
    def __call__(self, rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
        """`rewards` `[num_groups, group_size]` -> advantages of the same shape."""
        ...


def grpo(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    adv = rewards - rewards.mean(axis=1, keepdims=True)
    if cfg.std_normalize:
        adv = adv / (rewards.std(axis=1, keepdims=True) + 1e-6)
    return adv


BUILTINS: dict[str, AdvantageFn] = {"grpo": grpo}


def resolve_advantage(name: str) -> AdvantageFn:
    return BUILTINS[name] if name in BUILTINS else load_object(name)


def compute_advantages(groups: list[list], cfg: AdvantageConfig) -> None:
    """Sets `.advantage` on every rollout of every group (all groups have the same size)."""
    if not groups:
        return
    fn = resolve_advantage(cfg.name)
    rewards = np.array([[r.reward for r in g] for g in groups], dtype=np.float64)
    adv = np.asarray(fn(rewards, cfg), dtype=np.float64)
    if adv.shape != rewards.shape:
        raise ValueError(f"advantage function {cfg.name!r} returned shape {adv.shape}, expected {rewards.shape}")
    for g, row in zip(groups, adv):
        for r, a in zip(g, row):
            r.advantage = float(a)
