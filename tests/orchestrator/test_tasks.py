"""The task source: launch order (retries, then a resumed run's pending tasks, then fresh ones), the seq_len skip
rule, seeds, pending tasks for the saved state, and the retry limit."""

from __future__ import annotations

import pytest
from orch_fakes import FakeEnv, FakeTokenizer, make_slices, seed_of

from arbor.environments import NoTaskFits
from arbor.orchestrator.state import OrchestratorState, TaskSampler
from arbor.orchestrator.tasks import TaskSource


def _source(lengths=(4, 5, 6, 7, 8), state: OrchestratorState | None = None, **over) -> TaskSource:
    return TaskSource(make_slices(**over).tasks, FakeEnv(list(lengths)), FakeTokenizer(), state or OrchestratorState())


def test_fresh_tasks_follow_the_seeded_sampler_and_get_ids_and_seeds_in_launch_order() -> None:
    source = _source()
    reference = TaskSampler(source.tasks, 0)
    specs = [source.next_spec(3, k) for k in range(4)]
    assert [s.task for s in specs] == [reference.next() for _ in range(4)]
    assert [s.group_id for s in specs] == [0, 1, 2, 3] and source.groups_launched == 4
    assert [s.seed for s in specs] == [seed_of(source.settings, 3, k) for k in range(4)]
    assert all(len(s.prompt_ids) == len(s.task["text"]) for s in specs)


def test_prompts_that_cannot_fit_in_seq_len_are_skipped_and_counted() -> None:
    source = _source(lengths=[30, 3, 30, 3], seq_len=16)  # 30 + max_tokens 8 > 16
    specs = [source.next_spec(0, k) for k in range(4)]
    assert all(len(s.prompt_ids) == 3 for s in specs)
    assert source.skipped_long == 4  # two epochs of the four tasks: the long two, twice


def test_a_resumed_source_relaunches_pending_tasks_first_then_continues_the_dataset() -> None:
    first = _source()
    launched = [first.next_spec(0, k).task for k in range(3)]
    first.taken(1)  # group 1 went into a batch; groups 0 and 2 are still pending
    state = first.state(1)
    assert state.step == 1 and state.pending == [first.tasks.index(launched[0]), first.tasks.index(launched[2])]
    resumed = _source(state=state)
    again = [resumed.next_spec(1, k).task for k in range(3)]
    assert again[:2] == [launched[0], launched[2]]
    assert again[2] == first.sampler.next()  # the dataset position was saved as launched
    assert resumed.pending() == [resumed.tasks.index(t) for t in again]


def test_retries_come_first_and_are_given_up_after_max_resumes() -> None:
    source = _source(partial={"enabled": True, "max_resumes": 1})
    spec, other = source.next_spec(0, 0), source.next_spec(0, 1)
    assert source.retry_group(spec.group_id)  # first straggle: queued again
    assert source.pending() == [source.tasks.index(other.task), source.tasks.index(spec.task)]  # live, then retry
    retried = source.next_spec(0, 2)
    assert retried.task is spec.task and retried.group_id == 2
    assert not source.retry_group(retried.group_id)  # retried once already: given up
    assert spec.task not in [source.tasks[i] for i in source.pending()]
    assert not source.retry_group(99)  # an unknown group is given up too


def test_closed_groups_leave_pending_only_when_cancelled() -> None:
    source = _source()
    a, b = source.next_spec(0, 0), source.next_spec(0, 1)
    source.closed(a.group_id, cancelled=False)  # finished, not yet taken: still pending
    source.closed(b.group_id, cancelled=True)
    assert source.pending() == [source.tasks.index(a.task)]
    assert source.taken(a.group_id) is a.task and source.pending() == []


def test_the_curriculum_records_solve_rates_and_its_state_is_saved() -> None:
    source = _source(curriculum={"enabled": True})
    spec = source.next_spec(0, 0)
    source.record(spec.task, 1.0)
    source.record(None, 0.0)  # a group whose task is unknown (taken before) records nothing
    state = source.state(1)
    assert state.curriculum["history"] == {str(source.tasks.index(spec.task)): [1.0]}
    assert _source(curriculum={"enabled": True}, state=state).curriculum.history == source.curriculum.history


def test_a_dataset_of_which_no_task_fits_fails_instead_of_spinning() -> None:
    with pytest.raises(
        NoTaskFits, match=r"shortest prompt is 20 tokens, which with sampling\.max_tokens = 8 exceeds seq_len = 16"
    ):
        _source(lengths=[30, 20, 25], seq_len=16)  # every prompt + max_tokens 8 > 16
    fits = _source(lengths=[30, 30, 30, 30, 3], seq_len=16)  # one task fits: long runs of skips are not an error
    assert all(len(fits.next_spec(0, k).prompt_ids) == 3 for k in range(3))
