"""2-rank FSDP2 (torchrun, gloo, CPU) against 1 rank: same loss and weights; a 2-rank checkpoint resumes on 1 rank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import read_metrics, trainer_args, write_rollouts

from arbor.models.args import ModelArgs
from arbor.models.hf import read_safetensors_dir
from arbor.models.presets import PRESETS
from arbor.run_dir import STABLE, broadcast_dir, checkpoint_dir, latest_checkpoint
from arbor.trainer.main import main as trainer_main

pytestmark = pytest.mark.slow


def run_torchrun(nproc: int, args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "arbor.trainer.main",
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


def assert_same_weights(a_dir: Path, b_dir: Path, atol: float) -> None:
    a, b = read_safetensors_dir(a_dir), read_safetensors_dir(b_dir)
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= atol, f"{name}: max difference {diff:.3g} > {atol}"


def test_two_rank_fsdp_matches_one_rank_and_reshards_on_resume(tmp_path: Path):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    write_rollouts({1: one, 2: two}, steps=2)
    assert trainer_main(trainer_args(one, 2)) == 0
    run_torchrun(2, trainer_args(two, 2, "--parallel.nproc", "2", "--ckpt.interval", "1"))

    # Same loss (global token mean) and the same updated weights after each step.
    for r1, r2 in zip(read_metrics(one), read_metrics(two), strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
        assert r1["mismatch_kl"] == pytest.approx(r2["mismatch_kl"], abs=1e-6)
        assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)
        assert r1["num_tokens"] == r2["num_tokens"]
    initial_vs_step1 = read_safetensors_dir(broadcast_dir(one, 1))["model.embed_tokens.weight"]
    assert not torch.equal(initial_vs_step1, read_safetensors_dir(broadcast_dir(one, 2))["model.embed_tokens.weight"])
    for version in (1, 2):
        assert_same_weights(broadcast_dir(one, version), broadcast_dir(two, version), atol=1e-5)

    # The checkpoint the 2 ranks saved after step 1 loads into 1 rank (DCP reshards) and training continues.
    assert latest_checkpoint(two) == 2
    shutil.copytree(one / "rollouts", resumed / "rollouts")
    shutil.copytree(checkpoint_dir(two, 1), checkpoint_dir(resumed, 1))
    assert trainer_main(trainer_args(resumed, 2, "--resume")) == 0
    assert (broadcast_dir(resumed, 1) / STABLE).exists()
    assert_same_weights(broadcast_dir(resumed, 1), broadcast_dir(two, 1), atol=0.0)
    assert_same_weights(broadcast_dir(resumed, 2), broadcast_dir(one, 2), atol=1e-5)


@pytest.mark.parametrize("name", ["llama-test", "glm4-moe-test", "minimax-m2-test"])
def test_two_rank_fsdp_matches_one_rank_for_each_native_family(tmp_path: Path, name: str):
    """The native families beside Qwen3 (Llama-style, and the DeepSeek-routed MoE ones) under FSDP2: one step on 2
    ranks gives 1 rank's loss, gradient norm and published weights (fp32)."""
    one, two = tmp_path / "one", tmp_path / "two"
    write_rollouts({1: one, 2: two}, steps=1)
    model = ("--model.name", name)
    assert trainer_main(trainer_args(one, 1, *model)) == 0
    run_torchrun(2, trainer_args(two, 1, "--parallel.nproc", "2", *model))
    (r1,), (r2,) = read_metrics(one), read_metrics(two)
    assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
    assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)
    assert_same_weights(broadcast_dir(one, 1), broadcast_dir(two, 1), atol=1e-5)
    assert ModelArgs.from_dir(broadcast_dir(two, 1)) == PRESETS[name]
