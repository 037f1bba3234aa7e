"""Live throughput matching, deterministic: the concurrency controller fed scripted figures (decisions, bounds,
the by-hand and switched-off cases), the idle clock fed scripted times, and the pool admitting under the
controller's limit."""

from __future__ import annotations

import pytest
from orch_fakes import Fleet, admit_once, make_pool, make_slices, seed_of

from arbor.config.loader import ConfigError, load_config
from arbor.config.orchestrator import OrchestratorConfig
from arbor.orchestrator.concurrency import ConcurrencyController, IdleClock
from arbor.orchestrator.scheduler import build_mode


def controller(**over) -> ConcurrencyController:
    settings = make_slices(**over).mode
    return ConcurrencyController.for_mode(build_mode(settings), settings)


def test_bounds_and_budget_follow_the_mode() -> None:
    # Two groups a step. async, max_off_policy_steps 2: starts at two steps' worth, may reach three steps'.
    c = controller(scheduler={"mode": "async"}, max_off_policy_steps=2)
    assert (c.limit, c.low, c.high, c.budget, c.enabled) == (4, 1, 6, 4, True)
    # Per-step modes can use at most one step's launches (oversampled).
    p = controller(scheduler={"mode": "one_step_off", "oversample": 2.0}, max_off_policy_steps=1)
    assert (p.limit, p.high, p.budget) == (4, 4, 2)
    # Configured bounds win, and the start is clamped into them.
    b = controller(scheduler={"mode": "async", "adaptive_min": 2, "adaptive_max": 3}, max_off_policy_steps=2)
    assert (b.limit, b.low, b.high) == (3, 2, 3)


def test_more_in_flight_while_the_trainer_waits_up_to_the_bound() -> None:
    c = controller(scheduler={"mode": "async"}, max_off_policy_steps=2)
    assert [c.decide(0.5, 0, 0) for _ in range(4)] == [5, 6, 6, 6]


def test_fewer_in_flight_when_the_queue_exceeds_the_budget_or_groups_go_stale() -> None:
    c = controller(scheduler={"mode": "async"}, max_off_policy_steps=2)
    assert c.decide(0.5, 5, 0) == 3  # a queue beyond the budget wins over the trainer's wait
    assert c.decide(None, 0, 1) == 2  # a stale drop
    assert [c.decide(None, 9, 0) for _ in range(3)] == [1, 1, 1]  # never below the lower bound


def test_a_matched_run_keeps_its_limit() -> None:
    c = controller(scheduler={"mode": "async"}, max_off_policy_steps=2)
    # the trainer barely waits, the queue is within budget, or no new trainer figure arrived
    assert [c.decide(0.05, 4, 0), c.decide(None, 2, 0), c.decide(0.1, 0, 0)] == [4, 4, 4]


@pytest.mark.parametrize(
    "over",
    [
        {"scheduler": {"mode": "async", "max_in_flight": 3}},
        {"scheduler": {"mode": "one_step_off"}, "max_concurrent_groups": 1},
        {"scheduler": {"mode": "async", "adaptive": False}},
    ],
)
def test_concurrency_set_by_hand_or_switched_off_is_kept(over) -> None:
    c = controller(max_off_policy_steps=2, **over)
    start = c.limit
    assert not c.enabled
    assert [c.decide(0.9, 0, 0), c.decide(None, 99, 5)] == [start, start]


def test_bad_bounds_fail_in_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="adaptive_max"):
        load_config(
            OrchestratorConfig,
            ["--model.name", "qwen3-test", "--scheduler.adaptive-min", "4", "--scheduler.adaptive-max", "2"],
        )


def test_idle_clock_measures_the_share_with_nothing_in_flight() -> None:
    clock = IdleClock(0.0)
    clock.busy(1.0)  # idle 0..1
    clock.idle(3.0)  # busy 1..3, idle from 3
    assert clock.lap(4.0) == pytest.approx(0.5)  # idle 0..1 and 3..4 of 4 s
    clock.busy(5.0)  # idle 4..5 (the idle stretch carries into the new lap)
    assert clock.lap(8.0) == pytest.approx(0.25)
    assert clock.lap(8.0) == 0.0  # no time passed


def test_the_pool_admits_under_the_adapted_limit() -> None:
    pool = make_pool(scheduler={"mode": "async"}, max_off_policy_steps=2)
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, s, k) for s in range(3) for k in range(4)}
    pool.max_in_flight = 1  # what the controller chose
    assert admit_once(pool, fleet) == 1
