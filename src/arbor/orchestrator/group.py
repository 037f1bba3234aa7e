"""One group of rollouts: a task's prompt completed `group_size` times through the inference API, then scored;
or, for a multi-turn environment, `group_size` episodes (arbor.orchestrator.episode).

The orchestrator passes a `GroupHandle` (arbor.orchestrator.partial) as the client: the same `generate`, but
resumable across aborts, so a partial rollout arrives here already whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from arbor.config.environment import EnvironmentConfig
from arbor.environments import Environment, Task, is_multi_turn, total_reward
from arbor.environments.guard import EnvFailure, guarded, reward_components
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.episode import EpisodeSettings, run_group_episodes
from arbor.orchestrator.rollout import Rollout

if TYPE_CHECKING:
    from arbor.orchestrator.partial import GroupHandle

log = logging.getLogger("arbor.orchestrator.group")


@dataclasses.dataclass
class GroupSpec:
    task: Task
    prompt_ids: list[int]
    seed: int
    group_id: int = -1
    images: dict[str, Any] | None = None
    """A vision-language prompt's pixel inputs (arbor.environments.protocol.env_prompt); None for text."""


async def generate_group(
    client: "InferenceClient | GroupHandle | None",
    env: Environment,
    spec: GroupSpec,
    group_size: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    reward_weights: dict[str, float],
    score_timeout: float,
    *,
    generate: Callable[..., Awaitable[list[Any]]] | None = None,
    env_cfg: EnvironmentConfig | None = None,
    tokenizer: Tokenizer | None = None,
    seq_len: int | None = None,
    stats: Any = None,
) -> list[Rollout]:
    """One group. `generate` (default `client.generate`, same signature) is the only way to the fleet, so a
    caller may wrap it. A multi-turn environment runs `group_size` episodes (arbor.orchestrator.episode; needs
    `tokenizer` and `seq_len`), which may yield more rollouts than that (branches) or fewer (skipped failures)."""
    generate = generate or client.generate
    env_cfg = env_cfg or EnvironmentConfig(reward_weights=reward_weights, timeout=score_timeout, retries=0)
    if is_multi_turn(env):
        if tokenizer is None or seq_len is None:
            raise ValueError("a multi-turn environment needs generate_group(..., tokenizer=, seq_len=)")
        settings = EpisodeSettings(max_tokens, temperature, top_p, seq_len, env_cfg)
        return await run_group_episodes(
            generate, env, spec.task, tokenizer, settings, group_size, spec.seed, spec.group_id, stats
        )
    extra = {"images": spec.images} if spec.images else {}  # only a vision-language prompt's call carries it
    completions = await generate(spec.prompt_ids, group_size, max_tokens, temperature, top_p, spec.seed, **extra)
    rollouts = [
        Rollout(
            spec.task.get("id", -1),
            spec.prompt_ids,
            c.token_ids,
            c.logprobs,
            c.policy_versions,
            c.text,
            c.finish_reason,
            routed_experts=c.routed_experts,
            group_id=spec.group_id,
            pieces=c.pieces,
            images=spec.images,
        )
        for c in completions
    ]
    await asyncio.gather(*(_score(env, spec.task, r, env_cfg, stats) for r in rollouts))
    if env_cfg.on_failure == "skip":
        rollouts = [r for r in rollouts if not r.score_failed]
    return rollouts


async def _score(env: Environment, task: Task, r: Rollout, cfg: EnvironmentConfig, stats: Any) -> None:
    # A verifier that crashes or hangs must not stop the run: after its retries the rollout scores 0 and is
    # counted as failed, or is dropped and counted as skipped.
    try:
        r.components = await guarded(
            f"scoring task {r.task_id}",
            env.score,
            task,
            r.text,
            timeout=cfg.timeout,
            retries=cfg.retries,
            stats=stats,
            check=reward_components,
        )
        r.reward = total_reward(r.components, cfg.reward_weights)
    except EnvFailure as e:
        log.warning("%s", e)
        r.components, r.reward, r.score_failed = {}, 0.0, True
        if stats is not None:
            if cfg.on_failure == "skip":
                stats.skipped += 1
            else:
                stats.failed += 1
