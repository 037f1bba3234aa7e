"""The multi-turn rollout driver: one episode of a MultiTurnEnvironment, recorded token-exactly.

`setup`, then turn after turn: trim the context, build the prompt ids with a `Trajectory`, generate one sample,
pass the reply to `step`; until done, `max_turns` or `seq_len`; then `score_episode`. Every branch becomes a
Rollout with the episode's reward; failures are scored 0 or skipped (docs/agents.md, "Multi-turn episodes").
With a vision-language tokenizer, image parts in the prompt or in the environment's later messages are rendered
by the trajectory each turn: a turn's call carries every image so far (`images`), and each rollout its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from arbor.config.environment import EnvironmentConfig
from arbor.environments.context import ContextPolicy
from arbor.environments.guard import EnvFailure, EnvStats, guarded, reward_components, step_result
from arbor.environments.protocol import MultiTurnEnvironment, Task, env_prompt, total_reward
from arbor.environments.tools import tool_schema
from arbor.models.image_parts import ImageRefused
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.trajectory import Trajectory

log = logging.getLogger("arbor.orchestrator.episode")

GenerateFn = Callable[..., Awaitable[list[Any]]]
"""`(prompt_ids, n, max_tokens, temperature, top_p, seed[, images=]) -> list[Completion]`, as
InferenceClient.generate (`images` only for a prompt with images)."""


@dataclasses.dataclass
class EpisodeSettings:
    max_tokens: int
    """Most tokens generated per turn."""
    temperature: float
    top_p: float
    seq_len: int
    """Most tokens of one sample (a branch: its prompt plus all later turns)."""
    env: EnvironmentConfig


@dataclasses.dataclass
class EpisodeStats(EnvStats):
    episodes: int = 0
    turns: int = 0
    branches: int = 0
    context_edits: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    """Why episodes ended: done, max_turns, budget, env_failed."""

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"env/{k}": getattr(self, k) for k in ("retries", "timeouts", "failed", "skipped")}
        if self.episodes:
            out["episode/turns_mean"] = self.turns / self.episodes
            out["episode/branches_mean"] = self.branches / self.episodes
            out["episode/context_edits"] = self.context_edits
            out.update({f"episode/ended_{k}": v for k, v in sorted(self.finished.items())})
        return out


def _turn_seed(seed: int | None, turn: int) -> int | None:
    return None if seed is None else (seed + 7919 * turn) & 0x7FFFFFFF


def _prompt_ids(traj: Trajectory, view: list[dict[str, Any]], tid: Any) -> list[int]:
    """The next turn's ids; images the model cannot take (a text model, a missing file: ImageRefused) fail the
    episode like any environment failure, in one line."""
    try:
        return traj.prompt_ids(view)
    except ImageRefused as e:
        raise EnvFailure(f"the conversation of task {tid} cannot be rendered: {e}") from None


async def run_episode(
    generate: GenerateFn,
    env: MultiTurnEnvironment,
    task: Task,
    tokenizer: Tokenizer,
    settings: EpisodeSettings,
    seed: int | None = None,
    group_id: int = -1,
    episode_id: int = -1,
    stats: EpisodeStats | None = None,
) -> list[Rollout]:
    """The rollouts (one per branch) of one episode; empty when it was skipped after an environment failure."""
    cfg = settings.env
    stats = stats if stats is not None else EpisodeStats()
    policy = {"timeout": cfg.timeout, "retries": cfg.retries, "stats": stats}
    t0 = time.perf_counter()
    tid = task.get("id", -1)
    max_turns = cfg.max_turns or env.max_turns
    context = ContextPolicy(cfg.context) if cfg.context.strategy != "none" else None
    traj: Trajectory | None = None
    full: list[dict[str, Any]] = []
    turns, finish, failure = 0, "max_turns", None
    try:
        state = await guarded(f"setup of task {tid}", env.setup, task, **policy)
        try:  # the environment's own code: its failures are the episode's, like setup's (never retried)
            schemas = [tool_schema(fn) for fn in env.tools(task)] or None
            full = list(env.prompt(task))
        except Exception as e:  # noqa: BLE001 - counted and scored like any environment failure
            raise EnvFailure(f"tools or prompt of task {tid} failed: {e!r}") from e
        traj = Trajectory(tokenizer, schemas)
        view, num_prompt = list(full), len(full)
        while turns < max_turns:
            ids = _prompt_ids(traj, view, tid)
            if context is not None and turns and context.should_edit(view, num_prompt, len(ids)):
                view = context.edit(view, num_prompt)
                ids = _prompt_ids(traj, view, tid)  # history rewritten: the trajectory branches here
                stats.context_edits += 1
            budget = min(settings.max_tokens, settings.seq_len - len(ids))
            if budget < 1:
                finish = "budget"
                break
            images = traj.pending_images
            extra = {"images": images} if images else {}
            (completion,) = await generate(
                ids, 1, budget, settings.temperature, settings.top_p, _turn_seed(seed, turns), **extra
            )
            turn = traj.add_completion(completion)
            turns += 1
            reply = {"role": "assistant", "content": completion.text}
            full.append(reply)
            view.append(reply)
            result = await guarded(f"step of task {tid}", env.step, task, state, full, **policy, check=step_result)
            turn.reward = result.reward
            full += result.messages
            view += result.messages
            if result.done:
                finish = "done"
                break
        components = await guarded(
            f"scoring of task {tid}", env.score_episode, task, state, full, **policy, check=reward_components
        )
    except EnvFailure as e:
        log.warning("episode of task %s: %s", tid, e)
        failure, finish, components = e, "env_failed", {}
    stats.episodes += 1
    stats.turns += turns
    stats.finished[finish] = stats.finished.get(finish, 0) + 1
    if failure is not None and cfg.on_failure == "skip":
        stats.skipped += 1
        return []
    if failure is not None:
        stats.failed += 1
    reward = total_reward(components, cfg.reward_weights) if failure is None else 0.0
    common = dict(
        score_failed=failure is not None, group_id=group_id, latency=time.perf_counter() - t0, episode_id=episode_id
    )
    rollouts = [] if traj is None else traj.rollouts(tid, reward, components, per_turn=failure is None, **common)
    stats.branches += len(rollouts)
    if not rollouts:  # failed before anything was generated: an empty rollout keeps the failure in the group
        prompt_ids, images = env_prompt(env, task, tokenizer)
        return [
            Rollout(
                tid,
                prompt_ids,
                [],
                [],
                [],
                "",
                finish,
                reward=reward,
                components=components,
                completion_mask=[],
                images=images,
                **common,
            )
        ]
    return rollouts


async def run_group_episodes(
    generate: GenerateFn,
    env: MultiTurnEnvironment,
    task: Task,
    tokenizer: Tokenizer,
    settings: EpisodeSettings,
    group_size: int,
    seed: int,
    group_id: int = -1,
    stats: EpisodeStats | None = None,
) -> list[Rollout]:
    """`group_size` concurrent episodes of one task; their rollouts (several per branched episode)."""
    runs = [
        run_episode(
            generate,
            env,
            task,
            tokenizer,
            settings,
            (seed + 104729 * k) & 0x7FFFFFFF,
            group_id,
            max(group_id, 0) * group_size + k,
            stats,
        )
        for k in range(group_size)
    ]
    return [r for rollouts in await asyncio.gather(*runs) for r in rollouts]
