"""Scheduling modes as policy objects: every registered mode satisfies the SchedulingMode contract and runs a
generation pool and the step assembler to full batches; a user's mode (tests/orchestrator/newest_first_mode.py)
plugs in by its dotted path or by one registry entry and changes which groups a batch takes; a bad name fails in
one line naming the field."""

from __future__ import annotations

import asyncio
import itertools
import math
import types

import pytest
from orch_fakes import Fleet, make_pool, make_slices, settle

from arbor.config.loader import ConfigError, load_config
from arbor.config.orchestrator import OrchestratorConfig
from arbor.orchestrator.assembler import StepAssembler
from arbor.orchestrator.generation import GenerationPool
from arbor.orchestrator.scheduler import ModeSettings, RolloutQueue, SchedulingMode, build_mode
from arbor.registry import MODES, PER_STEP_MODES, Member

USER_MODE = "newest_first_mode:NewestFirstMode"

SCHEDULES = [{}, {"oversample": 2.0}, {"max_in_flight": 3}, {"adaptive": False}]
"""`[orchestrator.scheduler]` variants every mode is built under (with its name as `mode`)."""


def _settings(name: str, **scheduler) -> ModeSettings:
    over = {"window": 3} if name == "windowed_fifo" else {}
    return make_slices(batch_size=8, group_size=2, scheduler={"mode": name, **over, **scheduler}).mode


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", MODES.names())
def test_every_registered_mode_satisfies_the_interface(name: str, schedule: dict) -> None:
    settings = _settings(name, **schedule)
    mode = build_mode(settings)
    assert isinstance(mode, SchedulingMode)
    assert mode.continuous is (name not in PER_STEP_MODES)  # what config validation assumes of the names
    assert mode.window is None or mode.window >= 1
    assert 0 <= mode.slack <= settings.max_off_policy_steps
    assert mode.max_in_flight >= 1 and mode.most_in_flight >= 1 and mode.queue_budget >= 1
    if schedule.get("max_in_flight"):
        assert mode.max_in_flight == schedule["max_in_flight"]  # a limit set by hand is the mode's default
    assert all(isinstance(mode.lag(step), int) and mode.lag(step) >= 0 for step in range(12))
    queue: RolloutQueue[str] = RolloutQueue(mode.window, mode.pick)
    assert mode.admits(0, 0, 4, 0, queue, mode.max_in_flight)  # a fresh step launches: no mode stalls at once
    for _ in range(mode.max_in_flight):
        queue.launch()
    assert not mode.admits(0, 0, 4, 0, queue, mode.max_in_flight)  # never beyond the in-flight limit
    assert mode.pick([2, 5, 7]) in (2, 5, 7)


def _former_policy(name: str, settings: ModeSettings) -> dict:
    """What the string branches of the former `SchedulePolicy.from_config` and `ConcurrencyController.from_config`
    decided, as a reference the mode objects must match."""
    s, groups, bound = settings.scheduler, settings.groups_per_step, settings.max_off_policy_steps
    continuous = name in ("async", "greedy", "windowed_fifo")
    window = {"async": 1, "greedy": None, "windowed_fifo": s.window or max(1, groups // 2)}.get(name)
    launched = math.ceil(s.oversample * groups)
    in_flight = s.max_in_flight or (2 * groups if continuous else settings.max_concurrent_groups or launched)
    slack = min(math.ceil(window / groups), bound) if name == "windowed_fifo" else 0
    lag = 1 if name == "one_step_off" else (s.lag if s.lag is not None else bound - slack)
    return {
        "continuous": continuous,
        "window": window if continuous else None,
        "slack": slack,
        "max_in_flight": in_flight,
        "most_in_flight": (bound - slack + 1) * groups if continuous else launched,
        "queue_budget": max(1, bound - slack) * groups,
        "lags": [step % s.sync_interval if name == "sync" else lag for step in range(7)],
    }


def _former_admits(mode, settings: ModeSettings, step, kept, need, version, q, limit) -> bool:
    if mode.continuous:
        return q.in_flight < limit and step + (kept + q.outstanding) // need - version <= (
            settings.max_off_policy_steps - mode.slack
        )
    launched = math.ceil(settings.scheduler.oversample * settings.groups_per_step)
    return kept + q.in_flight + q.ready < launched and q.in_flight < limit


@pytest.mark.parametrize("name", MODES.names())
def test_the_modes_decide_as_the_string_branches_did(name: str) -> None:
    continuous = name not in PER_STEP_MODES
    grid = itertools.product(
        [1, 2, 3],  # max_off_policy_steps
        [{}, {"oversample": 1.5}, {"max_in_flight": 5}, {"sync_interval": 3}, {"window": 7}]
        + ([{"lag": 1}] if continuous else []),
        [None, 2],  # max_concurrent_groups
    )
    for bound, schedule, concurrent in grid:
        cfg = {"batch_size": 12, "group_size": 2, "max_off_policy_steps": bound, "max_concurrent_groups": concurrent}
        settings = make_slices(**cfg, scheduler={"mode": name, **schedule}).mode
        mode = build_mode(settings)
        got = {k: getattr(mode, k) for k in ("continuous", "window", "slack", "max_in_flight", "most_in_flight")}
        got |= {"queue_budget": mode.queue_budget, "lags": [mode.lag(step) for step in range(7)]}
        assert got == _former_policy(name, settings), (bound, schedule, concurrent)
        q: RolloutQueue[str] = RolloutQueue(mode.window, mode.pick)
        for n in range(20):  # a queue growing, with some groups finished: the same launch decisions
            for step, kept, version in itertools.product([0, 3], [0, 4], [0, 1, 3]):
                args = (step, kept, 6, version, q, 8)
                assert mode.admits(*args) == _former_admits(mode, settings, *args), (n, args)
            q.launch()
            if n % 3 == 0:
                q.finish(n, "done")


def test_every_registered_mode_is_its_own_module() -> None:
    modules = [MODES.path(name).partition(":")[0] for name in MODES.names()]
    assert len(set(modules)) == len(modules) and all(m.startswith("arbor.orchestrator.modes.") for m in modules)


def _pool_and_assembler(**over) -> tuple[GenerationPool, StepAssembler]:
    pool = make_pool(**over)
    return pool, StepAssembler(make_slices(**over).assembler, pool, pool.source, pool.counts)


def _collect_steps(pool: GenerationPool, assembler: StepAssembler, steps: int) -> list[list[int]]:
    """The group ids of each step's batch, the assembler collecting from `pool` on a fleet that answers at once
    and follows the mode's lag."""
    fleet = Fleet()

    async def go() -> list[list[int]]:
        out = []
        for step in range(steps):
            fleet.version = max(0, step - pool.mode.lag(step))
            weights = types.SimpleNamespace(loaded_version=fleet.version, changed=asyncio.Event())
            out.append([g[0].group_id for g in await assembler.collect(step, fleet, weights)])
        await pool.stop()
        return out

    return asyncio.run(go())


@pytest.mark.parametrize("name", MODES.names())
def test_every_registered_mode_runs_the_pool_and_assembler_to_full_batches(name: str) -> None:
    pool, assembler = _pool_and_assembler(scheduler={"mode": name})
    batches = _collect_steps(pool, assembler, 4)
    assert [len(b) for b in batches] == [2] * 4
    assert len({g for b in batches for g in b}) == 8  # no group trained twice
    assert pool.counts.dropped_stale == 0


def test_a_users_mode_by_dotted_path_takes_the_newest_finished_groups_first() -> None:
    """Per-step, oversampled twice: four groups launched for two needed, all finished before the batch is taken.
    one_step_off takes 0 and 1 (lowest position first); the user's LIFO mode takes 3 then 2, and at the next step
    the finished 1 and 0 (newest first) before the two launched for it."""

    def first_two_steps(mode: str) -> list[list[int]]:
        pool, assembler = _pool_and_assembler(scheduler={"mode": mode, "oversample": 2.0})
        pool.use(Fleet())

        async def prefill() -> None:
            pool.admit(0, 0, 2, 0, 0)
            await settle()

        asyncio.run(prefill())
        assert pool.queue.ready == 4
        return _collect_steps(pool, assembler, 2)

    assert first_two_steps("one_step_off") == [[0, 1], [2, 3]]
    assert first_two_steps(USER_MODE) == [[3, 2], [1, 0]]


def test_a_users_mode_by_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODES.members, "newest_first", Member(USER_MODE))  # the one line in arbor/registry.py
    pool = make_pool(scheduler={"mode": "newest_first", "oversample": 2.0})
    assert type(pool.mode).__name__ == "NewestFirstMode" and pool.mode.lag(5) == 1

    async def go() -> list[int]:
        pool.use(Fleet())
        pool.admit(0, 0, 2, 0, 0)
        await settle()
        return [g[0].group_id for g in pool.take(4)]

    assert asyncio.run(go()) == [3, 2, 1, 0]


def test_a_bad_mode_fails_in_one_line_naming_the_field() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(OrchestratorConfig, ["--model.name", "qwen3-test", "--scheduler.mode", "fifo"], env={})
    assert str(e.value) == (
        "orchestrator.scheduler.mode: unknown scheduling mode 'fifo'; use one of sync, one_step_off, async, greedy, "
        "windowed_fifo or a dotted path 'package.module:name'"
    )
    with pytest.raises(ValueError, match=r"orchestrator\.scheduler\.mode: cannot import 'no_such_module:Mode'"):
        make_pool(scheduler={"mode": "no_such_module:Mode"})
    with pytest.raises(TypeError, match=r"orchestrator\.scheduler\.mode: 'builtins:str' is not a SchedulingMode"):
        make_pool(scheduler={"mode": "builtins:str"})  # str(settings) is built, but it is no mode
    with pytest.raises(ValueError, match=r"lag applies to the continuous modes, not to 'newest_first_mode:"):
        make_pool(scheduler={"mode": USER_MODE, "lag": 2})
    greedy = "arbor.orchestrator.modes.greedy:GreedyMode"  # a continuous class by its path: the config cannot tell
    with pytest.raises(ValueError, match=r"weight_updates = 'between_steps' needs a per-step mode; '" + greedy):
        make_pool(scheduler={"mode": greedy, "weight_updates": "between_steps"})
    assert make_pool(scheduler={"mode": USER_MODE, "weight_updates": "between_steps"}).mode.lag(3) == 1
