"""The orchestrator: tasks -> rollouts -> rewards -> advantages -> packed batches, one training step at a time.

Each step waits until the inference fleet serves a policy at most `lag(step)` versions behind the step (see
arbor.orchestrator.scheduler: 0 = synchronous on-policy; 1 = batch N+1 is generated while the trainer trains on
batch N), then takes `batch_size / group_size` finished groups from the generation queue under the scheduler's
window rule, drops groups with a token older than `max_off_policy_steps` (counted, and replaced), computes
advantages, packs micro-batches per trainer rank and writes them atomically to `rollouts/step_N/`. Weight
updates run in the background (`WeightSync`) and metrics are merged with the trainer's as they arrive
(`MetricsWriter`).

Per-step modes (sync, one_step_off: the default) launch exactly the step's groups when the step starts. The
continuous modes (async, greedy, windowed_fifo) keep up to `max_in_flight` groups generating across step
boundaries, so generation never idles while a step is written or the trainer catches up; groups still in
flight when a run stops are lost, and on resume their tasks are skipped, not repeated (the dataset position
is saved as launched).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import Any

from arbor.config.loader import load_config, main_guard
from arbor.config.orchestrator import OrchestratorConfig

log = logging.getLogger("arbor.orchestrator")


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig) -> None:
        from arbor.environments import load_environment
        from arbor.models import build_tokenizer

        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.model)
        self.env = load_environment(cfg.environment)
        self.tasks = self.env.dataset(cfg.seed)
        self.dropped_stale = 0
        self.skipped_long = 0
        self.groups_launched = 0
        self.gateway = None
        self.curriculum = None
        self.buffer = None
        self.filtered: dict[str, int] = {"zero_advantage": 0, "difficulty": 0, "env_skipped": 0}
        from arbor.orchestrator.episode import EpisodeStats

        self.env_stats = EpisodeStats()  # environment retries, failures and skips; multi-turn episode figures
        self._task_of_group: dict[int, dict] = {}
        from arbor.orchestrator.scheduler import RolloutQueue, SchedulePolicy

        self.policy = SchedulePolicy.from_config(cfg)
        self.queue: RolloutQueue[asyncio.Task] = RolloutQueue(self.policy.window)
        self._running: dict[int, asyncio.Task] = {}
        self.finished_groups = 0  # groups the generator has produced (for the production rate)
        self._last_write: float | None = None
        self._last_finished = 0

    async def run(self) -> None:
        from arbor.monitor.heartbeat import install
        from arbor.monitor.metrics import MetricsWriter, init_wandb
        from arbor.orchestrator.client import InferenceClient
        from arbor.orchestrator.state import OrchestratorState, TaskSampler, load_state
        from arbor.orchestrator.weights import WeightSync
        from arbor.trainer.checkpoint import latest_checkpoint

        cfg = self.cfg
        install(cfg.output_dir, "orchestrator")
        start = (latest_checkpoint(cfg.output_dir) or 0) if cfg.resume else 0
        state = load_state(cfg.output_dir, start) if start else OrchestratorState()
        self.sampler = TaskSampler(self.tasks, cfg.seed, state.epoch, state.position)
        if cfg.curriculum.enabled:
            from arbor.orchestrator.filters import CurriculumSampler

            self.curriculum = CurriculumSampler(self.tasks, cfg.seed, cfg.curriculum, state.curriculum)
        metrics = MetricsWriter(cfg.output_dir, init_wandb(cfg.wandb, cfg.output_dir, cfg.model_dump(mode="json")))
        if cfg.buffer.enabled or cfg.buffer.train_only:
            from arbor.orchestrator.buffer import ExperienceBuffer

            self.buffer = ExperienceBuffer(cfg.buffer.path or cfg.output_dir / "buffer.sqlite")
            if cfg.buffer.reuse:
                self.buffer.release(0)
            elif start:
                released = self.buffer.release(start)  # claims whose training the crash lost
                log.info("buffer: %d rollouts claimed for steps >= %d returned to the buffer", released, start)
        if cfg.buffer.train_only:
            background = [asyncio.create_task(self._poll_metrics(metrics))]
            try:
                for step in range(start, cfg.max_steps):
                    await self._step(step, None, None, metrics)
                await self._drain_metrics(metrics, None)
            finally:
                for t in background:
                    t.cancel()
                metrics.close()
                self.buffer.close()
            log.info("orchestrator done after %d steps (train-only from %s)", cfg.max_steps, self.buffer.path)
            return
        async with InferenceClient(cfg.client.base_urls, cfg.client.timeout, cfg.client.max_retries,
                                   admin_urls=cfg.client.admin_urls) as client:
            weights = WeightSync(client, cfg.output_dir, await client.wait_healthy(cfg.client.timeout))
            client.policy_version = weights.loaded_version
            background = [asyncio.create_task(weights.run()), asyncio.create_task(self._poll_metrics(metrics))]
            try:
                await self._start_gateway(client)
                if start:
                    log.info("resuming at step %d", start)
                    await weights.ensure(start, cfg.weight_update_timeout)
                for step in range(start, cfg.max_steps):
                    await self._step(step, client, weights, metrics)
                await self._drain_metrics(metrics, weights)
            finally:
                for t in [*background, *self._running.values()]:
                    t.cancel()
                if self.gateway is not None:
                    await self.gateway.stop()
                metrics.close()
                if self.buffer is not None:
                    self.buffer.close()
        log.info("orchestrator done after %d steps", cfg.max_steps)

    async def _step(self, step: int, client, weights, metrics) -> None:
        from arbor.monitor.heartbeat import beat
        from arbor.orchestrator.batcher import build_step_batches
        from arbor.orchestrator.state import OrchestratorState, prune_states, save_state
        from arbor.trainer.checkpoint import latest_checkpoint
        from arbor.transport.files import write_step

        cfg = self.cfg
        t0 = time.perf_counter()
        beat(f"waiting for policy version {max(0, step - self.policy.lag(step))} (step {step})")
        waited = 0.0 if weights is None else await weights.ensure(step - self.policy.lag(step), cfg.weight_update_timeout)
        t_gen = time.perf_counter()
        dropped_before, filtered_before = self.dropped_stale, sum(self.filtered.values())
        beat(f"generating and scoring step {step}")
        groups = await self._collect_groups(step, client, weights) if client is not None else []
        beat(f"packing and writing rollouts step {step}")
        gen_seconds = time.perf_counter() - t_gen
        dropped = self.dropped_stale - dropped_before + sum(self.filtered.values()) - filtered_before
        if self.buffer is not None:
            groups = self._through_buffer(step, groups)
        # The state step+1 resumes from is on disk before batch `step` is: the trainer cannot checkpoint step+1
        # without this batch, so no trainer checkpoint ever lacks its orchestrator state, wherever a kill lands.
        curriculum = self.curriculum.state() if self.curriculum is not None else None
        save_state(cfg.output_dir, OrchestratorState(step + 1, self.sampler.epoch, self.sampler.position, curriculum))
        prune_states(cfg.output_dir, latest_checkpoint(cfg.output_dir) or 0)
        rollouts = [r for g in groups for r in g]
        batches = build_step_batches(
            rollouts, step, cfg.batching.trainer_ranks, cfg.batching.micro_batch_tokens, cfg.temperature,
            self.tokenizer.pad_token_id, cfg.batching.normalization,
        )
        write_step(cfg.output_dir, step, batches)
        figures = self._figures(step, rollouts, gen_seconds, waited, time.perf_counter() - t0, weights, client)
        if client is not None:
            for name, value in (await client.router_stats()).items():  # cumulative fleet counters (replicas > 1)
                if name in ("requests", "retries", "ejections", "readmissions", "backends_in_rotation"):
                    figures[f"router/{name}"] = value
        figures.update(self._throughput(len(rollouts), dropped, waited))
        figures.update(self._difficulty_mix(groups))
        if client is not None and cfg.eval.interval and step % cfg.eval.interval == 0:
            from arbor.orchestrator.eval import client_generator, evaluate

            t_eval = time.perf_counter()
            figures.update(await evaluate(client_generator(client, cfg.eval), self.tokenizer, cfg.eval))
            figures["time/eval"] = time.perf_counter() - t_eval
        if self.buffer is not None:
            figures.update(self.buffer.counts())
        metrics.add(step, figures)

    async def _collect_groups(self, step: int, client, weights) -> list[list]:
        """Takes a step's groups from the generation queue (launching as the mode allows), replacing those
        dropped as too stale."""
        from arbor.orchestrator.advantages import compute_advantages
        from arbor.orchestrator.filters import filter_reason, solve_rate
        from arbor.orchestrator.rollout import generate_group

        cfg, pol, q = self.cfg, self.policy, self.queue
        need = cfg.batch_size // cfg.group_size
        weights_of = cfg.environment.reward_weights

        async def one(spec) -> list:
            if hasattr(self.env, "run_group"):  # black-box agents: the environment drives them via the gateway
                return await self.env.run_group(self.gateway, spec, cfg.group_size, weights_of, cfg.environment.timeout)
            return await generate_group(
                client, self.env, spec, cfg.group_size, cfg.sampling.max_tokens, cfg.temperature,
                cfg.sampling.top_p, weights_of, cfg.environment.timeout, generate=client.generate,
                env_cfg=cfg.environment, tokenizer=self.tokenizer, seq_len=cfg.seq_len, stats=self.env_stats,
            )

        def launch(k: int) -> None:
            pos = q.launch()
            task = asyncio.create_task(one(self._next_spec(step, k)))
            self._running[pos] = task
            task.add_done_callback(lambda t, p=pos: self._finished(p, t))

        kept: list[list] = []
        launched = filtered_here = 0
        while len(kept) < need:
            if pol.continuous:
                # Keep the fleet busy, but launch only groups the staleness bound will still admit when their
                # step comes: the outstanding groups fill the next outstanding // need steps (AReaL's rule).
                while q.in_flight < pol.max_in_flight and (
                    step + q.outstanding // need - weights.loaded_version <= cfg.max_off_policy_steps
                ):
                    launch(launched)
                    launched += 1
            else:  # exactly the step's groups (plus replacements), at most max_in_flight at once
                while len(kept) + q.in_flight + q.ready < need and q.in_flight < pol.max_in_flight:
                    launch(launched)
                    launched += 1
            taken = q.take(need - len(kept))
            for _, task in taken:
                group = task.result()  # a failed generation fails the run, as the client already retried
                task = self._task_of_group.pop(group[0].group_id, None) if group else None
                if not group:  # every rollout skipped after environment failures (counted in env/skipped)
                    self.filtered["env_skipped"] += 1
                    filtered_here += 1
                    if filtered_here > 50 * need and not kept:
                        raise RuntimeError(f"the environment failed every rollout of {filtered_here} groups in a row at step {step}")
                    continue
                if max(r.staleness(step) for r in group) > cfg.max_off_policy_steps:
                    self.dropped_stale += len(group)
                    continue
                compute_advantages([group], cfg.advantage)  # per group: advantages are group-relative
                if self.curriculum is not None and task is not None:
                    self.curriculum.record(task, solve_rate(group, cfg.filters.solve_threshold))
                reason = filter_reason(group, cfg.filters)
                if reason is not None:
                    self.filtered[reason] += len(group)
                    filtered_here += 1
                    if filtered_here > 50 * need and not kept:
                        raise RuntimeError(
                            f"orchestrator.filters dropped {filtered_here} groups in a row at step {step} "
                            f"(last reason: {reason}): loosen drop_zero_advantage / min_solve_rate / max_solve_rate"
                        )
                    continue
                kept.append(group)
            if len(kept) >= need:
                break
            if taken:  # some were dropped: launch replacements and look at the queue again before waiting
                continue
            if not self._running:
                raise RuntimeError(
                    f"scheduler stalled at step {step}: nothing running, {len(kept)}/{need} groups kept, queue head "
                    f"{q.head}, next {q.next_position}, in flight {q.in_flight}, waiting {q.waiting}, policy "
                    f"version {weights.loaded_version}"
                )
            await asyncio.wait(set(self._running.values()), return_when=asyncio.FIRST_COMPLETED)
        return kept

    async def _start_gateway(self, client) -> None:
        """The OpenAI-compatible gateway, when configured or when the environment drives black-box agents."""
        cfg = self.cfg
        if not (cfg.gateway.enabled or getattr(self.env, "needs_gateway", False)):
            return
        from arbor.orchestrator.gateway import Gateway

        self.gateway = Gateway(client, self.tokenizer, cfg.gateway, temperature=cfg.temperature,
                               top_p=cfg.sampling.top_p, max_tokens=cfg.sampling.max_tokens, seq_len=cfg.seq_len)
        url = await self.gateway.start()
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        (cfg.output_dir / "gateway_url").write_text(url + "\n")

    def _finished(self, position: int, task: asyncio.Task) -> None:
        self._running.pop(position, None)
        if task.cancelled():
            return
        self.finished_groups += 1
        self.queue.finish(position, task)

    def _through_buffer(self, step: int, groups: list[list]) -> list[list]:
        """Writes the step's new groups to the buffer, then claims the step's batch from it (which may include
        groups left from before a restart, or, train-only, only those)."""
        import uuid

        cfg = self.cfg
        for g in groups:
            self.buffer.put_group(g, uuid.uuid4().hex)
        need = cfg.batch_size // cfg.group_size
        claimed = self.buffer.claim(need, step, cfg.buffer.order)
        if not claimed:
            raise RuntimeError(f"buffer {self.buffer.path} has no ready, unclaimed group left for step {step}")
        if len(claimed) < need:
            log.warning("step %d: the buffer had only %d of %d groups", step, len(claimed), need)
        for k, g in enumerate(claimed):  # ids restart with each orchestrator run: make them unique in the batch
            for r in g:
                r.group_id = k
        return claimed

    def _difficulty_mix(self, groups: list[list]) -> dict[str, Any]:
        """The batch's difficulty mix: the fraction of its groups that are easy / normal / hard by their own solve
        rate (the curriculum's thresholds), plus the cumulative filter counts."""
        from arbor.orchestrator.filters import POOLS, difficulty, solve_rate

        cfg = self.cfg
        kinds = [difficulty(solve_rate(g, cfg.filters.solve_threshold), cfg.curriculum) for g in groups]
        out: dict[str, Any] = {f"batch/{p}_frac": kinds.count(p) / max(len(kinds), 1) for p in POOLS}
        out.update({f"filtered/{k}": v for k, v in self.filtered.items()})
        return out

    def _throughput(self, taken: int, dropped: int, waited: float) -> dict[str, Any]:
        """Throughput-matching figures: generator production vs trainer consumption, between two batch writes."""
        now = time.perf_counter()
        out: dict[str, Any] = {
            "scheduler/in_flight": self.queue.in_flight,
            "scheduler/ready": self.queue.ready,
            "scheduler/head": self.queue.head,
            "accepted/frac": taken / max(taken + dropped, 1),
        }
        if self._last_write is not None:
            interval = max(now - self._last_write, 1e-9)
            produced = (self.finished_groups - self._last_finished) * self.cfg.group_size
            out["throughput/produced_rollouts_per_s"] = produced / interval
            out["throughput/consumed_rollouts_per_s"] = taken / interval
            out["throughput/orchestrator_wait_ratio"] = min(waited / interval, 1.0)
        self._last_write, self._last_finished = now, self.finished_groups
        return out

    def _next_spec(self, step: int, k: int):
        from arbor.environments import env_prompt_ids
        from arbor.orchestrator.rollout import GroupSpec

        cfg = self.cfg
        while True:
            task = self.curriculum.next() if self.curriculum is not None else self.sampler.next()
            prompt_ids = env_prompt_ids(self.env, task, self.tokenizer)
            if len(prompt_ids) + cfg.sampling.max_tokens <= cfg.seq_len:
                seed = zlib.crc32(f"{cfg.seed}/{step}/{k}".encode()) & 0x7FFFFFFF
                self.groups_launched += 1
                self._task_of_group[self.groups_launched - 1] = task
                return GroupSpec(task, prompt_ids, seed, self.groups_launched - 1)
            self.skipped_long += 1

    def _figures(self, step, rollouts, gen_seconds, waited, step_seconds, weights, client) -> dict[str, Any]:
        import numpy as np

        from arbor.orchestrator.scheduler import staleness_histogram

        rewards = np.array([r.reward for r in rollouts])
        stale = np.array([r.staleness(step) for r in rollouts])
        comp_lens = np.array([r.num_trained for r in rollouts])  # sampled tokens (multi-turn: all turns)
        figures: dict[str, Any] = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/max": float(rewards.max()),
            "completion_len/mean": float(comp_lens.mean()),
            "truncated/frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "rollouts/s": len(rollouts) / max(gen_seconds, 1e-9),
            "staleness/max": int(stale.max()),
            "staleness/mean": float(stale.mean()),
            **staleness_histogram(stale.tolist()),
            "dropped/stale": self.dropped_stale,
            "skipped/too_long": self.skipped_long,
            "score/failed": int(sum(r.score_failed for r in rollouts)),
            **self._agent_figures(),
            "policy_version": weights.loaded_version if weights is not None else -1,
            "weights/updates": weights.updates if weights is not None else 0,
            "client/retries": client.retries if client is not None else 0,
            "time/generate": gen_seconds,
            "time/wait_weights": waited,
            "time/orchestrator_step": step_seconds,
            "epoch": self.sampler.epoch,
            **self.env_stats.figures(),
        }
        for name in sorted({k for r in rollouts for k in r.components}):
            figures[f"reward/{name}"] = float(np.mean([r.components.get(name, 0.0) for r in rollouts]))
        return figures

    def _agent_figures(self) -> dict[str, Any]:
        if self.gateway is None:
            return {}
        out = {"gateway/calls": self.gateway.calls, "gateway/open_sessions": len(self.gateway.sessions)}
        for name in ("failed", "retried"):
            if hasattr(self.env, name):
                out[f"agents/{name}"] = getattr(self.env, name)
        return out

    async def _poll_metrics(self, metrics) -> None:
        while True:
            metrics.poll()
            await asyncio.sleep(0.2)

    async def _drain_metrics(self, metrics, weights) -> None:
        """Waits for the trainer's figures of the last steps so that metrics.jsonl ends complete."""
        deadline = time.monotonic() + self.cfg.weight_update_timeout
        while metrics.pending and time.monotonic() < deadline:
            if weights is not None:
                weights.check()
            metrics.poll()
            await asyncio.sleep(0.1)
        if metrics.pending:
            raise TimeoutError(f"the trainer reported no metrics for steps {sorted(metrics.pending)}")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("aiohttp", "httpx", "openai"):  # httpx/openai: in-process black-box agents log every request
        logging.getLogger(noisy).setLevel(logging.WARNING)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(OrchestratorConfig, argv, prog="orchestrator")
    setup_logging(cfg.log_level)
    asyncio.run(Orchestrator(cfg).run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
