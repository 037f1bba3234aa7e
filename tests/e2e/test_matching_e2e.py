"""Live throughput matching end to end: a tiny continuous run with no threads set by hand reports the core split
it chose and, per step, the trainer-wait and generator-idle fractions, the queue depth and the adapted in-flight
limit within its bounds."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
from test_rl_e2e import TINY, _finish

from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import configs_dir

pytestmark = pytest.mark.slow


def test_matching_figures_and_core_split_in_a_tiny_run(tmp_path):
    out = tmp_path / "run"
    hand_threads = {"--trainer.num-threads", "--inference.num-threads"}
    tiny = [a for i, a in enumerate(TINY) if a not in hand_threads and (i == 0 or TINY[i - 1] not in hand_threads)]
    argv = [
        sys.executable,
        "-m",
        "arbor.launch.rl",
        "--output-dir",
        str(out),
        *tiny,
        "--max-steps",
        "4",
        "--orchestrator.scheduler.mode",
        "async",
        "--orchestrator.max-off-policy-steps",
        "2",
    ]
    rc, stdout, stderr = _finish(
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    )
    assert rc == 0, stderr + stdout
    assert "cores: trainer" in stdout
    threads = [
        tomllib.loads((configs_dir(out) / f"{n}.toml").read_text())["num_threads"] for n in ("trainer", "inference")
    ]
    assert min(threads) >= 1
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert 0 <= r["throughput/trainer_wait_frac"] <= 1
        assert 0 <= r["throughput/generator_idle_frac"] <= 1
        assert r["throughput/queue_depth"] >= 0
        # 4 groups a step; async with max_off_policy_steps 2 uses at most 3 steps' groups at once
        assert 1 <= r["throughput/groups_in_flight"] <= 12
