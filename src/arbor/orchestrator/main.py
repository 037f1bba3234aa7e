"""The orchestrator: tasks -> rollouts -> rewards -> advantages -> packed batches, one training step at a time.

Each step waits until the inference fleet serves a policy at most `async_lag` versions behind the step
(0 = synchronous on-policy; 1 = batch N+1 is generated while the trainer trains on batch N), generates
`batch_size / group_size` groups concurrently, drops groups with a token older than `max_off_policy_steps`
(counted, and replaced), computes group-relative advantages, packs micro-batches per trainer rank and writes
them atomically to `rollouts/step_N/`. Weight updates run in the background (`WeightSync`) and metrics are
merged with the trainer's as they arrive (`MetricsWriter`).

Departure from the windowed-FIFO design (Forge): this loop fills a step from groups launched for that step; the
scheduler modes (windowed FIFO, greedy, partial rollouts) arrive with the scheduler issue behind the same loop.
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

    async def run(self) -> None:
        from arbor.monitor.metrics import MetricsWriter, init_wandb
        from arbor.orchestrator.client import InferenceClient
        from arbor.orchestrator.state import OrchestratorState, TaskSampler, load_state
        from arbor.orchestrator.weights import WeightSync
        from arbor.trainer.checkpoint import latest_checkpoint

        cfg = self.cfg
        start = (latest_checkpoint(cfg.output_dir) or 0) if cfg.resume else 0
        state = load_state(cfg.output_dir, start) if start else OrchestratorState()
        self.sampler = TaskSampler(self.tasks, cfg.seed, state.epoch, state.position)
        metrics = MetricsWriter(cfg.output_dir, init_wandb(cfg.wandb, cfg.output_dir, cfg.model_dump(mode="json")))
        async with InferenceClient(cfg.client.base_urls, cfg.client.timeout, cfg.client.max_retries,
                                   admin_urls=cfg.client.admin_urls) as client:
            weights = WeightSync(client, cfg.output_dir, await client.wait_healthy(cfg.client.timeout))
            client.policy_version = weights.loaded_version
            background = [asyncio.create_task(weights.run()), asyncio.create_task(self._poll_metrics(metrics))]
            try:
                if start:
                    log.info("resuming at step %d", start)
                    await weights.ensure(start, cfg.weight_update_timeout)
                for step in range(start, cfg.max_steps):
                    await self._step(step, client, weights, metrics)
                await self._drain_metrics(metrics, weights)
            finally:
                for t in background:
                    t.cancel()
                metrics.close()
        log.info("orchestrator done after %d steps", cfg.max_steps)

    async def _step(self, step: int, client, weights, metrics) -> None:
        from arbor.orchestrator.advantages import compute_advantages
        from arbor.orchestrator.batcher import build_step_batches
        from arbor.orchestrator.state import OrchestratorState, prune_states, save_state
        from arbor.trainer.checkpoint import latest_checkpoint
        from arbor.transport.files import write_step

        cfg = self.cfg
        t0 = time.perf_counter()
        waited = await weights.ensure(step - cfg.async_lag, cfg.weight_update_timeout)
        save_state(cfg.output_dir, OrchestratorState(step, self.sampler.epoch, self.sampler.position))
        prune_states(cfg.output_dir, latest_checkpoint(cfg.output_dir) or 0)
        t_gen = time.perf_counter()
        groups = await self._collect_groups(step, client)
        gen_seconds = time.perf_counter() - t_gen
        compute_advantages(groups, cfg.advantage)
        rollouts = [r for g in groups for r in g]
        batches = build_step_batches(
            rollouts, step, cfg.batching.trainer_ranks, cfg.batching.micro_batch_tokens, cfg.temperature, self.tokenizer.pad_token_id
        )
        write_step(cfg.output_dir, step, batches)
        figures = self._figures(step, rollouts, gen_seconds, waited, time.perf_counter() - t0, weights, client)
        for name, value in (await client.router_stats()).items():  # cumulative fleet counters (replicas > 1)
            if name in ("requests", "retries", "ejections", "readmissions", "backends_in_rotation"):
                figures[f"router/{name}"] = value
        metrics.add(step, figures)

    async def _collect_groups(self, step: int, client) -> list[list]:
        """Generates a step's groups, replacing those dropped as too stale, with bounded concurrency."""
        from arbor.orchestrator.rollout import generate_group

        cfg = self.cfg
        need = cfg.batch_size // cfg.group_size
        sem = asyncio.Semaphore(cfg.max_concurrent_groups or need)
        weights_of = cfg.environment.reward_weights

        async def one(k: int) -> list:
            async with sem:
                spec = self._next_spec(step, k)
                return await generate_group(
                    client, self.env, spec, cfg.group_size, cfg.sampling.max_tokens, cfg.temperature,
                    cfg.sampling.top_p, weights_of, cfg.environment.timeout,
                )

        kept: list[list] = []
        launched = 0
        pending: set[asyncio.Task] = set()
        try:
            while len(kept) < need:
                while len(kept) + len(pending) < need:
                    pending.add(asyncio.create_task(one(launched)))
                    launched += 1
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    group = task.result()
                    if max(r.staleness(step) for r in group) > cfg.max_off_policy_steps:
                        self.dropped_stale += len(group)
                        continue
                    kept.append(group)
        finally:
            for task in pending:
                task.cancel()
        return kept[:need]

    def _next_spec(self, step: int, k: int):
        from arbor.orchestrator.rollout import GroupSpec

        cfg = self.cfg
        while True:
            task = self.sampler.next()
            prompt_ids = self.tokenizer.apply_chat_template(self.env.prompt(task), add_generation_prompt=True)
            if len(prompt_ids) + cfg.sampling.max_tokens <= cfg.seq_len:
                seed = zlib.crc32(f"{cfg.seed}/{step}/{k}".encode()) & 0x7FFFFFFF
                return GroupSpec(task, prompt_ids, seed)
            self.skipped_long += 1

    def _figures(self, step, rollouts, gen_seconds, waited, step_seconds, weights, client) -> dict[str, Any]:
        import numpy as np

        rewards = np.array([r.reward for r in rollouts])
        stale = np.array([r.staleness(step) for r in rollouts])
        comp_lens = np.array([len(r.completion_ids) for r in rollouts])
        figures: dict[str, Any] = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/max": float(rewards.max()),
            "completion_len/mean": float(comp_lens.mean()),
            "truncated/frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "rollouts/s": len(rollouts) / max(gen_seconds, 1e-9),
            "staleness/max": int(stale.max()),
            "staleness/mean": float(stale.mean()),
            "dropped/stale": self.dropped_stale,
            "skipped/too_long": self.skipped_long,
            "score/failed": int(sum(r.score_failed for r in rollouts)),
            "policy_version": weights.loaded_version,
            "weights/updates": weights.updates,
            "client/retries": client.retries,
            "time/generate": gen_seconds,
            "time/wait_weights": waited,
            "time/orchestrator_step": step_seconds,
            "epoch": self.sampler.epoch,
        }
        for name in sorted({k for r in rollouts for k in r.components}):
            figures[f"reward/{name}"] = float(np.mean([r.components.get(name, 0.0) for r in rollouts]))
        return figures

    async def _poll_metrics(self, metrics) -> None:
        while True:
            metrics.poll()
            await asyncio.sleep(0.2)

    async def _drain_metrics(self, metrics, weights) -> None:
        """Waits for the trainer's figures of the last steps so that metrics.jsonl ends complete."""
        deadline = time.monotonic() + self.cfg.weight_update_timeout
        while metrics.pending and time.monotonic() < deadline:
            weights.check()
            metrics.poll()
            await asyncio.sleep(0.1)
        if metrics.pending:
            raise TimeoutError(f"the trainer reported no metrics for steps {sorted(metrics.pending)}")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("aiohttp").setLevel(logging.WARNING)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(OrchestratorConfig, argv, prog="orchestrator")
    setup_logging(cfg.log_level)
    asyncio.run(Orchestrator(cfg).run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
