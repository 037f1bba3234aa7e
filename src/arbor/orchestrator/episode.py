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


@dataclasses.dataclass
class _Episode:
    """One episode's running state, shared by `run_episode` and its turn loop, so that what an environment
    failure interrupts is still counted (turns played, how it ended)."""

    tid: Any
    max_turns: int
    context: ContextPolicy | None
    policy: dict[str, Any]
    """`guarded`'s keyword arguments: the environment's timeout, retries and the stats to count them in."""
    full: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The whole conversation (the environment's view); the model's prompt is a possibly edited copy."""
    traj: Trajectory | None = None
    turns: int = 0
    finish: str = "max_turns"


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
    t0 = time.perf_counter()
    tid = task.get("id", -1)
    context = ContextPolicy(cfg.context) if cfg.context.strategy != "none" else None
    policy = {"timeout": cfg.timeout, "retries": cfg.retries, "stats": stats}
    ep = _Episode(tid, cfg.max_turns or env.max_turns, context, policy)
    failure = None
    try:
        state = await guarded(f"setup of task {tid}", env.setup, task, **policy)
        ep.traj = Trajectory(tokenizer, _open_conversation(env, task, ep))
        await _play_turns(generate, env, task, state, ep, settings, seed)
        components = await guarded(
            f"scoring of task {tid}", env.score_episode, task, state, ep.full, **policy, check=reward_components
        )
    except EnvFailure as e:
        log.warning("episode of task %s: %s", tid, e)
        failure, ep.finish, components = e, "env_failed", {}
    if not _tally(stats, ep, failure, cfg.on_failure):
        return []
    reward = total_reward(components, cfg.reward_weights) if failure is None else 0.0
    common = dict(
        score_failed=failure is not None, group_id=group_id, latency=time.perf_counter() - t0, episode_id=episode_id
    )
    rollouts = [] if ep.traj is None else ep.traj.rollouts(tid, reward, components, per_turn=failure is None, **common)
    stats.branches += len(rollouts)
    if not rollouts:  # failed before anything was generated: an empty rollout keeps the failure in the group
        prompt_ids, images = env_prompt(env, task, tokenizer)
        kept = dict(reward=reward, components=components, completion_mask=[], images=images, **common)
        return [Rollout(tid, prompt_ids, [], [], [], "", ep.finish, **kept)]
    return rollouts


def _open_conversation(env: MultiTurnEnvironment, task: Task, ep: _Episode) -> list[dict[str, Any]] | None:
    """Starts `ep.full` with the environment's prompt; returns its tools' schemas (None: no tools). The
    environment's own code: its failures are the episode's, like setup's (never retried)."""
    try:
        schemas = [tool_schema(fn) for fn in env.tools(task)] or None
        ep.full = list(env.prompt(task))
    except Exception as e:  # noqa: BLE001 - counted and scored like any environment failure
        raise EnvFailure(f"tools or prompt of task {ep.tid} failed: {e!r}") from e
    return schemas


async def _play_turns(
    generate: GenerateFn,
    env: MultiTurnEnvironment,
    task: Task,
    state: Any,
    ep: _Episode,
    settings: EpisodeSettings,
    seed: int | None,
) -> None:
    """Turn after turn until the environment is done, `max_turns` or the sample's `seq_len` (`ep.finish`):
    trim the context, generate one reply, pass it to `step`."""
    traj, tid, stats = ep.traj, ep.tid, ep.policy["stats"]
    view, num_prompt = list(ep.full), len(ep.full)
    while ep.turns < ep.max_turns:
        ids = _prompt_ids(traj, view, tid)
        if ep.context is not None and ep.turns and ep.context.should_edit(view, num_prompt, len(ids)):
            view = ep.context.edit(view, num_prompt)
            ids = _prompt_ids(traj, view, tid)  # history rewritten: the trajectory branches here
            stats.context_edits += 1
        budget = min(settings.max_tokens, settings.seq_len - len(ids))
        if budget < 1:
            ep.finish = "budget"
            return
        images = traj.pending_images
        extra = {"images": images} if images else {}
        (completion,) = await generate(
            ids, 1, budget, settings.temperature, settings.top_p, _turn_seed(seed, ep.turns), **extra
        )
        turn = traj.add_completion(completion)
        ep.turns += 1
        reply = {"role": "assistant", "content": completion.text}
        ep.full.append(reply)
        view.append(reply)
        result = await guarded(f"step of task {tid}", env.step, task, state, ep.full, **ep.policy, check=step_result)
        turn.reward = result.reward
        ep.full += result.messages
        view += result.messages
        if result.done:
            ep.finish = "done"
            return


def _tally(stats: EpisodeStats, ep: _Episode, failure: EnvFailure | None, on_failure: str) -> bool:
    """Counts the episode in `stats`; whether its rollouts are kept (not after a failure with `on_failure =
    "skip"`)."""
    stats.episodes += 1
    stats.turns += ep.turns
    stats.finished[ep.finish] = stats.finished.get(ep.finish, 0) + 1
    if failure is not None and on_failure == "skip":
        stats.skipped += 1
        return False
    if failure is not None:
        stats.failed += 1
    return True


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
