"""Where an `rl` run's start-up goes, from launch to its first generation: each process's phases and CPU seconds.

`StartupTrace` watches a running `rl` from outside (benchmarks/vs_trl.py's arbor arm polls it): the processes'
heartbeats (arbor.monitor.heartbeat: each writes what it does now, with the time it began) give the moment each
phase began, /proc gives each process's start and CPU seconds. It stops at the orchestrator's first
"generating" heartbeat, the first generation, and then snapshots every process's CPU seconds (user + system), so
that a loaded machine's wall seconds can be told apart from the work: the CPU seconds do not grow with the load
(much), the wall seconds do.

The phases (seconds after `rl` was launched; a phase shorter than the poll interval is seen late or not at all):
- inference: "process started" -> "loading the engine" (its entry point's imports, torch among them, done) ->
  "building the engine" (the model, the tokenizer) -> "serving" (the HTTP server listens);
- trainer: "loading torch" (its config read) -> "building the model" (the model, the optimizer) -> "waiting for
  rollouts step 0";
- orchestrator: "starting" (after its imports, torch among them, and its environment and tokenizer) ->
  "waiting for the inference servers' /health" -> "generating and scoring step 0".

Linux only (/proc); elsewhere the CPU seconds read as None.

    uv run python benchmarks/startup_phases.py [CONFIG.toml]   # one start-up (default examples/reverse_text), no SFT

Its last line is JSON: `first_generation_s`, `cpu_s` (process -> CPU seconds, and their total) and `phases`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smoke import parse_args

from arbor.monitor.heartbeat import read_heartbeats

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
FIRST_GENERATION = "generating"
"""The orchestrator's heartbeat that marks the first generation (arbor.orchestrator.main)."""


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (its own, not its children's), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def started_at(pid: int) -> float | None:
    """The wall-clock time (epoch seconds) process `pid` started, None where /proc cannot say."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime"))
    except (OSError, IndexError, StopIteration, ValueError):
        return None
    return boot + ticks / CLOCK_TICKS


def phase(doing: str) -> str:
    """A heartbeat's text without its counts ("serving policy version 0: 0 running, ..." -> "serving")."""
    if doing.startswith("serving"):
        return "serving"
    return re.sub(r"\s*\(.*\)$", "", doing)


class StartupTrace:
    """Phases and CPU seconds of the run in `run_dir`, launched (`rl`'s pid `launcher`) at epoch `launched`."""

    def __init__(self, run_dir: Path, launcher: int, launched: float) -> None:
        self.run_dir, self.launched = run_dir, launched
        self.pids: dict[str, int] = {"rl": launcher}
        self.phases: dict[str, dict[str, float]] = {}
        """process -> phase -> seconds after launch it began (the heartbeat's own time)."""
        self.first_generation: float | None = None
        self.cpu: dict[str, float | None] = {}
        """process -> CPU seconds at the first generation."""

    def poll(self) -> bool:
        """Reads the heartbeats once; True once the first generation has been seen (and the CPU snapshot taken)."""
        if self.first_generation is not None:
            return True
        for beat in read_heartbeats(self.run_dir):
            name, doing = beat.get("name"), beat.get("doing")
            if not isinstance(name, str) or not isinstance(doing, str):
                continue
            self.pids[name] = beat["pid"]
            seen = self.phases.setdefault(name, {})
            seen.setdefault(phase(doing), round(beat["time"] - self.launched, 3))
            if name == "orchestrator" and doing.startswith(FIRST_GENERATION):
                self.first_generation = beat["time"] - self.launched
        if self.first_generation is None:
            return False
        self.cpu = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        for name, pid in self.pids.items():
            begun = started_at(pid)
            if begun is not None and name != "rl":
                self.phases[name] = {"process started": round(begun - self.launched, 3), **self.phases[name]}
        return True

    def summary(self) -> dict:
        cpu = {k: None if v is None else round(v, 2) for k, v in self.cpu.items()}
        known = [v for v in cpu.values() if v is not None]
        return {
            "first_generation_s": None if self.first_generation is None else round(self.first_generation, 2),
            "cpu_s": {**cpu, "total": round(sum(known), 2)},
            "phases": self.phases,
        }


def lines(summary: dict) -> list[str]:
    """The summary as a few human lines: one per process, its phases in order, then its CPU seconds."""
    out = [f"start-up to the first generation: {summary['first_generation_s']} s wall, CPU s {summary['cpu_s']}"]
    for name, seen in sorted(summary["phases"].items()):
        steps = ", ".join(f"{p} {t:.2f}" for p, t in sorted(seen.items(), key=lambda kv: kv[1]))
        out.append(f"  {name}: {steps}")
    return out


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=str(root / "examples/reverse_text/rl.toml"), help="the run's TOML")
    a = parse_args(p)
    config = a.config  # --smoke: the same single start-up, then one step of 16 samples (not two of the example's)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        argv = [sys.executable, "-m", "arbor.launch.rl", "@", config]
        argv += ["--sft.steps", "0", "--max-steps", "2", "--output-dir", str(run)]
        if a.smoke:  # later arguments win
            argv += ["--max-steps", "1", "--orchestrator.batch-size", "16"]
        launched = time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
        trace = StartupTrace(run, proc.pid, launched)
        while not trace.poll() and proc.poll() is None:
            time.sleep(0.05)
        proc.wait()
    summary = trace.summary()
    print("\n".join(lines(summary)))
    print(json.dumps({"benchmark": "startup_phases", **summary}))


if __name__ == "__main__":
    main()
