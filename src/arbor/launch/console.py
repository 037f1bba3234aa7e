"""The `rl` terminal view: one summary line per finished step, read from metrics.jsonl as it grows.

Each line starts with a progress bar and ends with the elapsed time and an estimate of the time left (from the
mean time per step of this launch), so a plain log file shows progress as well as a terminal does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import metrics_path

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


class Console:
    def __init__(self, output_dir: Path, max_steps: int, start: int) -> None:
        self.path = metrics_path(output_dir)
        self.max_steps = max_steps
        self.seen = self.start = start
        self.t0 = time.monotonic()

    def say(self, text: str, err: bool = False) -> None:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)

    def poll(self) -> None:
        for row in read_jsonl(self.path):
            if row.get("step", -1) >= self.seen:
                self.seen = row["step"] + 1
                elapsed = time.monotonic() - self.t0
                eta = elapsed / (self.seen - self.start) * (self.max_steps - self.seen) if self.seen > self.start else 0.0
                self.say(f"{progress_bar(self.seen, self.max_steps)} {format_step(row, self.max_steps)} | "
                         f"{elapsed:.0f}s, eta {eta:.0f}s")
