"""The orchestrator's per-step figures, and the metrics plumbing the loop runs beside its steps.

Per step: rewards, completion lengths, truncation, staleness (max, mean, histogram), drop and skip counts,
black-box agent and environment counters, policy version and weight updates, timings, the prefix-merge ratio,
the router's cumulative fleet counters; the throughput match between two batch writes (groups produced by the
generator vs rollouts consumed by the trainer, the share of the interval the loop spent waiting for weights,
the share with no group generating `throughput/generator_idle_frac`, the finished groups left waiting
`throughput/queue_depth` and the in-flight limit in force `throughput/groups_in_flight`; the trainer reports
`throughput/trainer_wait_frac` itself);
the batch's difficulty mix with the cumulative filter counts; and the partial-rollout counts (resumed
groups/rollouts of this batch, and what the scheduler aborted, parked, moved, retried or cancelled since the last
batch). The trainer's figures are merged in by `MetricsWriter` as they arrive: `poll_metrics` runs in the
background, `drain_metrics` waits for the last steps' at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np

from arbor.config.orchestrator import CurriculumConfig
from arbor.monitor.metrics import MetricsWriter
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.episode import EpisodeStats
from arbor.orchestrator.filters import POOLS, difficulty, solve_rate
from arbor.orchestrator.generation import GenerationPool
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.scheduler import staleness_histogram
from arbor.orchestrator.tasks import TaskSource
from arbor.orchestrator.weight_sync import WeightSync
from arbor.transport.batch import StepBatch

ROUTER_COUNTERS = ("requests", "retries", "ejections", "readmissions", "poisoned", "backends_in_rotation")


@dataclasses.dataclass
class StepTimes:
    generate: float
    """Seconds collecting the step's groups."""
    wait_weights: float
    """Seconds waiting for the fleet to serve the policy the step needs."""
    step: float
    """Seconds from the step's start to its batch on disk."""
    loop_blocked: float = 0.0
    """Seconds the event loop was blocked (by blocking code in a coroutine: arbor.loopwatch) during the step."""


@dataclasses.dataclass(frozen=True)
class FigureSettings:
    """What the per-step figures read of the orchestrator config (arbor.orchestrator.main hands it out)."""

    group_size: int
    """Rollouts per finished group (the generator's production rate)."""
    prefix_merge: bool
    """`batching.prefix_merge`: report the prefix-merge ratio."""
    solve_threshold: float
    """`filters.solve_threshold`: a rollout counts as solved at or above this reward (the difficulty mix)."""
    curriculum: CurriculumConfig
    """Its easy / hard thresholds classify the batch's groups."""


class StepFigures:
    """Figures for `MetricsWriter.add(step, ...)`; remembers what the last batch reported (for rates and deltas)."""

    def __init__(
        self,
        settings: FigureSettings,
        env: Any,
        source: TaskSource,
        pool: GenerationPool,
        counts: Counts,
        env_stats: EpisodeStats,
    ) -> None:
        self.settings, self.env, self.source, self.pool, self.counts = settings, env, source, pool, counts
        self.env_stats = env_stats
        self._last_write: float | None = None
        self._last_finished = 0
        self._last_aborted = 0
        self._last_rejected = 0
        self._last_engine: dict[str, float] = {}

    async def step(
        self,
        step: int,
        groups: list[list[Rollout]],
        batches: list[StepBatch],
        times: StepTimes,
        weights: WeightSync | None,
        client: InferenceClient | None,
    ) -> dict[str, Any]:
        """All of a written step's figures."""
        rollouts = [r for g in groups for r in g]
        figures = self.rollouts(step, rollouts, times, weights, client)
        if self.settings.prefix_merge:  # sample tokens per trained (trie) token: what merging saved this step
            rows = sum(mb.num_tokens for b in batches for mb in b.micro_batches)
            figures["batch/prefix_merge_ratio"] = sum(r.num_tokens for r in rollouts) / max(rows, 1)
        if client is not None:
            for name, value in (await client.router_stats()).items():  # cumulative fleet counters (replicas > 1)
                if name in ROUTER_COUNTERS:
                    figures[f"router/{name}"] = value
        figures.update(self.throughput(len(rollouts), times.wait_weights))
        figures.update(self.difficulty_mix(groups))
        figures.update(self.partial(groups))
        return figures

    def decoding(self, counters: dict[str, float]) -> dict[str, float]:
        """Since the last step, from the engines' cumulative counters: `inference/decode_tokens_per_s` (tokens
        decode steps appended per second of decoding) and, with speculative decoding, `spec/acceptance_rate`
        (drafts accepted / drafted) and `spec/mean_accepted_length` (tokens a sequence gains per step)."""
        last, self._last_engine = self._last_engine, counters
        d = {k: v - last.get(k, 0.0) for k, v in counters.items()}
        if any(v < 0 for v in d.values()):  # a server restarted: its counters began again
            d = dict(counters)
        out = {}
        if d.get("decode_seconds_total", 0.0) > 0:
            out["inference/decode_tokens_per_s"] = d.get("decode_tokens_total", 0.0) / d["decode_seconds_total"]
        if d.get("spec_draft_tokens_total", 0.0) > 0:
            out["spec/acceptance_rate"] = d.get("spec_accepted_tokens_total", 0.0) / d["spec_draft_tokens_total"]
            if d.get("decode_seq_steps_total", 0.0) > 0:
                out["spec/mean_accepted_length"] = d.get("decode_tokens_total", 0.0) / d["decode_seq_steps_total"]
        return out

    def rollouts(
        self,
        step: int,
        rollouts: list[Rollout],
        times: StepTimes,
        weights: WeightSync | None,
        client: InferenceClient | None,
    ) -> dict[str, Any]:
        """The batch's rollouts, the run's counters, the weights and the timings."""
        rewards = np.array([r.reward for r in rollouts])
        stale = np.array([r.staleness(step) for r in rollouts])
        comp_lens = np.array([r.num_trained for r in rollouts])  # sampled tokens (multi-turn: all turns)
        figures: dict[str, Any] = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/max": float(rewards.max()),
            "completion_len/mean": float(comp_lens.mean()),
            "truncated/frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "rollouts/s": len(rollouts) / max(times.generate, 1e-9),
            "staleness/max": int(stale.max()),
            "staleness/mean": float(stale.mean()),
            **staleness_histogram(stale.tolist()),
            "dropped/stale": self.counts.dropped_stale,
            "generate/failed_groups": self.counts.failed_groups,
            "skipped/too_long": self.source.skipped_long,
            "skipped/bad_prompt": self.source.skipped_bad,
            "score/failed": int(sum(r.score_failed for r in rollouts)),
            **self.agents(),
            **self.gateway_counts(),
            "policy_version": weights.loaded_version if weights is not None else -1,
            "weights/updates": weights.updates if weights is not None else 0,
            "weights/refused": weights.refused if weights is not None else 0,
            "client/retries": client.retries if client is not None else 0,
            "client/reconnects": client.reconnects if client is not None else 0,
            "client/out_of_vocab": client.out_of_vocab if client is not None else 0,
            "time/generate": times.generate,
            "time/wait_weights": times.wait_weights,
            "time/orchestrator_step": times.step,
            "time/loop_blocked": times.loop_blocked,
            "epoch": self.source.sampler.epoch,
            **self.env_stats.figures(),
        }
        for name in sorted({k for r in rollouts for k in r.components}):
            figures[f"reward/{name}"] = float(np.mean([r.components.get(name, 0.0) for r in rollouts]))
        return figures

    def throughput(self, taken: int, waited: float) -> dict[str, Any]:
        """Throughput-matching figures: generator production vs trainer consumption, between two batch writes."""
        now, q = time.perf_counter(), self.pool.queue
        # Groups are only dropped while a step is collected, so the change since the last batch is this step's.
        rejected = self.counts.rejected()
        dropped, self._last_rejected = rejected - self._last_rejected, rejected
        out: dict[str, Any] = {
            "scheduler/in_flight": q.in_flight,
            "scheduler/ready": q.ready,
            "scheduler/head": q.head,
            "accepted/frac": taken / max(taken + dropped, 1),
            "throughput/queue_depth": q.waiting,
            "throughput/groups_in_flight": self.pool.max_in_flight,
            "throughput/generator_idle_frac": self.pool.idle.lap(time.monotonic()),
        }
        finished = self.counts.finished_groups
        if self._last_write is not None:
            interval = max(now - self._last_write, 1e-9)
            produced = (finished - self._last_finished) * self.settings.group_size
            out["throughput/produced_rollouts_per_s"] = produced / interval
            out["throughput/consumed_rollouts_per_s"] = taken / interval
            out["throughput/orchestrator_wait_ratio"] = min(waited / interval, 1.0)
        self._last_write, self._last_finished = now, finished
        return out

    def difficulty_mix(self, groups: list[list[Rollout]]) -> dict[str, Any]:
        """The batch's difficulty mix: the fraction of its groups that are easy / normal / hard by their own solve
        rate (the curriculum's thresholds), plus the cumulative filter counts."""
        cfg = self.settings
        kinds = [difficulty(solve_rate(g, cfg.solve_threshold), cfg.curriculum) for g in groups]
        out: dict[str, Any] = {f"batch/{p}_frac": kinds.count(p) / max(len(kinds), 1) for p in POOLS}
        out.update({f"filtered/{k}": v for k, v in self.counts.filtered.items()})
        return out

    def partial(self, groups: list[list[Rollout]]) -> dict[str, Any]:
        """Per-step partial-rollout counts: groups/rollouts of this batch generated in pieces, and what the
        scheduler aborted, parked, moved or cancelled since the last batch (the counts are reset)."""
        out: dict[str, Any] = {
            "partial/resumed_groups": sum(any(r.pieces > 1 for r in g) for g in groups),
            "partial/resumed_rollouts": sum(r.pieces > 1 for g in groups for r in g),
            "partial/parked_now": len(self.pool.parking.parked),
        }
        aborted = self.pool.partial.aborted if self.pool.partial is not None else 0
        out["partial/aborted"] = aborted - self._last_aborted
        self._last_aborted = aborted
        for k, v in self.counts.partial.items():
            out[f"partial/{k}"] = v
            self.counts.partial[k] = 0
        return out

    def agents(self) -> dict[str, Any]:
        """Gateway calls and open (not yet closed) sessions, and the black-box agent environment's failure/retry
        counters; the gateway's other accounting is `gateway_counts`."""
        gateway = self.pool.gateway
        if gateway is None:
            return {}
        out = {"gateway/calls": gateway.calls, "gateway/open_sessions": gateway.open_sessions}
        for name in ("failed", "retried"):
            if hasattr(self.env, name):
                out[f"agents/{name}"] = getattr(self.env, name)
        return out

    def gateway_counts(self) -> dict[str, Any]:
        """The gateway's cumulative counters (arbor.orchestrator.gateway.sessions.GatewayCounts): refused
        requests by status class, sessions without a posted reward by why they ended, temperature overrides,
        stop-string trims."""
        gateway = self.pool.gateway
        return {} if gateway is None else gateway.store.counts.figures()


async def poll_metrics(metrics: MetricsWriter) -> None:
    """Merges the trainer's figures as they arrive (runs in the background for the whole run)."""
    while True:
        metrics.poll()
        await asyncio.sleep(0.2)


async def drain_metrics(metrics: MetricsWriter, weights: WeightSync | None, timeout: float) -> None:
    """Waits for the trainer's figures of the last steps so that metrics.jsonl ends complete."""
    deadline = time.monotonic() + timeout
    while metrics.pending and time.monotonic() < deadline:
        if weights is not None:
            weights.check()
        metrics.poll()
        await asyncio.sleep(0.1)
    if metrics.pending:
        raise TimeoutError(f"the trainer reported no metrics for steps {sorted(metrics.pending)}")
