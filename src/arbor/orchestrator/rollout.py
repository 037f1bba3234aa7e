"""One group of rollouts: a task's prompt completed `group_size` times through the inference API, then scored;
or, for a multi-turn environment, `group_size` episodes (arbor.orchestrator.episode).

A rollout keeps exactly the tokens the engine produced (never re-tokenised text), their logprobs and the
policy version that sampled each token; that is what the trainer's importance ratio and the staleness bound
are computed from. The orchestrator passes a `GroupHandle` (arbor.orchestrator.partial) as the client: the same
`generate`, but resumable across aborts, so a partial rollout arrives here already whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from arbor.config.environment import EnvironmentConfig
from arbor.environments import Environment, Task, is_multi_turn, total_reward
from arbor.environments.guard import EnvFailure, guarded, reward_components
from arbor.orchestrator.client import InferenceClient

if TYPE_CHECKING:
    from arbor.orchestrator.partial import GroupHandle

log = logging.getLogger("arbor.orchestrator.rollout")


@dataclasses.dataclass
class Rollout:
    task_id: int | str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    text: str
    finish_reason: str
    reward: float = 0.0
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    advantage: float = 0.0
    score_failed: bool = False
    routed_experts: Any = None
    """MoE router replay: `np.ndarray [num_tokens, moe_layers, top_k]` from the engine, carried as is."""
    group_id: int = -1
    """Which group (task instance) of the run this rollout belongs to."""
    turn_rewards: list[tuple[int, float]] | None = None
    """Per-turn or process rewards as (end offset in completion_ids, reward): the reward for the tokens up to
    that offset; multi-turn environments set it and `reward_to_go` turns it into per-token advantages."""
    token_advantages: list[float] | None = None
    """Per-completion-token advantages (reward-to-go); None means `advantage` on every token."""
    latency: float | None = None
    """Seconds from launch to finish, when the environment measures it per rollout (composite time reward)."""
    pieces: int = 1
    """Generation requests it took: > 1 for a partial rollout (aborted, then resumed with its tokens kept)."""
    completion_mask: list[int] | None = None
    """Multi-turn: 1 for completion tokens the policy sampled (trained), 0 for tokens the environment inserted
    (tool results, user turns, template glue: no loss, logprob 0, policy version -1). None means all ones."""
    episode_id: int = -1
    """Multi-turn: the episode a rollout came from; a branched episode gives several rollouts with one id."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each completion token given the tokens before it
    (arbor.orchestrator.teacher); None without a teacher."""
    teacher_topk_ids: Any = None
    """With `orchestrator.teacher.top_k = k`: `np.ndarray [C, k]` int32, the teacher's k most likely tokens at each
    completion position, best first; None otherwise."""
    teacher_topk_logprobs: Any = None
    """Their logprobs, `np.ndarray [C, k]` float32."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_trained(self) -> int:
        """Completion tokens that carry loss (the sampled ones)."""
        return len(self.completion_ids) if self.completion_mask is None else int(sum(self.completion_mask))

    def staleness(self, step: int) -> int:
        """Trainer steps between the oldest policy that sampled a token of this rollout and `step` (inserted
        tokens, version -1, do not count)."""
        if self.completion_mask is None:
            return step - min(self.policy_versions) if self.policy_versions else 0
        sampled = [v for v, m in zip(self.policy_versions, self.completion_mask) if m]
        return step - min(sampled) if sampled else 0


@dataclasses.dataclass
class GroupSpec:
    task: Task
    prompt_ids: list[int]
    seed: int
    group_id: int = -1


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
    tokenizer: Any = None,
    seq_len: int | None = None,
    stats: Any = None,
) -> list[Rollout]:
    """One group. `generate` (default `client.generate`, same signature) is the only way to the fleet, so a
    caller may wrap it. A multi-turn environment runs `group_size` episodes (arbor.orchestrator.episode; needs
    `tokenizer` and `seq_len`), which may yield more rollouts than that (branches) or fewer (skipped failures)."""
    generate = generate or client.generate
    env_cfg = env_cfg or EnvironmentConfig(reward_weights=reward_weights, timeout=score_timeout, retries=0)
    if is_multi_turn(env):
        from arbor.orchestrator.episode import EpisodeSettings, run_group_episodes  # episode imports Rollout

        if tokenizer is None or seq_len is None:
            raise ValueError("a multi-turn environment needs generate_group(..., tokenizer=, seq_len=)")
        settings = EpisodeSettings(max_tokens, temperature, top_p, seq_len, env_cfg)
        return await run_group_episodes(generate, env, spec.task, tokenizer, settings, group_size, spec.seed,
                                        spec.group_id, stats)
    completions = await generate(spec.prompt_ids, group_size, max_tokens, temperature, top_p, spec.seed)
    rollouts = [
        Rollout(
            spec.task.get("id", -1), spec.prompt_ids, c.token_ids, c.logprobs, c.policy_versions, c.text,
            c.finish_reason, routed_experts=c.routed_experts, group_id=spec.group_id, pieces=c.pieces,
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
        r.components = await guarded(f"scoring task {r.task_id}", env.score, task, r.text, timeout=cfg.timeout,
                                     retries=cfg.retries, stats=stats, check=reward_components)
        r.reward = total_reward(r.components, cfg.reward_weights)
    except EnvFailure as e:
        log.warning("%s", e)
        r.components, r.reward, r.score_failed = {}, 0.0, True
        if stats is not None:
            if cfg.on_failure == "skip":
                stats.skipped += 1
            else:
                stats.failed += 1
