"""benchmarks/startup_phases.py's trace, on heartbeats written here: phases in order, the first generation, the
CPU seconds of live processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from startup_phases import StartupTrace, cpu_seconds, lines, phase, started_at  # noqa: E402


def write_beat(run: Path, name: str, doing: str, at: float) -> None:
    beats = run / "heartbeats"
    beats.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "pid": os.getpid(), "time": at, "doing": doing, "stack_file": None}
    (beats / name).write_text(json.dumps(record))


def test_trace_records_phases_until_the_first_generation(tmp_path: Path) -> None:
    launched = started_at(os.getpid()) - 1.0  # `rl` launched a second before this process began
    trace = StartupTrace(tmp_path, os.getpid(), launched)
    assert not trace.poll()  # no heartbeat yet
    write_beat(tmp_path, "inference", "loading the engine", launched + 2.0)
    write_beat(tmp_path, "orchestrator", "waiting for the inference servers' /health", launched + 3.0)
    assert not trace.poll()
    write_beat(tmp_path, "inference", "serving policy version 0: 0 running, 0 waiting", launched + 4.0)
    write_beat(tmp_path, "orchestrator", "generating and scoring step 0", launched + 4.5)
    assert trace.poll()
    summary = trace.summary()
    assert summary["first_generation_s"] == 4.5
    assert summary["phases"]["inference"]["loading the engine"] == 2.0
    assert summary["phases"]["inference"]["serving"] == 4.0  # the counts are not part of the phase
    assert summary["phases"]["orchestrator"]["waiting for the inference servers' /health"] == 3.0
    # this process stands for each of them: its CPU seconds are positive and counted once per name
    assert summary["cpu_s"]["rl"] > 0 and summary["cpu_s"]["inference"] > 0
    assert summary["cpu_s"]["total"] >= 3 * summary["cpu_s"]["rl"] - 0.05
    text = "\n".join(lines(summary))
    assert "  inference: " in text and "serving 4.00" in text
    started = summary["phases"]["inference"]["process started"]  # this process's start, from /proc
    assert 0.0 <= started <= 2.0  # /proc/stat's boot time is whole seconds
    # later heartbeats change nothing: the snapshot is the first generation's
    write_beat(tmp_path, "orchestrator", "generating and scoring step 7", launched + 9.0)
    assert trace.poll() and trace.summary()["first_generation_s"] == 4.5


def test_cpu_seconds_of_a_missing_process_is_none() -> None:
    assert cpu_seconds(os.getpid()) > 0
    assert cpu_seconds(2**22 + 12345) is None
    assert phase("waiting for policy version 1 (step 2)") == "waiting for policy version 1"
