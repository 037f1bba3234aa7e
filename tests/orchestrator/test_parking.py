"""Partial-rollout moves on a scripted fleet: stragglers moved to the queue's tail (resume), relaunched as new
groups (retry) or given up, too-stale ones dropped, the rule's arming and due time, and the parked surplus."""

from __future__ import annotations

import asyncio
import time

import pytest
from orch_fakes import Fleet, make_pool, seed_of, settle

from arbor.orchestrator.generation import GenerationPool


def _straggling(action: str = "resume", max_resumes: int = 3, mode: str = "async") -> tuple[GenerationPool, Fleet]:
    """Strict FIFO (W = 1), bound 1 step: four groups launched at step 0, group 0 hangs at the head; the rule is
    armed with a median of 0.01 s (a straggler runs over 0.02 s)."""
    pool = make_pool(
        scheduler={"mode": mode, "max_in_flight": 6},
        max_off_policy_steps=1,
        partial={"enabled": True, "straggler_factor": 2.0, "straggler_action": action, "max_resumes": max_resumes},
    )
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, 0)}
    pool.parking.durations.extend([0.01] * 8)
    return pool, fleet


async def _launch_and_move(pool: GenerationPool, fleet: Fleet, step: int = 0) -> float | None:
    pool.use(fleet)
    pool.admit(0, 0, 2, 0, 0)
    await settle()
    await asyncio.sleep(0.05)  # past the straggler limit (4 x the 0.01 s median)
    due = await pool.parking.move_stragglers(step, pool.flights, pool.partial)
    await settle()
    return due


def test_a_straggler_resumes_at_the_tail_and_the_head_moves_past_it() -> None:
    pool, fleet = _straggling()

    async def go():
        due = await _launch_and_move(pool, fleet)
        return due, pool.take(4)

    due, taken = asyncio.run(go())
    assert due is not None and due <= time.monotonic()  # moved: look at the queue again at once
    assert [g[0].group_id for g in taken] == [1, 2, 3, 0] and len(fleet.aborted) == 1
    assert pool.counts.partial["moved"] == 1 and all(r.pieces == 2 for r in taken[-1])


@pytest.mark.parametrize("max_resumes", [1, 0])
def test_a_straggler_is_retried_as_a_new_group_or_given_up(max_resumes: int) -> None:
    pool, fleet = _straggling("retry", max_resumes)
    task = None

    async def go():
        nonlocal task
        pool.use(fleet)
        pool.admit(0, 0, 2, 0, 0)
        task = pool.source.pending()[0]
        await settle()
        await asyncio.sleep(0.05)  # past the straggler limit (4 x the 0.01 s median)
        await pool.parking.move_stragglers(0, pool.flights, pool.partial)
        await settle()
        return pool.take(4)

    taken = asyncio.run(go())
    assert [g[0].group_id for g in taken] == [1, 2, 3] and 0 not in pool.flights
    if max_resumes:
        assert pool.counts.partial["retried"] == 1
        assert [pool.source.tasks.index(t) for t, _ in pool.source.retry] == [task]
    else:
        assert pool.counts.partial["given_up"] == 1 and not pool.source.retry
        assert task not in pool.source.pending()


def test_a_straggler_too_stale_to_train_is_dropped() -> None:
    pool, fleet = _straggling()
    asyncio.run(_launch_and_move(pool, fleet, step=2))  # its first token is version 0: 2 steps old > 1
    assert pool.counts.dropped_stale == 2 and pool.counts.partial["moved"] == 0 and 0 not in pool.flights


@pytest.mark.parametrize("durations, mode", [(4, "async"), (8, "greedy")])
def test_the_rule_needs_finished_groups_and_a_window(durations: int, mode: str) -> None:
    """Armed only once 8 groups have finished (4 here + the 3 that finish at once), and only with a window."""
    pool, fleet = _straggling(mode=mode)
    pool.parking.durations.clear()
    pool.parking.durations.extend([0.01] * durations)
    assert asyncio.run(_launch_and_move(pool, fleet)) is None and not fleet.aborted


def test_the_rule_says_when_the_next_window_member_straggles() -> None:
    pool, fleet = _straggling()

    async def go():
        pool.use(fleet)
        pool.admit(0, 0, 2, 0, 0)
        due = await pool.parking.move_stragglers(0, pool.flights, pool.partial)
        head = pool.flights[0].since
        await pool.stop()
        return due, head

    due, since = asyncio.run(go())
    assert due == pytest.approx(since + 0.02) and not fleet.aborted


@pytest.mark.parametrize("max_resumes", [3, 0])
def test_the_surplus_is_parked_unless_resumed_max_resumes_times_and_too_stale_parked_groups_are_dropped(
    max_resumes: int,
) -> None:
    pool = make_pool(
        scheduler={"mode": "one_step_off", "oversample": 2.0}, partial={"enabled": True, "max_resumes": max_resumes}
    )
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, 2), seed_of(pool.source.settings, 0, 3)}

    async def go():
        pool.use(fleet)
        pool.admit(0, 0, 2, 0, 0)
        await settle()
        pool.take(2)
        await pool.end_step()
        running = sorted(k for k, f in pool.flights.items() if not f.parked)
        resumed = pool.parking.unpark(5)  # max_off_policy_steps 2: their version-0 token is too old at step 5
        await settle()
        await pool.stop()
        return running, resumed

    running, resumed = asyncio.run(go())
    assert not resumed
    if max_resumes:
        assert running == [] and pool.counts.partial["parked"] == 2 and pool.counts.dropped_stale == 4
    else:  # nothing parked: both keep running into the next step
        assert running == [2, 3] and pool.counts.partial["parked"] == 0 and pool.counts.dropped_stale == 0
