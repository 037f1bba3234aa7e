"""The generation pool on a scripted fleet: admission per mode, taking in queue order, the stall error, the
per-step surplus and its resumption, cancelled groups, failed ones, and pauses around weight updates."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import Fleet, make_pool, seed_of, settle

from arbor.orchestrator.client import InferenceError
from arbor.orchestrator.generation import FailedGroup


def test_per_step_admission_launches_the_oversampled_step_and_takes_in_queue_order() -> None:
    pool = make_pool(scheduler={"mode": "one_step_off", "oversample": 2.0})
    fleet = Fleet()

    async def go():
        pool.use(fleet)
        launched = pool.admit(0, 0, 2, 0, 0)
        await settle()
        taken = pool.take(2)
        return launched, taken, pool.admit(0, 2, 2, 0, launched)

    launched, taken, again = asyncio.run(go())
    assert launched == 4 and again == 0  # 2 kept + 2 ready already make the step's 4
    assert [g[0].group_id for g in taken] == [0, 1] and all(r.reward == 1.0 for g in taken for r in g)
    assert pool.counts.finished_groups == 4 and pool.queue.ready == 2 and not pool.flights


def test_per_step_admission_respects_max_concurrent_groups() -> None:
    pool = make_pool(scheduler={"mode": "one_step_off"}, max_concurrent_groups=1)
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, 0)}

    async def go():
        pool.use(fleet)
        n = pool.admit(0, 0, 2, 0, 0)
        await pool.stop()
        return n

    assert asyncio.run(go()) == 1


@pytest.mark.parametrize("max_in_flight, launched", [(20, 4), (3, 3)])
def test_continuous_admission_stops_at_the_staleness_bound_or_max_in_flight(max_in_flight: int, launched: int) -> None:
    """async, max_off_policy_steps 1, two groups a step, the fleet at version 0: steps 0 and 1 may be launched."""
    pool = make_pool(scheduler={"mode": "async", "max_in_flight": max_in_flight}, max_off_policy_steps=1)
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, k) for k in range(4)}

    async def go():
        pool.use(fleet)
        n = pool.admit(0, 0, 2, 0, 0)
        more = pool.admit(0, 0, 2, 0, n)  # nothing changed: nothing more
        await pool.stop()
        return n, more

    assert asyncio.run(go()) == (launched, 0)


def test_wait_reports_a_stalled_scheduler() -> None:
    pool = make_pool()
    with pytest.raises(RuntimeError, match="scheduler stalled at step 3: nothing running, 1/2 groups kept"):
        asyncio.run(pool.wait(3, 1, 2, 0))


def test_wait_returns_when_a_group_finishes() -> None:
    pool = make_pool(scheduler={"mode": "one_step_off"})
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, 0)}

    async def go():
        pool.use(fleet)
        pool.admit(0, 0, 2, 0, 0)
        await pool.wait(0, 0, 2, 0)  # group 1 finishes at once; group 0 hangs
        ready = pool.queue.ready
        await pool.stop()
        return ready

    assert asyncio.run(go()) == 1


def test_wait_returns_when_a_newer_policy_lets_more_groups_launch() -> None:
    """Continuous modes: the staleness bound stops launches at version 0 (steps 0 and 1 launched, every group
    still running); a newer policy ends the wait, so the next admission launches step 2 at once instead of after
    the next group finishes."""
    pool = make_pool(scheduler={"mode": "async", "max_in_flight": 20}, max_off_policy_steps=1)
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, step, k) for step in range(3) for k in range(4)}

    async def go():
        pool.use(fleet)
        newer = asyncio.Event()
        first = pool.admit(0, 0, 2, 0, 0)
        waiting = asyncio.create_task(pool.wait(0, 0, 2, 0, newer))
        await settle()
        assert not waiting.done(), "nothing finished and no newer policy: still waiting"
        newer.set()
        await asyncio.wait_for(waiting, timeout=10)
        more = pool.admit(0, 0, 2, 1, first)
        await pool.stop()
        return first, more

    assert asyncio.run(go()) == (4, 2)


@pytest.mark.parametrize("partial", [False, True])
def test_end_step_cancels_or_parks_the_surplus_and_the_next_step_resumes_it_first(partial: bool) -> None:
    pool = make_pool(scheduler={"mode": "one_step_off", "oversample": 2.0}, partial={"enabled": partial})
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, 2), seed_of(pool.source.settings, 0, 3)}

    async def go():
        pool.use(fleet)
        pool.admit(0, 0, 2, 0, 0)
        await settle()
        first = pool.take(2)
        await pool.end_step()
        await settle()
        parked = len(pool.parking.parked)
        launched = pool.admit(1, 0, 2, 0, 0)
        await settle()
        return first, parked, launched, pool.take(4)

    first, parked, launched, second = asyncio.run(go())
    assert [g[0].group_id for g in first] == [0, 1]
    if partial:
        assert parked == 2 and pool.counts.partial["parked"] == 2 and len(fleet.aborted) == 2
        assert pool.counts.partial["resumed"] == 2 and launched == 2  # the parked two first, then two new
        assert sorted(g[0].group_id for g in second) == [2, 3, 4, 5]
        assert all(r.pieces == 2 for g in second if g[0].group_id < 4 for r in g)
    else:
        assert parked == 0 and pool.counts.partial["cancelled"] == 2 and launched == 4
        assert [g[0].group_id for g in second] == [4, 5, 6, 7]
    # taken groups stay pending until the assembler takes their tasks; cancelled ones are no longer pending
    assert len(pool.source.pending()) == 6


def test_a_cancelled_group_gives_up_its_position_and_its_task() -> None:
    pool = make_pool(scheduler={"mode": "one_step_off"}, max_concurrent_groups=1)
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, 0)}

    async def go():
        pool.use(fleet)
        pool.admit(0, 0, 2, 0, 0)
        pool.flights[0].task.cancel()
        await settle()

    asyncio.run(go())
    assert pool.queue.head == 1 and pool.queue.in_flight == 0 and not pool.flights and pool.source.pending() == []


def test_resume_after_a_weight_update_leaves_parked_groups_parked() -> None:
    pool = make_pool(scheduler={"mode": "one_step_off"}, partial={"enabled": True})
    fleet = Fleet()
    fleet.slow = {seed_of(pool.source.settings, 0, 0), seed_of(pool.source.settings, 0, 1)}

    async def go():
        pool.use(fleet)
        pool.admit(0, 0, 2, 0, 0)
        await settle()
        handles = await pool.partial.abort_all()
        pool.flights[0].parked = True  # the scheduler parked group 0 during the update
        pool.resume_after_update(handles)
        states = [h.parked for h in handles], [h.resumes for h in handles]
        await pool.stop()
        return states

    parked, resumes = asyncio.run(go())
    assert parked == [True, False] and resumes == [0, 0]  # a pause for an update is no scheduled resume


def test_a_group_the_fleet_refuses_is_taken_as_failed_and_any_other_error_ends_the_run() -> None:
    pool = make_pool(scheduler={"mode": "one_step_off"})
    refused_seed = seed_of(pool.source.settings, 0, 0)

    class RefusingFleet(Fleet):
        async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, request_id=None):
            if seed == refused_seed:
                raise InferenceError("rejected the request (400): too long", 400)
            return await super().generate(prompt_ids, n, max_tokens, temperature, top_p, seed, request_id)

    async def go():
        pool.use(RefusingFleet())
        pool.admit(0, 0, 2, 0, 0)
        await settle()
        taken = pool.take(2)
        await pool.stop()
        return taken

    taken = asyncio.run(go())
    assert isinstance(taken[0], FailedGroup) and taken[0].error.status == 400 and len(taken[1]) == 2
    assert taken[0].group_id != taken[1][0].group_id

    broken = make_pool(scheduler={"mode": "one_step_off"})

    class BrokenFleet(Fleet):
        async def generate(self, *args, **kwargs):
            raise KeyError("a bug, not the fleet")

    async def go_broken():
        broken.use(BrokenFleet())
        broken.admit(0, 0, 2, 0, 0)
        await settle()
        try:
            return broken.take(2)
        finally:
            await broken.stop()

    with pytest.raises(KeyError, match="a bug"):
        asyncio.run(go_broken())
