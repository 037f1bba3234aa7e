"""The `rl` terminal view: one summary line per finished step, read from metrics.jsonl as it grows.

Each line starts with a progress bar and ends with the elapsed time and an estimate of the time left, so a plain
log file shows progress as well as a terminal does. The estimate counts RL steps only: their own rate since the
first RL step this launch saw (at that first step, the step's own `time/step`), so neither the SFT warm-up nor
the processes' start-up inflate it. The SFT warm-up gets progress lines of its own (from `metrics/sft.jsonl`),
and until the first step `waiting` names what each process is doing (from its heartbeat).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from arbor.monitor.heartbeat import read_heartbeats
from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import metrics_path, process_metrics_path

COLUMNS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("loss", "loss", "{:+.4f}"),
    ("mismatch_kl", "mismatch_kl", "{:.1e}"),
    ("tokens/s", "trainer tok/s", "{:.0f}"),
    ("rollouts/s", "rollouts/s", "{:.1f}"),
    ("staleness/max", "staleness", "{}"),
)


def format_step(row: dict, max_steps: int) -> str:
    parts = [f"step {row['step'] + 1:>4}/{max_steps}"]
    for key, label, fmt in COLUMNS:
        if row.get(key) is not None:
            parts.append(f"{label} {fmt.format(row[key])}")
    return " | ".join(parts)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = min(width, done * width // max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def describe_waits(output_dir: Path, started: dict[str, float]) -> str:
    """ "name (what it does), ..." for the processes in `started` (name -> start time, unix seconds): the newest
    heartbeat of this launch whose name begins with the process's kind, its name up to any "_" ("trainer" covers
    "trainer_rank0"; replicas "inference_0", "inference_1" share the "inference" heartbeat), or "starting"
    before its first heartbeat."""
    beats = [b for b in read_heartbeats(output_dir) if isinstance(b.get("name"), str)]
    parts = []
    for name, since in started.items():
        mine = [b for b in beats if b["name"].startswith(name.split("_")[0]) and b.get("time", 0) >= since]
        # What follows a colon is a live count ("serving ...: 3 running"): the line changes with the activity only.
        doing = max(mine, key=lambda b: b["time"])["doing"].split(":")[0] if mine else "starting"
        parts.append(f"{name} ({doing})")
    return ", ".join(parts)


class Console:
    def __init__(self, output_dir: Path, max_steps: int, start: int, sft_steps: int = 0) -> None:
        self.output_dir = output_dir
        self.path = metrics_path(output_dir)
        self.sft_path = process_metrics_path(output_dir, "sft")
        self.max_steps, self.sft_steps = max_steps, sft_steps
        self.seen = self.start = start
        self.sft_seen = 0
        self.t0 = time.monotonic()
        self.first: tuple[float, int] | None = None
        """(monotonic time, steps done) when the first RL step of this launch was seen: the ETA's origin."""
        self.last_wait = ""

    def say(self, text: str, err: bool = False) -> None:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)

    def waiting(self, started: dict[str, float], what: str = "the first step") -> None:
        """Before the first RL step: one line naming what the processes in `started` do, whenever it changes."""
        if self.first is not None:
            return
        text = describe_waits(self.output_dir, started)
        if text != self.last_wait:
            self.last_wait = text
            self.say(f"waiting for {what}: {text} | {time.monotonic() - self.t0:.0f}s")

    def poll_sft(self) -> None:
        """One progress line per figure row the SFT warm-up writes (every few of its steps)."""
        for row in read_jsonl(self.sft_path):
            if "sft/loss" in row and row.get("step", 0) > self.sft_seen:
                self.sft_seen = row["step"]
                took = row.get("sft/time", 0.0)
                eta = took / self.sft_seen * (self.sft_steps - self.sft_seen)
                self.say(
                    f"{progress_bar(self.sft_seen, self.sft_steps)} SFT warm-up step {self.sft_seen:>4}/"
                    f"{self.sft_steps} | loss {row['sft/loss']:.4f} | {time.monotonic() - self.t0:.0f}s, "
                    f"eta {eta:.0f}s"
                )

    def poll(self) -> None:
        for row in read_jsonl(self.path):
            if row.get("step", -1) >= self.seen:
                self.seen = row["step"] + 1
                now = time.monotonic()
                if self.first is None:
                    self.first = (now, self.seen)
                first_t, first_done = self.first
                # The RL steps' own rate: from the first step on; at the first step, that step's own time.
                per_step = (
                    (now - first_t) / (self.seen - first_done) if self.seen > first_done else row.get("time/step", 0.0)
                )
                eta = per_step * (self.max_steps - self.seen)
                self.say(
                    f"{progress_bar(self.seen, self.max_steps)} {format_step(row, self.max_steps)} | "
                    f"{now - self.t0:.0f}s, eta {eta:.0f}s"
                )
