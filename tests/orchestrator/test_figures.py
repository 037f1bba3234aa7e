"""The per-step figures: rollout statistics, the throughput match between batch writes, the difficulty mix,
partial-rollout counts reset each batch, agent and router counters, and draining the trainer's metrics."""

from __future__ import annotations

import asyncio
import types

import pytest
from orch_fakes import Fleet, group, make_pool, make_slices

from arbor.orchestrator.figures import StepFigures, StepTimes, drain_metrics
from arbor.orchestrator.generation import GenerationPool


def _figures(**over) -> tuple[StepFigures, GenerationPool]:
    pool = make_pool(**over)
    settings = make_slices(**over).figures
    return StepFigures(settings, pool.env, pool.source, pool, pool.counts, pool.env_stats), pool


class Router:
    retries, reconnects, out_of_vocab = 2, 1, 3

    async def router_stats(self) -> dict[str, int]:
        return {"requests": 9, "ejections": 1, "something_else": 4}


def test_a_steps_figures() -> None:
    figures, pool = _figures(batching={"prefix_merge": True})
    pool.counts.dropped_stale, pool.source.skipped_long = 2, 1
    groups = [group(0, [1, 0], version=3), group(1, [1, 1], version=4)]
    groups[0][0].components = {"match": 1.0}
    out = asyncio.run(
        figures.step(
            5,
            groups,
            [],
            StepTimes(2.0, 0.5, 3.0),
            types.SimpleNamespace(loaded_version=4, updates=3, refused=1),
            Router(),
        )
    )
    assert out["reward/mean"] == 0.75 and out["reward/match"] == 0.25  # a missing component counts 0
    assert out["staleness/max"] == 2 and out["staleness/hist_1"] == 2 and out["rollouts/s"] == 2.0
    assert out["dropped/stale"] == 2 and out["skipped/too_long"] == 1 and out["policy_version"] == 4
    assert out["weights/updates"] == 3 and out["weights/refused"] == 1
    assert out["router/requests"] == 9 and out["router/ejections"] == 1 and "router/something_else" not in out
    assert out["client/retries"] == 2 and out["client/reconnects"] == 1 and out["client/out_of_vocab"] == 3
    assert out["time/orchestrator_step"] == 3.0 and out["epoch"] == 0
    assert out["batch/prefix_merge_ratio"] == 16 and out["batch/easy_frac"] == 0.5  # 16 tokens, no packed rows
    assert out["accepted/frac"] == 4 / 6 and "throughput/consumed_rollouts_per_s" not in out  # the first write


def test_throughput_is_measured_between_two_batch_writes() -> None:
    figures, pool = _figures()
    figures.throughput(4, 0.0)
    pool.counts.finished_groups = 3
    pool.counts.filtered["difficulty"] = 4
    out = figures.throughput(4, 1e9)
    assert out["throughput/produced_rollouts_per_s"] > out["throughput/consumed_rollouts_per_s"] > 0
    assert out["throughput/orchestrator_wait_ratio"] == 1.0 and out["accepted/frac"] == 0.5
    assert figures.throughput(4, 0.0)["accepted/frac"] == 1.0  # nothing dropped since


def test_the_difficulty_mix_and_filter_counts() -> None:
    figures, pool = _figures()
    pool.counts.filtered["zero_advantage"] = 6
    out = figures.difficulty_mix([group(0, [1, 1]), group(1, [0, 0]), group(2, [1, 0]), group(3, [0, 0])])
    assert (out["batch/easy_frac"], out["batch/normal_frac"], out["batch/hard_frac"]) == (0.25, 0.25, 0.5)
    assert out["filtered/zero_advantage"] == 6 and out["filtered/env_skipped"] == 0


def test_partial_counts_are_per_batch() -> None:
    figures, pool = _figures()
    assert figures.partial([])["partial/aborted"] == 0  # before any client
    pool.use(Fleet())
    pool.partial.aborted = 3
    pool.counts.partial["moved"] = 2
    resumed = group(0, [1, 0])
    resumed[0].pieces = 2
    out = figures.partial([resumed, group(1, [1, 0])])
    assert out["partial/aborted"] == 3 and out["partial/moved"] == 2
    assert out["partial/resumed_groups"] == 1 and out["partial/resumed_rollouts"] == 1
    again = figures.partial([])
    assert again["partial/aborted"] == 0 and again["partial/moved"] == 0 and again["partial/parked_now"] == 0


def test_agent_figures_come_from_the_gateway_and_the_environment() -> None:
    figures, pool = _figures()
    assert figures.agents() == {}
    pool.gateway = types.SimpleNamespace(calls=5, open_sessions=1)
    pool.env.failed = 2
    assert figures.agents() == {"gateway/calls": 5, "gateway/open_sessions": 1, "agents/failed": 2}


class Metrics:
    def __init__(self, pending: set[int], answers: bool) -> None:
        self.pending, self.answers, self.polls = pending, answers, 0

    def poll(self) -> list[int]:
        self.polls += 1
        done, self.pending = (sorted(self.pending), set()) if self.answers else ([], self.pending)
        return done


def test_draining_waits_for_the_trainers_last_figures() -> None:
    metrics = Metrics({3, 4}, answers=True)
    asyncio.run(drain_metrics(metrics, None, 5.0))
    assert metrics.polls == 1 and not metrics.pending
    with pytest.raises(TimeoutError, match=r"no metrics for steps \[3, 4\]"):
        asyncio.run(drain_metrics(Metrics({4, 3}, answers=False), None, 0.05))
