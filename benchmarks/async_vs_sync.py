"""Wall-clock and reward of the real stack, synchronous against asynchronous scheduling, with every other setting
equal. Both arms run `rl` on CPU with the same tiny model, data, seed, number of steps (so the same number of
trained samples), environment, staleness bound (`max_off_policy_steps`), groups in flight and partial-rollout
settings; only `[orchestrator.scheduler].mode` differs (async arm: "greedy" by default, whose first-finished-
first-out matches what the sync arm's oversampling does within a step; strict-FIFO "async" waits on stragglers).
An earlier version reported 4.9x: only its async arm had partial rollouts, a staleness bound of 3 (sync: 2) and
12 groups in flight, on an environment whose cost was all `sleep`, and no reward was compared.

The environment (arbor.environments.skewed_latency) mixes latency-bound scoring (a lognormal wait, slower for
harder tasks, rare 20x stragglers) with compute-bound scoring (`compute_p` of the scorings spend their time as
CPU work that competes with the trainer and the inference engine for the cores), so asynchrony cannot hide all
of the environment's cost for free. The trainer and the engine get one thread each: each side then leaves a
core idle while the other works, as a cluster's trainer and inference GPUs idle in turn in a synchronous run.

The regime is chosen by measurement. Asynchrony can at best hide the shorter of generation and training behind
the longer (a sync step takes their sum, an async one their maximum: 2x when they are equal), so unless
`--median-s` is given, short sync calibration runs (no environment latency, then the environment's `median_s`)
fit the orchestrator's generation time per step as the fleet's fixed share plus the environment's, and set the
latency scale so that generation takes about as long as training (refined by up to `--calibration-checks` runs,
interpolating between measured points, until within `--balance`); both arms then run with that environment.

Reported: the wall-clock ratio sync / async of the training loop (the sum of the trainer's `time/step` after the
first step, whose wait holds the other processes' start-up) and of the whole `rl` command, and the reward each
arm reached (mean `reward/mean` of its last `--tail` steps), with the gap: parity means async within 0.02 of
sync. The arms run in `--repeats` pairs, back to back with their order alternating, since the machine may be
shared: the ratio is the median of the paired ratios, the other figures the medians of each arm's runs. Each
arm also reports its per-step training and generation time, how much its trainer waited for rollouts
(`trainer_wait_frac`), its orchestrator's wait for weights, and the CPU seconds each of its processes spent
over the loop (/proc, `cpu_*_s`). From the latter comes `cpu_ceiling`: the largest ratio any schedule could
reach on this machine given the async arm's own work, its CPU seconds spread over every core (and never below
its trainer's, one process on the critical path). The last line (JSON) holds both arms' wall time
(`sync_wall_s`, `async_wall_s`: the training loop), reward (`sync_reward`, `async_reward`) and the ceiling.

Measured on the idle 2-core machine, `--model qwen3-tiny --seq-len 64 --max-tokens 16` (the default `qwen3-test`
trains in 0.07 s a step, where fixed per-step costs dominate: 1.28x with 50 ms handoff polls), 20 steps, 5
pairs, calibrated median_s 0.0204, both arms meeting the same environment costs for the same tasks:

    sync 9.8 s loop (0.51 s a step: training 0.24, generation 0.24, trainer waiting 47%), reward 0.017;
    greedy 8.0 s (trainer waiting 16-21%), reward 0.024 -> 1.16x (pairs 1.06-1.29x), gap +0.007 (parity);
    CPU per step: sync 0.76 CPU-s (1.48 of 2 cores busy), greedy 0.75 (trainer 0.24, inference 0.20,
    orchestrator 0.31, nearly all of it the environment's hashing) -> cpu_ceiling 1.32x.

The same invocation with costs drawn per completion (each run its own draws, before the environment's costs
followed the task): 1.22x (pairs 1.07-1.57x, ceiling 1.50x) and 1.52x (pairs 1.33-2.11x, ceiling 1.69x), the
spread between pairs set by which run drew the rare compute-bound stragglers (0.6% of scorings, up to ~8 CPU-s
each, one of which takes a core for most of a loop).

So the target (1.6x) is out of reach on two cores whatever the schedule: the environment's compute-bound share,
which on a cluster runs in sandboxes on CPU nodes of its own, here takes the cores that asynchrony would fill
(the sync arm already keeps 1.5 of the 2 busy). On a machine with cores to spare beyond the trainer's and the
engine's (one thread each here), the environment's CPU work runs beside them and `cpu_ceiling` rises towards
the 2x of balanced phases. Measured on a 16-core GPU host (an H100 machine, 2026-11-27, `CUDA_VISIBLE_DEVICES=`
so that the trainer stays on CPU as here, torch 2.11), the same invocation with `--repeats 2
--calibration-checks 2`:

    calibrated median_s 0.015 (the checks ended with generation 0.12-0.25 s against training 0.17-0.18 s);
    sync 6.3 s loop, reward 0.033; greedy 5.2 s, reward 0.023 -> 1.22x (pairs 1.06x, 1.39x), gap -0.009
    (parity); CPU: sync 1.73 of 16 cores busy, greedy 2.05 -> cpu_ceiling 1.69x.

So the cores were not what held the ratio down there: the async arm's step (0.26 s) stayed above its training
(0.17 s), its trainer waiting 15-23% of the loop, and its generation per step was slower than the sync arm's
(0.16-0.25 s against 0.12-0.14 s). A likely cause, found afterwards: the local engine then rebuilt the KV
cache of every running sequence after each weight update with one forward per request and per sample, some
400 ms for 64 sequences on one thread (30 decode steps), which only the async arm pays (the sync arm updates
while the engine is idle). The engine now recomputes in batched forwards (about 170 ms), and both arms run
with `inference.kv_after_update = "keep"` (no recomputation: what vLLM does with in-flight updates, the fleet
this benchmark stands in for; the sync arm never updates mid-generation, so the setting is equal and only
matters to the async arm). On the idle 2-core machine (2026-11-27, 5 pairs, calibrated median_s 0.0369) the
ratio stays where the cores hold it: sync 12.1 s loop, reward 0.032; greedy 10.8 s, reward 0.027 -> 1.14x,
gap -0.005 (parity), cpu_ceiling 1.28x (the async arm's training step 0.34 s against the sync arm's 0.27: the
two share the cores). The same 16-core invocation with these changes (the H100 host again, 2026-11-27):

    calibrated median_s 0.0165; sync 5.3 s loop, reward 0.024; greedy 3.7 s, reward 0.020 -> 1.43x (pairs 1.49x,
    1.37x), gap -0.004 (parity); CPU: sync 1.90 of 16 cores busy, greedy 2.60 -> cpu_ceiling 1.71x.

The async arm's generation per step (0.19 s) still exceeded its training (0.15 s; trainer waiting 15%), so the
fleet's throughput at the staleness bound set it: a group's latency (decode, then its scorings' waits) times the
rate the trainer consumes groups is what must be in flight, and the bound admits about two steps of groups. Since
then the local engine decodes about 1.3x faster (sampling in one batched pass, cheaper cache gathers) and the pool
launches as soon as a newer policy widens the bound; on the 2-core machine (5 pairs, median_s 0.0263) this reads
1.17x (pairs 1.10-1.39x), gap +0.005, cpu_ceiling 1.24x: the cores again. On the 16-core H100 host
(2026-11-28, the same invocation with `--steps 20 --repeats 3 --calibration-checks 2`, two runs):

    calibrated median_s 0.0339; sync 8.6 s loop, reward 0.020; greedy 5.1 s, reward 0.021 -> 1.67x (pairs 1.82x,
    1.67x, 1.66x), gap +0.001 (parity); CPU: sync 2.12 of 16 cores busy, greedy 3.33 -> cpu_ceiling 1.77x.
    second run: sync 7.9 s, reward 0.023; greedy 4.4 s, reward 0.025 -> 1.80x (pairs 1.82x, 1.70x, 1.80x),
    gap +0.002 (parity), cpu_ceiling 2.09x.

The target (1.6x with parity) holds where the cores are there to overlap on; with two it reads as ~1.2x and
`cpu_ceiling` says why.

    uv run python benchmarks/async_vs_sync.py [--model qwen3-test] [--seq-len 48] [--max-tokens 8] [--steps 20]
        [--repeats 5] [--async-mode greedy] [--median-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from pathlib import Path

from smoke import parse_args

from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import trainer_metrics_path

BATCH, GROUP = 16, 4
ENV = "arbor.environments.skewed_latency:SkewedLatencyEnv"
BASE = [
    "--seed",
    "0",
    "--orchestrator.batch-size",
    str(BATCH),
    "--orchestrator.group-size",
    str(GROUP),
    "--orchestrator.environment.id",
    ENV,
    "--trainer.num-threads",
    "1",
    "--inference.num-threads",
    "1",
    "--inference.max-batch-size",
    "64",
    # vLLM's in-flight updates keep the running sequences' KV (module docstring); the sync arm never needs either
    "--inference.kv-after-update",
    "keep",
]


def model_args(a: argparse.Namespace) -> list[str]:
    """The model and lengths, the same for both arms and the calibration."""
    return [
        "--model.name",
        a.model,
        "--seq-len",
        str(a.seq_len),
        "--orchestrator.sampling.max-tokens",
        str(a.max_tokens),
    ]


def shared_args(a: argparse.Namespace) -> list[str]:
    """What both arms get: the same staleness bound, groups in flight, oversampling and partial rollouts."""
    groups = BATCH // GROUP
    in_flight = max(groups, round(a.oversample * groups))
    return [
        *model_args(a),
        "--orchestrator.environment.args",
        a.env_args,
        "--orchestrator.max-off-policy-steps",
        str(a.max_off_policy),
        "--orchestrator.scheduler.max-in-flight",
        str(in_flight),
        "--orchestrator.partial.enabled",
        "true",
    ]


def arm_args(mode: str, a: argparse.Namespace) -> list[str]:
    # `oversample` is the per-step modes' name for groups in flight beyond one step; the continuous modes take
    # the same number through max_in_flight (shared_args), so both launch equally far ahead of the batch.
    if mode in ("sync", "one_step_off"):
        return ["--orchestrator.scheduler.oversample", str(a.oversample)]
    return []


ROLES = {"arbor.trainer": "trainer", "arbor.inference.server": "inference", "arbor.orchestrator": "orchestrator"}
"""Module in a process's command line -> the role its CPU time is counted under (the rest: "other")."""


class CpuMeter:
    """Samples the CPU time (user + system, from /proc) of a process and all its descendants every `interval`
    seconds, by role, and keeps the samples taken at the trainer's first and last metrics rows: the CPU that each
    process spent during the timed loop. Linux only; elsewhere `loop_cpu` is empty."""

    def __init__(self, root: int, rows_path: Path, interval: float = 0.05) -> None:
        self.root, self.rows_path, self.interval = root, rows_path, interval
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.roles: dict[int, str] = {}
        self.samples: list[tuple[int, Counter]] = []  # (trainer rows written, CPU seconds by role)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "CpuMeter":
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                rows = self.rows_path.read_bytes().count(b"\n")
            except OSError:
                rows = 0
            self.samples.append((rows, self._cpu()))

    def _cpu(self) -> Counter:
        children: dict[int, list[int]] = {}
        stats: dict[int, list[str]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats[int(entry)] = fields
                children.setdefault(int(fields[1]), []).append(int(entry))
        cpu: Counter = Counter()
        todo = [self.root]
        while todo:
            pid = todo.pop()
            todo.extend(children.get(pid, []))
            if pid not in stats:
                continue
            if pid not in self.roles:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                self.roles[pid] = next((r for m, r in ROLES.items() if m in cmd), "other")
            cpu[self.roles[pid]] += (int(stats[pid][11]) + int(stats[pid][12])) / self.tick
        return cpu

    def loop_cpu(self, first_row: int, last_row: int) -> dict[str, float]:
        """CPU seconds by role between the first samples that saw `first_row` and `last_row` trainer rows."""
        start = next((c for n, c in self.samples if n >= first_row), None)
        end = next((c for n, c in self.samples if n >= last_row), None)
        if start is None or end is None:
            return {}
        return {role: round(end[role] - start.get(role, 0.0), 3) for role in end}


def run(out: Path, steps: int, mode: str, args: list[str], tail: int) -> dict:
    argv = [
        sys.executable,
        "-m",
        "arbor.launch.rl",
        "--output-dir",
        str(out),
        "--max-steps",
        str(steps),
        *BASE,
        "--orchestrator.scheduler.mode",
        mode,
        *args,
    ]
    shutil.rmtree(out, ignore_errors=True)  # a kept directory from an earlier invocation
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with CpuMeter(proc.pid, trainer_metrics_path(out)) as meter:
        _, stderr = proc.communicate(timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{stderr[-3000:]}")
    rows = read_jsonl(out / "metrics.jsonl")
    # The first step's wait holds the other processes' start-up: the loop is timed from its end.
    later = rows[1:] or rows
    # The CPU of the same loop: from the trainer's first row (step 0 done) to its last.
    cpu = meter.loop_cpu(1, len(rows))
    return {
        "wall_s": wall,
        "loop_s": sum(r["time/step"] for r in rows[1:]),
        "steps": len(rows),
        "cpu_s": round(sum(cpu.values()), 3),
        "cpu_trainer_s": cpu.get("trainer", 0.0),
        "cpu_inference_s": cpu.get("inference", 0.0),
        "cpu_orchestrator_s": cpu.get("orchestrator", 0.0),
        "samples": len(rows) * BATCH,
        "reward": statistics.fmean(r["reward/mean"] for r in rows[-tail:]),
        "staleness_max": max(r["staleness/max"] for r in rows),
        "train_s": statistics.median(r["time/compute"] + r["time/publish"] for r in later),
        "generate_s": statistics.median(r["time/generate"] for r in later),
        "trainer_wait_frac": statistics.fmean(r["time/wait_ratio"] for r in later),
        "weights_wait_s": statistics.median(r["time/wait_weights"] for r in later),
    }


def env_table(text: str, **changes: float) -> str:
    """The environment's args (a TOML inline table) with `changes` applied, as an inline table again."""
    args = {**tomllib.loads(f"args = {text}")["args"], **changes}
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in args.items()) + " }"


def calibrate(root: Path, a: argparse.Namespace) -> float:
    """The environment's `median_s` at which a sync step's generation takes about as long as its training. Two
    short sync runs, with no environment latency and at the given median_s, fit generation time per step as
    `fixed + slope * median_s` (the fleet's own work, then the environment's waits); the median_s that makes it
    equal the training time is chosen (0 when generation alone already takes longer)."""
    median = float(tomllib.loads(f"args = {a.env_args}")["args"].get("median_s", 0.2))
    measured = []
    for m in (0.0, median):
        args = argparse.Namespace(**{**vars(a), "env_args": env_table(a.env_args, median_s=m)})
        res = run(root / f"calibration_{m:g}", a.calibration_steps, "sync", shared_args(args) + arm_args("sync", a), 1)
        measured.append(res)
        print(
            f"calibration (sync, {a.calibration_steps} steps, median_s {m:g}): training {res['train_s']:.3f}s, "
            f"generation {res['generate_s']:.3f}s per step",
            flush=True,
        )
    train = statistics.fmean(r["train_s"] for r in measured)
    fixed, slope = measured[0]["generate_s"], (measured[1]["generate_s"] - measured[0]["generate_s"]) / median
    chosen = max(0.0, (train - fixed) / slope) if slope > 0 else median
    print(
        f"calibration: generation = {fixed:.3f}s + {slope:.2f} x median_s, training {train:.3f}s per step -> "
        f"median_s {chosen:.4f}",
        flush=True,
    )
    if chosen <= 0:
        return chosen
    # Generation is not linear in median_s (stragglers, partial rollouts): check runs at the chosen value, each
    # interpolating between the measured points that bracket the training time, until generation is within
    # `--balance` of training.
    points = [(0.0, fixed), (median, measured[1]["generate_s"])]
    for i in range(a.calibration_checks):
        args = argparse.Namespace(**{**vars(a), "env_args": env_table(a.env_args, median_s=chosen)})
        res = run(
            root / f"calibration_check{i}", a.calibration_steps, "sync", shared_args(args) + arm_args("sync", a), 1
        )
        gen, train = res["generate_s"], res["train_s"]
        print(
            f"calibration check at median_s {chosen:.4f}: training {train:.3f}s, generation {gen:.3f}s per step",
            flush=True,
        )
        if abs(gen / train - 1) <= a.balance:
            break
        points.append((chosen, gen))
        chosen = interpolate(points, train)
        if chosen is None:  # noise swamped the latency's effect: keep the last value
            chosen = points[-1][0]
            break
    print(f"calibration: median_s {chosen:.4f}", flush=True)
    return chosen


def interpolate(points: list[tuple[float, float]], target: float) -> float | None:
    """The median_s at which generation time meets `target`, linearly between the two measured (median_s,
    generation) points that bracket it (the nearest below and above), else along the two nearest to it."""
    below = [p for p in points if p[1] <= target]
    above = [p for p in points if p[1] > target]
    if below and above:
        (m0, g0), (m1, g1) = max(below, key=lambda p: p[1]), min(above, key=lambda p: p[1])
    else:
        (m0, g0), (m1, g1) = sorted(sorted(points, key=lambda p: abs(p[1] - target))[:2])
    if m1 == m0 or (g1 - g0) / (m1 - m0) <= 0:
        return None
    return max(0.0, m0 + (target - g0) * (m1 - m0) / (g1 - g0))


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-test", help="model preset of both arms")
    p.add_argument("--seq-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per sample (sampling.max_tokens)")
    p.add_argument("--steps", type=int, default=20, help="enough for a few stragglers per arm: 8 steps is noisy")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="pairs of runs (sync and async, order alternating); the median paired ratio is reported",
    )
    p.add_argument("--tail", type=int, default=5, help="steps at the end whose mean reward is each arm's reward")
    p.add_argument("--async-mode", default="greedy", choices=["async", "greedy", "windowed_fifo", "one_step_off"])
    p.add_argument("--max-off-policy", type=int, default=2, help="staleness bound, the same for both arms")
    p.add_argument("--oversample", type=float, default=2.0, help="groups in flight / groups per step, both arms")
    p.add_argument(
        "--env-args",
        default="{ min_len = 2, max_len = 6, num_tasks = 200, median_s = 0.15, "
        "sigma = 0.8, straggler_p = 0.03, straggler_x = 20.0, compute_p = 0.2 }",
    )
    p.add_argument(
        "--median-s",
        type=float,
        default=None,
        help="the environment's latency scale for both arms; default: calibrated (module docstring)",
    )
    p.add_argument("--calibration-steps", type=int, default=6, help="steps of the sync calibration run")
    p.add_argument("--calibration-checks", type=int, default=3, help="most check runs refining the latency scale")
    p.add_argument(
        "--balance",
        type=float,
        default=0.1,
        help="calibration stops once generation is within this fraction of training",
    )
    p.add_argument("--keep", default=None, help="write the runs here (kept) instead of a temporary directory")
    a = parse_args(p, steps=2, repeats=1, tail=1, median_s=0.01)
    arms: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.keep or tmp)
        median = a.median_s if a.median_s is not None else calibrate(root, a)
        a.env_args = env_table(a.env_args, median_s=round(median, 4))
        shared = shared_args(a)
        for i in range(a.repeats):
            # one pair per repeat, the arms' order alternating, so that a drift of the machine's speed hits both
            pair = (("sync", "sync"), ("async", a.async_mode))
            for arm, mode in pair if i % 2 == 0 else pair[::-1]:
                res = run(root / f"{arm}{i}", a.steps, mode, shared + arm_args(mode, a), a.tail)
                print(
                    f"{arm} #{i}: {res['loop_s']:.1f}s loop, {res['wall_s']:.1f}s wall, reward {res['reward']:.3f}; "
                    f"per step training {res['train_s']:.3f}s, generation {res['generate_s']:.3f}s, trainer "
                    f"waiting {res['trainer_wait_frac']:.0%}, orchestrator waiting for weights "
                    f"{res['weights_wait_s']:.3f}s",
                    flush=True,
                )
                arms[arm].append(res)
    sync, asyn = median_of(arms["sync"]), median_of(arms["async"])
    # The median of the paired ratios: single 6-9 s loops on this shared VM vary by +-20% between repeats.
    ratio = statistics.median(s["loop_s"] / x["loop_s"] for s, x in zip(arms["sync"], arms["async"]))
    ceiling = cpu_ceiling(arms["sync"], arms["async"])
    gap = asyn["reward"] - sync["reward"]
    print(
        f"sync: {sync['loop_s']:.1f}s loop ({sync['wall_s']:.1f}s wall), reward {sync['reward']:.3f} | "
        f"{a.async_mode}: {asyn['loop_s']:.1f}s loop ({asyn['wall_s']:.1f}s wall), reward {asyn['reward']:.3f} | "
        f"median paired ratio {ratio:.2f}x, reward gap {gap:+.3f} over {sync['samples']:.0f} trained samples each",
        flush=True,
    )
    if ceiling is not None:
        print(
            f"CPU: sync {sync['cpu_s'] / sync['loop_s']:.2f} cores busy, {a.async_mode} "
            f"{asyn['cpu_s'] / asyn['loop_s']:.2f} of {CORES}; the async arm's own CPU work on {CORES} cores "
            f"allows at most {ceiling:.2f}x",
            flush=True,
        )
        if ceiling < TARGET:
            print(
                f"the {TARGET}x target is out of reach on these {CORES} cores whatever the schedule (ceiling "
                f"{ceiling:.2f}x); on 16 cores this benchmark measured 1.67x and 1.80x (see the docstring)",
                flush=True,
            )
    print(
        json.dumps(
            {
                "benchmark": "async_vs_sync",
                "value": round(ratio, 3),
                "target": TARGET,
                "ok": ratio >= TARGET and abs(gap) <= 0.02,
                "reward_gap": round(gap, 4),
                "reward_parity": abs(gap) <= 0.02,
                "cpu_ceiling": None if ceiling is None else round(ceiling, 3),
                "cores": CORES,
                "target_reachable_here": None if ceiling is None else ceiling >= TARGET,
                "wall_ratio_including_startup": round(sync["wall_s"] / asyn["wall_s"], 3),
                "async_mode": a.async_mode,
                "sync_wall_s": round(sync["loop_s"], 2),
                "async_wall_s": round(asyn["loop_s"], 2),
                "sync_reward": round(sync["reward"], 4),
                "async_reward": round(asyn["reward"], 4),
                "paired_ratios": [round(s["loop_s"] / x["loop_s"], 3) for s, x in zip(arms["sync"], arms["async"])],
                "sync": sync,
                "async": asyn,
                "steps": a.steps,
                "repeats": a.repeats,
                "env_args": a.env_args,
            }
        )
    )


TARGET = 1.6
"""The ratio to reach, with reward parity (issue: async within 0.02 of sync)."""
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_ceiling(sync: list[dict], asyn: list[dict]) -> float | None:
    """The largest ratio any schedule could reach on this machine given the async arm's measured work: its
    processes' CPU seconds over the loop, spread over every core, and never below its trainer's own (one
    process, the critical path). The median over the pairs; None without /proc figures."""
    bounds = [s["loop_s"] / max(x["cpu_s"] / CORES, x["cpu_trainer_s"]) for s, x in zip(sync, asyn) if x["cpu_s"] > 0]
    return statistics.median(bounds) if bounds else None


if __name__ == "__main__":
    main()
