"""The step assembler on a scripted pool: stale, empty and filtered groups are dropped, counted and replaced;
advantages and the curriculum see the kept ones; a step that only drops fails with the reason; the experience
buffer's write-then-claim and its resume release."""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from orch_fakes import FakeEnv, FakeTokenizer, group, make_cfg, make_slices

from arbor.orchestrator.assembler import StepAssembler, open_buffer
from arbor.orchestrator.buffer import ExperienceBuffer
from arbor.orchestrator.client import InferenceError
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.generation import FailedGroup
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.state import OrchestratorState
from arbor.orchestrator.tasks import TaskSource


class ScriptedPool:
    """Each `take` hands out the next scripted list of finished groups; `wait` with nothing left is a stall."""

    def __init__(self, takes: Iterator[list[list[Rollout]]]) -> None:
        self.takes, self.ended, self.client = takes, 0, None

    def use(self, client) -> None:
        self.client = client

    def admit(self, step: int, kept: int, need: int, version: int, launched: int) -> int:
        return 0

    def take(self, limit: int) -> list[list[Rollout]]:
        return next(self.takes, [])[:limit]

    async def wait(self, step: int, kept: int, need: int, version: int) -> None:
        raise RuntimeError("stalled")

    async def end_step(self) -> None:
        self.ended += 1


def _assembler(takes, **over) -> tuple[StepAssembler, ScriptedPool]:
    parts = make_slices(**over)
    source = TaskSource(parts.tasks, FakeEnv([4] * 10), FakeTokenizer(), OrchestratorState())
    pool = ScriptedPool(iter(takes))
    return StepAssembler(parts.assembler, pool, source, Counts()), pool


def _collect(assembler: StepAssembler, step: int, version: int = 0) -> list[list[Rollout]]:
    return asyncio.run(
        assembler.collect(step, "client", types.SimpleNamespace(loaded_version=version, changed=asyncio.Event()))
    )


def test_stale_and_empty_groups_are_dropped_counted_and_replaced() -> None:
    """Step 5, max_off_policy_steps 2: a group with a version-2 token is too old, one from version 3 is not."""
    assembler, pool = _assembler(
        [[group(0, [1, 0], version=2), []], [group(1, [1, 0], version=3), group(2, [0, 1], version=5)]]
    )
    kept = _collect(assembler, 5, version=5)
    assert [g[0].group_id for g in kept] == [1, 2] and pool.ended == 1 and pool.client == "client"
    assert assembler.counts.dropped_stale == 2 and assembler.counts.filtered["env_skipped"] == 1
    assert [r.advantage for r in kept[0]] == pytest.approx([0.5, -0.5])  # group-relative advantages


@pytest.mark.parametrize(
    "filters, reason", [({"drop_zero_advantage": True}, "zero_advantage"), ({"max_solve_rate": 0.5}, "difficulty")]
)
def test_filtered_groups_are_counted_by_reason_and_replaced(filters: dict, reason: str) -> None:
    assembler, _ = _assembler([[group(0, [1, 1]), group(1, [1, 0])], [group(2, [0, 1])]], filters=filters)
    assert [g[0].group_id for g in _collect(assembler, 0)] == [1, 2]
    assert assembler.counts.filtered[reason] == 2 and assembler.counts.rejected() == 2


def test_a_step_that_only_drops_fails_with_the_reason() -> None:
    endless = ([group(k, [1, 1])] for k in range(1000))
    assembler, _ = _assembler(endless, filters={"drop_zero_advantage": True})
    with pytest.raises(RuntimeError, match="dropped 101 groups in a row at step 0 .last reason: zero_advantage"):
        _collect(assembler, 0)
    empty = ([] for _ in range(1000))
    assembler, _ = _assembler([g] for g in empty)
    with pytest.raises(RuntimeError, match="the environment failed every rollout of 101 groups in a row at step 0"):
        _collect(assembler, 0)


def test_a_taken_group_leaves_pending_and_its_solve_rate_goes_to_the_curriculum() -> None:
    assembler, _ = _assembler([], curriculum={"enabled": True})
    source = assembler.source
    specs = [source.next_spec(0, k) for k in range(3)]
    assembler.pool.takes = iter([[group(0, [1, 0]), group(1, [1, 1])]])
    _collect(assembler, 0)
    assert source.pending() == [source.tasks.index(specs[2].task)]
    assert source.curriculum.rate(source.tasks.index(specs[1].task)) == 1.0


def test_the_buffer_takes_the_new_groups_and_hands_out_the_batch(tmp_path: Path, caplog) -> None:
    assembler, _ = _assembler([])
    buffer = ExperienceBuffer(tmp_path / "b.sqlite")
    claimed = assembler.through_buffer(0, [group(7, [1, 0]), group(9, [0, 1]), group(11, [1, 1])], buffer)
    assert [[r.group_id for r in g] for g in claimed] == [[0, 0], [1, 1]]  # unique in the batch
    with caplog.at_level(logging.WARNING, "arbor.orchestrator"):
        assert len(assembler.through_buffer(1, [], buffer)) == 1
    assert "the buffer had only 1 of 2 groups" in caplog.text
    with pytest.raises(RuntimeError, match="no ready, unclaimed group left for step 2"):
        assembler.through_buffer(2, [], buffer)
    buffer.close()


@pytest.mark.parametrize("reuse, start, claimable", [(False, 0, 0), (False, 1, 1), (True, 0, 2)])
def test_open_buffer_releases_the_claims_a_resume_must_redo(
    tmp_path: Path, reuse: bool, start: int, claimable: int
) -> None:
    off = make_cfg(output_dir=str(tmp_path))
    assert open_buffer(off.buffer, off.output_dir, 0, off.resume) is None
    path = tmp_path / "b.sqlite"
    buffer = ExperienceBuffer(path)
    for k, step in enumerate((0, 1)):
        buffer.put_group(group(k, [1, 0]), f"g{k}")
        buffer.claim(1, step)
    buffer.close()
    cfg = make_cfg(buffer={"enabled": True, "path": str(path), "reuse": reuse})
    buffer = open_buffer(cfg.buffer, cfg.output_dir, start, cfg.resume)
    assert len(buffer.claim(2, 5)) == claimable
    buffer.close()


def test_a_buffered_group_older_than_the_bound_is_dropped_counted_and_never_claimed_again(tmp_path: Path) -> None:
    """max_off_policy_steps 2: at step 5 a buffered group sampled by version 2 is stale, like a fresh one."""
    assembler, _ = _assembler([])
    buffer = ExperienceBuffer(tmp_path / "b.sqlite")
    buffer.put_group(group(1, [1, 0], version=2), "old", step=2)
    buffer.put_group(group(2, [0, 1], version=3), "recent", step=3)
    claimed = assembler.through_buffer(5, [group(3, [1, 0], version=5)], buffer)
    assert [g[0].task_id for g in claimed] == [2, 3]  # the stale one is skipped and the next claimed instead
    assert assembler.counts.dropped_stale == 2
    buffer.release(0)
    assert [g[0].task_id for g in buffer.claim(5, 6)] == [2, 3]  # discarded: gone for good
    buffer.close()


def test_train_only_claims_whatever_the_policy_versions(tmp_path: Path) -> None:
    assembler, _ = _assembler([], buffer={"train_only": True})
    buffer = ExperienceBuffer(tmp_path / "b.sqlite")
    buffer.put_group(group(1, [1, 0], version=0), "another run's", step=0)
    assert len(assembler.through_buffer(9, [], buffer)) == 1 and assembler.counts.dropped_stale == 0
    buffer.close()


def test_a_resume_rewinds_only_its_own_run(tmp_path: Path) -> None:
    """Run A's groups written at steps >= the resume step are discarded (they are generated again) and its claims
    released; run B's groups and claims in the same file are left alone."""
    path = tmp_path / "shared.sqlite"
    cfg = make_cfg(output_dir=str(tmp_path / "a"), resume=True, buffer={"enabled": True, "path": str(path)})
    a = ExperienceBuffer(path, str(cfg.output_dir.resolve()))
    b = ExperienceBuffer(path, "elsewhere")
    for step in range(3):
        b.put_group(group(10 + step, [1, 0], version=step), f"b{step}", step=step)
        b.claim(1, step)
    for step in range(3):
        a.put_group(group(step, [1, 0], version=step), f"a{step}", step=step)
        a.claim(1, step)
    a.close()
    # trained steps 0 (A's a0 claim stays); a1 and a2 are discarded
    buffer = open_buffer(cfg.buffer, cfg.output_dir, 1, cfg.resume)
    assert buffer.claim(5, 1) == []  # nothing of A left to claim, and B's groups are B's claims
    assert b.release(0) == 6
    assert sorted(g[0].task_id for g in buffer.claim(5, 1)) == [10, 11, 12]
    buffer.close()
    b.close()


def test_a_group_whose_generation_failed_is_skipped_counted_and_replaced(caplog) -> None:
    refused = InferenceError("http://fleet/v1/completions rejected the request (400): prompt too long", 400)
    assembler, _ = _assembler(
        [[FailedGroup(0, refused), group(1, [1, 0])], [FailedGroup(2, refused)], [group(3, [0, 1])]]
    )
    assembler.source.next_spec(0, 0)  # group 0's task is pending until it is taken
    assert 0 in assembler.source._task_of_group
    with caplog.at_level(logging.WARNING, logger="arbor.orchestrator"):
        kept = _collect(assembler, 0)
    assert [g[0].group_id for g in kept] == [1, 3] and assembler.counts.failed_groups == 2
    assert 0 not in assembler.source._task_of_group  # skipped: not relaunched by a resume
    warned = [r.getMessage() for r in caplog.records if "generation failed" in r.getMessage()]
    assert len(warned) == 2 and "prompt too long" in warned[0] and "(1 in a row; the run fails after 8)" in warned[0]


def test_too_many_failed_generations_in_a_row_fail_the_run_with_the_last_error() -> None:
    refused = InferenceError("rejected the request (400): model 'x' does not exist", 400)
    endless = ([FailedGroup(k, refused)] for k in range(100))
    assembler, _ = _assembler(endless, client={"max_failed_groups": 3})
    with pytest.raises(
        RuntimeError,
        match=r"generation failed for 4 groups in a row at step 0 "
        r"\(orchestrator.client.max_failed_groups = 3\): .*does not exist",
    ):
        _collect(assembler, 0)
    # A success in between starts the count again.
    mixed = [
        [FailedGroup(0, refused)],
        [FailedGroup(1, refused)],
        [group(2, [1, 0])],
        [FailedGroup(3, refused)],
        [FailedGroup(4, refused)],
        [group(5, [0, 1])],
    ]
    assembler, _ = _assembler(mixed, client={"max_failed_groups": 2})
    assert len(_collect(assembler, 0)) == 2 and assembler.counts.failed_groups == 4
