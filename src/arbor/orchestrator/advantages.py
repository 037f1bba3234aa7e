"""Advantages (the GRPO family: `grpo`, `drgrpo`, `rloo`) behind one typed signature, reward-to-go for per-turn
rewards, and composite rewards with a relative-completion-time term.

A group's rewards `[num_groups, group_size]` in, advantages of the same shape out; branched episodes count once
per episode. The estimators, reward-to-go and the completion-time bonus: docs/training.md, "Advantages".
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from arbor.config.orchestrator import AdvantageConfig
from arbor.registry import ADVANTAGES


class AdvantageFn(Protocol):
    def __call__(self, rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
        """`rewards` `[num_groups, group_size]` -> advantages of the same shape."""
        ...


def grpo(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    adv = rewards - rewards.mean(axis=1, keepdims=True)
    if cfg.std_normalize:
        adv = adv / (_std(rewards, cfg.std_ddof, axis=1) + 1e-6)
    return adv


def _std(x: np.ndarray, ddof: int, axis: int | None = None) -> np.ndarray:
    """Standard deviation with `ddof` (AdvantageConfig.std_ddof); 0 where there are no more values than ddof."""
    n = x.shape[axis] if axis is not None else x.size
    if n <= ddof:
        return np.zeros_like(x.mean(axis=axis, keepdims=axis is not None))
    return x.std(axis=axis, ddof=ddof, keepdims=axis is not None)


def drgrpo(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    return rewards - rewards.mean(axis=1, keepdims=True)


def rloo(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    k = rewards.shape[1]
    if k < 2:
        return np.zeros_like(rewards)
    others = (rewards.sum(axis=1, keepdims=True) - rewards) / (k - 1)
    return rewards - others


def resolve_advantage(name: str) -> AdvantageFn:
    """A registered advantage (arbor.registry.ADVANTAGES) by name, or a user function by dotted path."""
    return ADVANTAGES.load(name)


def completion_time_bonus(group: list, weight: float) -> None:
    """Adds the relative-completion-time component to the successful rollouts of one group (in place)."""
    winners = [r for r in group if r.reward > 0]
    if weight <= 0 or not winners:
        return
    cost = np.array([r.latency if r.latency is not None else r.num_trained for r in winners], float)
    span = cost.max() - cost.min()
    for r, c in zip(winners, cost):
        bonus = weight * (cost.max() - c) / span if span > 0 else 0.0
        r.components["completion_time"] = float(bonus)
        r.reward += float(bonus)
        if r.turn_rewards:  # reward-to-go reads the turns: the outcome (last turn) carries the bonus too
            *head, (end, last) = r.turn_rewards
            r.turn_rewards = [*head, (end, last + float(bonus))]


def _turns(r) -> list[tuple[int, float]]:
    return list(r.turn_rewards) if r.turn_rewards else [(len(r.completion_ids), r.reward)]


def reward_to_go(group: list, cfg: AdvantageConfig) -> None:
    """Per-token advantages for one group from per-turn rewards (see the module docstring); sets
    `token_advantages` and `advantage` (the first token's value) on every rollout."""
    all_rewards = np.array([rw for r in group for _, rw in _turns(r)], float)
    mean = all_rewards.mean()
    scale = _std(all_rewards, cfg.std_ddof) + 1e-6 if cfg.std_normalize else 1.0
    for r in group:
        turns = _turns(r)
        ends = [int(e) for e, _ in turns]
        n = len(r.completion_ids)
        if any(b < a for a, b in zip(ends, ends[1:])) or (ends and (ends[0] < 0 or ends[-1] > n)):
            raise ValueError(f"rollout of task {r.task_id}: turn_rewards offsets {ends} must rise within 0..{n}")
        norm = [(rw - mean) / scale for _, rw in turns]
        togo = [0.0] * len(norm)
        acc = 0.0
        for k in range(len(norm) - 1, -1, -1):
            acc = norm[k] + cfg.gamma * acc
            togo[k] = acc
        adv = np.zeros(len(r.completion_ids), np.float32)
        start = 0
        for end, value in zip(ends, togo):
            adv[start:end] = value
            start = end
        r.token_advantages = adv.tolist()
        r.advantage = float(togo[0]) if togo else 0.0


def _branched(group: list) -> bool:
    ids = [r.episode_id for r in group if getattr(r, "episode_id", -1) >= 0]
    return len(ids) != len(set(ids))


def _episode_advantages(group: list, fn: AdvantageFn, cfg: AdvantageConfig) -> None:
    """One advantage per episode (its reward counted once), shared by the episode's branches."""
    episodes: dict[object, list] = {}
    for i, r in enumerate(group):
        episodes.setdefault(r.episode_id if r.episode_id >= 0 else ("rollout", i), []).append(r)
    members = list(episodes.values())
    rewards = np.array([[m[0].reward for m in members]], dtype=np.float64)
    adv = np.asarray(fn(rewards, cfg), dtype=np.float64)
    if adv.shape != rewards.shape:
        raise ValueError(f"advantage function {cfg.name!r} returned shape {adv.shape}, expected {rewards.shape}")
    for m, a in zip(members, adv[0]):
        for r in m:
            r.advantage = float(a)


def compute_advantages(groups: list[list], cfg: AdvantageConfig) -> None:
    """Sets `.advantage` (and, for groups with per-turn rewards, `.token_advantages`) on every rollout.
    Groups may differ in size (e.g. after a filter): each size is computed as its own batch."""
    if not groups:
        return
    fn = resolve_advantage(cfg.name)
    for g in groups:
        completion_time_bonus(g, cfg.completion_time_weight)
    by_size: dict[int, list[list]] = {}
    for g in groups:
        if any(r.turn_rewards for r in g):
            reward_to_go(g, cfg)
        elif _branched(g):
            _episode_advantages(g, fn, cfg)
        else:
            by_size.setdefault(len(g), []).append(g)
    for size, same in by_size.items():
        rewards = np.array([[r.reward for r in g] for g in same], dtype=np.float64)
        adv = np.asarray(fn(rewards, cfg), dtype=np.float64)
        if adv.shape != rewards.shape:
            raise ValueError(f"advantage function {cfg.name!r} returned shape {adv.shape}, expected {rewards.shape}")
        for g, row in zip(same, adv):
            for r, a in zip(g, row):
                r.advantage = float(a)
