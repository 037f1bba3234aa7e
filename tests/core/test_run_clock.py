"""Time in the metrics: `RunClock` stamps rows with `time` and `elapsed_s`, going on across a resume from the last
row kept before the checkpoint; `max_minutes` is a shared, bounded key."""

from __future__ import annotations

import json
import time

import pytest

from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.monitor.metrics import MetricsWriter, RunClock
from arbor.run_dir import metrics_path


def test_a_fresh_clock_starts_at_zero_and_stamps_unix_time(tmp_path) -> None:
    clock = RunClock(tmp_path)
    stamp = clock.stamp()
    assert set(stamp) == {"time", "elapsed_s"}
    assert abs(stamp["time"] - time.time()) < 5 and 0 <= stamp["elapsed_s"] < 5


def test_a_resumed_clock_goes_on_from_the_last_row_before_its_checkpoint(tmp_path) -> None:
    rows = [{"step": 0, "elapsed_s": 10.0}, {"step": 1, "elapsed_s": 20.0}, {"step": 2, "elapsed_s": 30.0}]
    metrics_path(tmp_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert RunClock(tmp_path, start=2).offset == 20.0  # step 2 is redone: its time is not counted twice
    assert RunClock(tmp_path, start=0).offset == 0.0
    assert 20.0 <= RunClock(tmp_path, start=2).elapsed() < 25.0
    metrics_path(tmp_path).write_text(json.dumps({"step": 0}) + "\n")  # rows from before elapsed_s existed
    assert RunClock(tmp_path, start=1).offset == 0.0


def test_forgotten_steps_are_not_waited_for(tmp_path) -> None:
    w = MetricsWriter(tmp_path)
    for step in range(4):
        w.add(step, {"reward/mean": 0.0})
    w.forget_from(2)
    assert sorted(w.pending) == [0, 1]


def test_max_minutes_is_shared_with_the_trainer_and_bounded() -> None:
    cfg = load_config(RLConfig, ["--max-minutes", "1.5"], prog="rl")
    assert cfg.max_minutes == 1.5 and cfg.trainer.max_minutes == 1.5
    assert load_config(RLConfig, [], prog="rl").trainer.max_minutes is None
    with pytest.raises(ConfigError, match="max_minutes"):
        load_config(RLConfig, ["--max-minutes", "0"], prog="rl")
    with pytest.raises(ConfigError, match="max_minutes"):
        load_config(RLConfig, ["--max-minutes", "2", "--trainer.max-minutes", "3"], prog="rl")


@pytest.mark.slow
def test_report_shows_the_wall_time_of_the_last_row(tmp_path) -> None:
    from arbor.launch.report import main

    rows = [{"step": i, "reward/mean": 0.1, "time": 1e9 + 60 * i, "elapsed_s": 60.0 * (i + 1)} for i in range(3)]
    metrics_path(tmp_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path)]) == 0
    assert "- wall time: 3.0 min" in (tmp_path / "report" / "report.md").read_text()
