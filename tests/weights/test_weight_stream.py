"""Streamed weight publishing: bucket layout round trips, and 2-rank FSDP2 (torchrun, gloo, CPU) publishes equal
to the full state dict bit for bit for dense, MoE with ep = 2 and FP8 models, with delta updates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arbor.config.loader import ConfigError, load_config
from arbor.config.trainer import TrainerConfig
from arbor.weights.buckets import flat_size, flatten, plan_buckets, spec_of, unflatten

HERE = Path(__file__).parents[1]


def test_buckets_plan_flatten_and_unflatten_back_to_the_same_bytes():
    assert plan_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]  # a tensor over the size travels alone
    assert plan_buckets([], 8) == []
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 3).to(torch.bfloat16),
        "d": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "e": torch.tensor(True),
    }
    buf = flatten(tensors.values())
    assert buf.dtype == torch.uint8 and buf.numel() == flat_size(spec_of(tensors))
    back = dict(unflatten(buf, spec_of(tensors)))
    assert list(back) == list(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
        assert back[k].data_ptr() % 16 == 0  # every tensor starts aligned in the buffer


@pytest.mark.parametrize(
    "flags", [["--weights.bucket-mb", "0"], ["--weights.bucket-mb", "inf"], ["--weights.delta", "3"]]
)
def test_bad_bucket_or_delta_settings_fail_in_one_line_naming_the_key(flags):
    with pytest.raises(ConfigError, match=rf"^weights\.{flags[0].split('.')[-1].replace('-', '_')}: "):
        load_config(TrainerConfig, flags)
    cfg = load_config(TrainerConfig, ["--weights.bucket-mb", "0.5", "--weights.delta", "true"])
    assert cfg.weights.bucket_mb == 0.5 and cfg.weights.delta


@pytest.mark.slow
def test_two_rank_fsdp_streamed_publish_equals_the_full_state_dict(tmp_path: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "publish_dist_check.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    results = json.loads((tmp_path / "result.json").read_text())
    assert set(results) == {"dense", "moe_ep2", "fp8"}
    for name, r in results.items():
        assert r["mismatches"] == [], name
        assert r["shards"] > 2, name  # several buckets, written by both ranks
        assert r["figures"][0]["weights/bytes_moved"] == r["figures"][0]["weights/bytes_total"] > 0
    dense = results["dense"]
    assert dense["delta_mismatches"] == [[], []]  # both delta versions are complete, correct checkpoints
    unchanged, one_changed = dense["figures"][1], dense["figures"][2]
    assert unchanged["weights/bytes_moved"] == 0 and unchanged["weights/buckets_skipped"] == dense["shards"]
    assert 0 < one_changed["weights/bytes_moved"] < one_changed["weights/bytes_total"]
    assert one_changed["weights/buckets_skipped"] == dense["shards"] - 1
