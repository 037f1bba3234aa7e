"""End-to-end `rl` on examples/vision (CPU, real processes and HTTP): a tiny random Qwen2.5-VL written locally
(no download) warms up on the `shapes` colour task with its images, then trains with RL through the local engine.
The example as it ships: every step's batch carries its images, trainer and engine agree where they hold the same
weights (the first step), and RL lifts the reward by >= 0.15 after the warm-up (mean of the last 5 steps over the
first 5; seeds 0, 1 and 2 measured in examples/vision/README.md). A synchronous run with images, every step on
policy, is tests/vllm/test_vllm_vision.py's (vLLM serving)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from arbor.models.vision_tiny import VLLM_SHAPE, write_tiny_vl
from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import rollout_rank_file as rank_file
from arbor.transport.files import read_step

pytestmark = pytest.mark.slow


RISE_SEED = 0


def test_vision_example_learns_after_the_warm_up(tmp_path):
    """The example's own recipe (`rl.toml` unchanged but for the paths): the short warm-up teaches the answer's
    form and a little of the colour; RL is what makes the policy read the image well (a policy blind to it scores
    0.25 at best, four colours being equally likely)."""
    model = write_tiny_vl(tmp_path / "tiny-vl", **VLLM_SHAPE)
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "arbor.launch.rl", "@", "examples/vision/rl.toml", "--output-dir", str(out)]
    argv += ["--model.name", str(model), "--seed", str(RISE_SEED)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["mismatch_kl"] < 1e-3  # the warm-up's weights on both sides: the trainer scores what was sampled
    batch = read_step(rank_file(out, len(rows) - 1, 0))  # the last step's (older ones are pruned)
    assert all(mb.pixel_values is not None for mb in batch.micro_batches if mb.loss_mask.any())
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) >= 10
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.15, (first, last, rewards)
