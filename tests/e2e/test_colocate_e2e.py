"""`inference.colocate` end to end on CPU (the reverse_text example, sync, fp32, a random tiny Qwen3): trainer and
local engine take turns, and the colocated run trains step for step as the split run does (same seed: the same
rollouts, the same losses to the last bits that continuous batching leaves to timing), while its memory, measured
at every hand-over, peaks below the sum of the two processes' peaks: the engine's sleep frees its weights and KV
cache, the trainer's offload its gradients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arbor.monitor.metrics import read_jsonl

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN = ["@", str(ROOT / "examples/reverse_text/rl.toml"), "--sft.steps", "0", "--max-steps", "3"]
RUN += ["--orchestrator.scheduler.mode", "sync", "--trainer.ckpt.interval", "100"]


def _rl(out: Path, *extra: str) -> list[dict]:
    argv = [sys.executable, "-m", "arbor.launch.rl", *RUN, "--output-dir", str(out), *extra]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    return read_jsonl(out / "metrics.jsonl")


def _phase_peaks(turn: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(trainer, engine) resident peaks of the turn's two phases: "train" (engine asleep), "generate"."""
    trainer = {"train": turn["trainer_train_peak_rss_bytes"], "generate": turn["trainer_generate_peak_rss_bytes"]}
    engine = {"train": turn["engine_asleep_peak_rss_bytes"], "generate": turn["engine_awake_peak_rss_bytes"]}
    return trainer, engine


def test_a_colocated_run_trains_like_the_split_one_and_peaks_below_the_sum_of_its_processes(tmp_path):
    split = _rl(tmp_path / "split")
    colocated = _rl(tmp_path / "colocated", "--inference.colocate", "true")
    assert [r["step"] for r in colocated] == [r["step"] for r in split] == [0, 1, 2]
    # The same rollouts and the same updates: what the engine's continuous batching does to the last bits of its
    # logprobs (which requests share a decode step depends on timing, in any two runs) is all that differs.
    for a, b in zip(split, colocated):
        print(
            f"step {a['step']}: loss {a['loss']:.9g} / {b['loss']:.9g}, reward {a['reward/mean']} / {b['reward/mean']}"
        )
        assert a["reward/mean"] == b["reward/mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    turns = [json.loads(line) for line in (tmp_path / "colocated/colocate/turns.jsonl").read_text().splitlines()]
    turns = [{k.removeprefix("colocate/"): v for k, v in t.items()} for t in turns]
    assert [t["step"] for t in turns] == [0, 1, 2]
    # Resident memory: phases never overlap (the turn files order them), so the pair's peak is at most the worst
    # phase's sum; each process's own peak is its worst phase.
    phases = [_phase_peaks(t) for t in turns]
    together = max(tr[p] + en[p] for tr, en in phases for p in ("train", "generate"))
    apart = max(max(tr.values()) for tr, _ in phases) + max(max(en.values()) for _, en in phases)
    # Tracked bytes: the engine holds nothing asleep; the trainer's step holds its gradients too.
    engine_held = max(t["engine_held_bytes"] for t in turns)
    train_peak = max(t["trainer_train_device_peak_bytes"] for t in turns)
    tracked = max(max(train_peak, t["trainer_generate_device_bytes"] + engine_held) for t in turns)
    print(
        f"resident peak together {together / 1e6:.1f} MB vs apart {apart / 1e6:.1f} MB; "
        f"tracked {tracked / 1e6:.2f} MB vs {(train_peak + engine_held) / 1e6:.2f} MB"
    )
    assert together < apart
    assert tracked < train_peak + engine_held
    assert all(t["engine_released_bytes"] == engine_held > 0 for t in turns)
