"""The step writer: the resume state for step + 1 (with the pending tasks) and the pruning of old states, and
the packed batch written per trainer rank."""

from __future__ import annotations

from pathlib import Path

from orch_fakes import FakeEnv, FakeTokenizer, group, make_slices

from arbor.orchestrator.state import OrchestratorState, load_state
from arbor.orchestrator.step_writer import StepWriter
from arbor.orchestrator.tasks import TaskSource
from arbor.run_dir import DONE, checkpoint_dir, orchestrator_state_path, rollout_rank_file


def test_the_state_a_resume_starts_from_is_saved_and_older_states_pruned(tmp_path: Path) -> None:
    parts = make_slices(output_dir=str(tmp_path))
    source = TaskSource(parts.tasks, FakeEnv([4] * 10), FakeTokenizer(), OrchestratorState())
    writer = StepWriter(parts.writer, 0)
    writer.save_state(0, source)
    specs = [source.next_spec(1, k) for k in range(3)]
    source.taken(specs[0].group_id)
    (checkpoint_dir(tmp_path, 2) / DONE).parent.mkdir(parents=True)
    (checkpoint_dir(tmp_path, 2) / DONE).touch()  # the trainer has checkpointed step 2: states below it go
    writer.save_state(3, source)
    state = load_state(tmp_path, 4)
    assert state == source.state(4) and state.position == 3
    assert state.pending == [source.tasks.index(s.task) for s in specs[1:]]
    assert not orchestrator_state_path(tmp_path, 1).exists()


def test_the_batch_is_packed_per_trainer_rank_and_written(tmp_path: Path) -> None:
    writer = StepWriter(make_slices(output_dir=str(tmp_path), batching={"trainer_ranks": 2}).writer, 0)
    rollouts = [r for k in range(2) for r in group(k, [1, 0])]
    batches = writer.write(5, rollouts)
    assert [b.step for b in batches] == [5, 5] and batches[0].num_samples_total == 4  # samples over all ranks
    assert all(rollout_rank_file(tmp_path, 5, rank).exists() for rank in range(2))
