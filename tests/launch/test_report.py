"""arbor-report: plots and summary of a finished CPU run, and the cost figure from measured pool wall-clock."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from arbor.launch.report import PLOTS, main

TINY = [
    "--model.name",
    "qwen3-test",
    "--seq-len",
    "48",
    "--max-steps",
    "3",
    "--orchestrator.batch-size",
    "8",
    "--orchestrator.group-size",
    "4",
    "--orchestrator.sampling.max-tokens",
    "8",
    "--orchestrator.environment.args",
    "{ min_len = 2, max_len = 5, num_tasks = 50 }",
    "--trainer.num-threads",
    "1",
    "--inference.num-threads",
    "1",
    "--inference.max-batch-size",
    "16",
]


@pytest.mark.slow
def test_report_of_a_finished_cpu_run(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbor.launch.rl",
            "--output-dir",
            str(out),
            *TINY,
            "--cost.gpu-hour-usd",
            "2.0",
            "--cost.inference-gpus",
            "1",
            "--cost.trainer-gpus",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    assert "[" in res.stdout and "] step    3/3" in res.stdout  # the progress bar prefixes each step line
    assert main([str(out)]) == 0
    for name in PLOTS:
        png = out / "report" / f"{name}.png"
        assert png.stat().st_size > 5000, name
        pixels = imread(png)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert float(np.var(pixels[..., :3])) > 1e-3, f"{name}.png is blank"
    text = (out / "report" / "report.md").read_text()
    for phrase in (
        "reward/mean",
        "trainer wait ratio",
        "mismatch_kl",
        "per million trained tokens",
        "measured wall-clock",
    ):
        assert phrase in text, phrase
    cost = json.loads((out / "report" / "cost.json").read_text())
    timings = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    secs = timings[0]["seconds"]
    assert secs["inference"] > 0 and secs["trainer"] > 0
    expect = 2.0 * (1 * secs["inference"] + 2 * secs["trainer"]) / 3600
    assert cost["usd"] == pytest.approx(expect, rel=1e-6)
    assert cost["usd_per_m_trained"] == pytest.approx(cost["usd"] / (cost["trained_tokens"] / 1e6))


@pytest.mark.slow
def test_report_of_synthetic_metrics_without_timings(tmp_path):
    rows = [
        {
            "step": i,
            "reward/mean": i / 10,
            "reward/std": 0.1,
            "reward/max": i / 5,
            "staleness/max": i % 2,
            "staleness/mean": 0.5,
            "tokens/s": 100 + i,
            "rollouts/s": 5.0,
            "time/step": 2.0,
            "time/wait": 0.5 + i / 20,
            "mismatch_kl": 1e-4 * (i + 1),
            "num_tokens": 1000.0,
        }
        for i in range(12)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path), "--gpu-hour-usd", "3.6"]) == 0
    cost = json.loads((tmp_path / "report" / "cost.json").read_text())
    # No timings.jsonl: both pools count the summed time/step (24 s), one GPU each by default.
    assert cost["measured"] is False and cost["usd"] == pytest.approx(3.6 * 2 * 24 / 3600)
    assert "start-up not counted" in (tmp_path / "report" / "report.md").read_text()
    assert float(np.var(imread(tmp_path / "report" / "wait_ratio.png")[..., :3])) > 1e-3


def test_report_without_metrics_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl is missing or empty"):
        main([str(tmp_path)])
