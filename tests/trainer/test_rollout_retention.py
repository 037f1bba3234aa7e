"""Bounded disk: the trainer keeps the rollouts of its `keep_rollouts` newest trained steps and removes older
ones, never a step it has not trained."""

from __future__ import annotations

from pathlib import Path

from test_trainer import trainer_args, write_rollouts

from arbor.run_dir import rollout_steps
from arbor.trainer.main import main as trainer_main


def test_the_trainer_keeps_the_last_k_rollout_steps(tmp_path: Path) -> None:
    write_rollouts({1: tmp_path}, steps=5)
    assert trainer_main(trainer_args(tmp_path, 4, "--keep-rollouts", "2")) == 0
    assert rollout_steps(tmp_path) == [2, 3, 4]  # 2 and 3 trained last; 4 was never trained
