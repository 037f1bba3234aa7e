"""The trainer process with expert parallelism and resharding checkpoints (torchrun, gloo, 2 CPU ranks).

Both directions of DCP resharding on an MoE model whose experts are ep-sharded DTensors at 2 ranks: 3 steps at
2 ranks (FSDP2 + EP=2) then 2 steps at 1 rank, and 3 steps at 1 rank then 2 at 2 ranks, each equal to an
uninterrupted 5-step single-rank run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_trainer import read_metrics, write_rollouts
from test_trainer_dist import assert_same_weights, run_torchrun

from arbor.run_dir import broadcast_dir, checkpoint_dir
from arbor.trainer.main import main as trainer_main

pytestmark = pytest.mark.slow


def moe_args(output_dir: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        "--output-dir",
        str(output_dir),
        "--max-steps",
        str(max_steps),
        "--model.name",
        "qwen3-moe-test",
        "--optim.lr",
        "1e-3",
        "--num-threads",
        "1",
        "--ckpt.interval",
        "1",
        "--ckpt.keep",
        "10",
        "--keep-broadcasts",
        "10",
        *extra,
    ]


EP2 = ("--parallel.nproc", "2", "--parallel.ep", "2")


def test_ep_checkpoints_reshard_between_two_ranks_and_one(tmp_path: Path):
    one, two, to_one, to_two = (tmp_path / n for n in ("one", "two", "to_one", "to_two"))
    write_rollouts({1: one, 2: two}, steps=5)
    shutil.copytree(one / "rollouts", to_one / "rollouts")
    shutil.copytree(two / "rollouts", to_two / "rollouts")
    assert trainer_main(moe_args(one, 5)) == 0
    run_torchrun(2, moe_args(two, 3, *EP2))

    # FSDP2 + EP=2 trains exactly as one rank (same loss and weights after every step).
    for r1, r2 in zip(read_metrics(one)[:3], read_metrics(two), strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
        assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)
    for version in (1, 2, 3):
        assert_same_weights(broadcast_dir(one, version), broadcast_dir(two, version), atol=1e-5)

    # 2 ranks -> 1 rank.
    shutil.copytree(checkpoint_dir(two, 3), checkpoint_dir(to_one, 3))
    assert trainer_main(moe_args(to_one, 5, "--resume")) == 0
    assert_same_weights(broadcast_dir(to_one, 5), broadcast_dir(one, 5), atol=1e-5)

    # 1 rank -> 2 ranks with the experts split.
    shutil.copytree(checkpoint_dir(one, 3), checkpoint_dir(to_two, 3))
    run_torchrun(2, moe_args(to_two, 5, *EP2, "--resume"))
    assert_same_weights(broadcast_dir(to_two, 5), broadcast_dir(one, 5), atol=1e-5)


def test_context_parallel_trainer_matches_one_rank(tmp_path: Path):
    """CP=2 (ring, zig-zag) composed with EP=2 and activation checkpointing under torchrun: both ranks split every
    row of the one rollout file and train exactly as a single rank does (loss figures and weights after each
    step)."""
    one, cp = tmp_path / "one", tmp_path / "cp"
    write_rollouts({1: one}, steps=2)
    shutil.copytree(one / "rollouts", cp / "rollouts")
    assert trainer_main(moe_args(one, 2)) == 0
    run_torchrun(
        2,
        moe_args(
            cp,
            2,
            "--parallel.nproc",
            "2",
            "--parallel.cp",
            "2",
            "--parallel.cp-style",
            "ring",
            "--parallel.ep",
            "2",
            "--parallel.activation-checkpointing",
            "true",
        ),
    )
    for r1, r2 in zip(read_metrics(one), read_metrics(cp), strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
        assert r1["mismatch_kl"] == pytest.approx(r2["mismatch_kl"], rel=1e-4)
        assert r1["num_tokens"] == r2["num_tokens"] and r1["loss_tokens"] == r2["loss_tokens"]
    for version in (1, 2):
        assert_same_weights(broadcast_dir(one, version), broadcast_dir(cp, version), atol=1e-5)
