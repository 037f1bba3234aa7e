"""The evaluation core: the `eval` console script (arbor.eval) runs it once, `rl` periodically (`[orchestrator.eval]`).

For each eval environment, the first `num_tasks` tasks of `dataset(seed)` are sampled `k` times; each sample is
scored by the environment (reward components summed with its `reward_weights`). Reported per environment:
`avg@k` (mean reward over all samples), `pass@k` (fraction of tasks with at least one sample whose reward
reaches `solve_threshold`), `pass@1` (the unbiased single-sample solve rate c/n averaged over tasks), plus the
mean completion length, and `failed`: the samples (episodes) whose prompt could not be built or whose scoring
failed after the environment's retries or answered something that is not reward components
(arbor.environments.guard), each counted as reward 0, as in training, rather than ending the evaluation or the run
that called it. Generation goes through the same token-ids-in API as training: a running server (the
`InferenceClient`) or, standalone, arbor's local engine in the `eval` process (any `Generate` will do).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from arbor.config.eval import EvalSettings
from arbor.environments import env_prompt, is_multi_turn, load_environment, total_reward
from arbor.environments.guard import EnvFailure, guarded, reward_components
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.episode import EpisodeSettings, run_group_episodes

log = logging.getLogger("arbor.eval")

Generate = Callable[..., Awaitable[list[Any]]]
"""`InferenceClient.generate`'s signature: (prompt ids, n, max_tokens, temperature, top_p, seed) -> n completions
(token_ids, logprobs, policy_versions, text, finish_reason), so multi-turn environments run whole episodes."""


async def evaluate(
    generate: Generate,
    tokenizer: Tokenizer,
    cfg: EvalSettings,
    max_prompt: int | None = None,
    seq_len: int | None = None,
) -> dict[str, float]:
    """avg@k / pass@k / pass@1 per environment, as `eval/<env id>/<figure>`. A multi-turn environment plays `k`
    whole episodes per task (tools run, context managed, as in training; `seq_len` bounds a branch) and each
    episode counts once with its reward; an episode its environment failed for good counts as reward 0."""
    out: dict[str, float] = {}
    for env_cfg in cfg.environments:
        env = load_environment(env_cfg)
        tasks = env.dataset(cfg.seed)[: cfg.num_tasks]
        name = env_cfg.id.rsplit(":", 1)[-1]
        if is_multi_turn(env) and seq_len is None:
            raise ValueError(f"eval environment {env_cfg.id} is multi-turn: evaluate(..., seq_len=) is required")

        async def scored(task: dict, text: str) -> float | None:
            """The sample's reward; None when its scoring failed for good."""
            try:
                components = await guarded(
                    f"eval scoring of {name} task {task.get('id', '?')}",
                    env.score,
                    task,
                    text,
                    timeout=env_cfg.timeout,
                    retries=env_cfg.retries,
                    check=reward_components,
                )
            except EnvFailure as e:
                log.warning("%s", e)
                return None
            return total_reward(components, env_cfg.reward_weights)

        async def one(i: int, task: dict) -> tuple[list[float | None], list[int]]:
            seed = zlib.crc32(f"eval/{cfg.seed}/{name}/{i}".encode()) & 0x7FFFFFFF
            if is_multi_turn(env):
                return await _episodes(generate, env, env_cfg, task, tokenizer, cfg, seq_len, seed, i)
            try:
                prompt, images = env_prompt(env, task, tokenizer, env_cfg.prompt_format)
            except Exception as e:  # noqa: BLE001 - the environment's prompt for one task: its samples fail
                log.warning("eval task %s of %s skipped: its prompt could not be built: %r", i, env_cfg.id, e)
                return [None] * cfg.k, [0] * cfg.k
            if max_prompt is not None and len(prompt) > max_prompt:
                raise ValueError(f"eval task {i} of {env_cfg.id}: prompt of {len(prompt)} tokens exceeds {max_prompt}")
            extra = {"images": images} if images else {}  # a vision-language prompt's pixel inputs
            completions = await generate(prompt, cfg.k, cfg.max_tokens, cfg.temperature, cfg.top_p, seed, **extra)
            texts = [c.text for c in completions]
            return list(await asyncio.gather(*(scored(task, t) for t in texts))), [len(t) for t in texts]

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
        failed = sum(r is None for rs, _ in results for r in rs)
        results = [([0.0 if r is None else r for r in rs], ns) for rs, ns in results]
        rewards = [r for rs, _ in results for r in rs]
        solved = [sum(r >= cfg.solve_threshold for r in rs) for rs, _ in results]
        out[f"eval/{name}/avg@{cfg.k}"] = sum(rewards) / len(rewards)
        out[f"eval/{name}/pass@{cfg.k}"] = sum(c > 0 for c in solved) / len(solved)
        out[f"eval/{name}/pass@1"] = sum(c / cfg.k for c in solved) / len(solved)
        out[f"eval/{name}/completion_chars"] = sum(n for _, ns in results for n in ns) / len(rewards)
        out[f"eval/{name}/failed"] = failed
    return out


async def _episodes(
    generate: Generate,
    env,
    env_cfg,
    task: dict,
    tokenizer: Tokenizer,
    cfg: EvalSettings,
    seq_len: int,
    seed: int,
    i: int,
) -> tuple[list[float | None], list[int]]:
    """`k` episodes of one multi-turn task: per episode its reward (shared by its branches; None when its
    environment failed for good) and its text length."""
    settings = EpisodeSettings(cfg.max_tokens, cfg.temperature, cfg.top_p, seq_len, env_cfg)
    rollouts = await run_group_episodes(generate, env, task, tokenizer, settings, cfg.k, seed, i)
    episodes: dict[int, list] = {}
    for r in rollouts:
        episodes.setdefault(r.episode_id, []).append(r)
    rewards = [None if branches[0].score_failed else branches[0].reward for branches in episodes.values()]
    lengths = [sum(len(r.text) for r in branches) for branches in episodes.values()]
    missing = cfg.k - len(episodes)  # skipped after environment failures
    return rewards + [None] * missing, lengths + [0] * missing


def client_generator(client, cfg: EvalSettings) -> Generate:
    """The fleet's `generate` (the settings come with each call)."""
    return client.generate
