"""Scheduler simulation: sync, async (strict FIFO), greedy and windowed FIFO on the same heavy-tailed rollouts.

A pure discrete-event simulation (no model, no server) that drives arbor's own `RolloutQueue`, the component the
orchestrator uses, so what is measured is the real window rule. Tasks come from a dataset of easy / normal /
hard tasks; a rollout's latency is lognormal with a larger median for harder tasks, and a rare straggler takes
50x as long. The generator keeps up to `concurrency` rollouts in flight, and, as the orchestrator's loop does,
launches only rollouts that the staleness bound will still admit when their step comes. The trainer takes
`batch` rollouts per step and trains for `train_time` per step, overlapped with generation in the asynchronous
modes; a rollout whose launch policy is more than `max_off_policy` steps older than the step taking it is
dropped (wasted), as `max_off_policy_steps` does. `sync` launches one batch, waits for all of it, trains, and
only then launches the next (on-policy, idle while training).

Why greedy skews the mix: slow (hard) rollouts finish after more trainer steps have passed, so they are the ones
dropped as stale, and each batch fills with whatever finished first. Windowed FIFO blocks at a straggling head
instead: the trainer waits, the policy version stands still, and the straggler is trained, not dropped.

Printed per mode: throughput relative to sync (steps per unit time), max and mean staleness (trainer steps
between the policy that launched a rollout and the step that trains on it), and the batch difficulty-mix shift:
the total-variation distance between the difficulty mix of everything trained and the dataset's mix
(`batch_tv_mean`, the mean per-batch distance, also includes the sampling noise of a 64-rollout batch).
Target: windowed FIFO keeps >= 80% of greedy's throughput with <= 1/3 of greedy's mix shift.

Partial rollouts are on for the modes with a head that can block (async = strict FIFO, windowed FIFO), with the
orchestrator's exact rule (arbor.orchestrator.main, `[orchestrator.partial]`): while a step is being collected,
a rollout inside the window [H, H+W) that has run longer than `straggler_factor` times the median duration of
the last 32 finished rollouts (none before 8 have finished) is aborted, leaves its position (so the head
advances) and is relaunched at the queue's tail with its tokens kept; one already relaunched `max_resumes` times
stays where it is; one whose oldest token is already too stale for the step being collected is dropped
instead. Staleness counts from a rollout's first launch (its oldest token: the trainer's per-token bound).
Without partial rollouts a 50x straggler at the head stalls a window for its whole latency (the
`windowed_no_partial` row shows that cost). Greedy never blocks and gets none. (An earlier version of this
simulation counted a relaunched rollout's staleness from its relaunch, which the orchestrator cannot do with
its per-token bound; with the honest count the windowed-FIFO target is not met at these parameters.)

    uv run python benchmarks/scheduler_sim.py [--steps 300] [--batch 64] [--concurrency 128] [--window 64]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random

import numpy as np

from arbor.orchestrator.scheduler import RolloutQueue

DIFFICULTIES = ("easy", "normal", "hard")
MIN_FINISHED, RECENT = 8, 32  # the orchestrator's straggler rule: arbor.orchestrator.main.STRAGGLER_*


def sample_task(rng: random.Random, mix: list[float], a: argparse.Namespace) -> tuple[int, float]:
    d = rng.choices(range(3), weights=mix)[0]
    return d, task_latency(rng, d, a)


def task_latency(rng: random.Random, d: int, a: argparse.Namespace) -> float:
    latency = rng.lognormvariate(a.mu[d], a.sigma)
    if rng.random() < a.straggler_p:
        latency *= 50.0
    return latency


def total_variation(counts: np.ndarray, mix: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - mix).sum())


def simulate(mode: str, a: argparse.Namespace, partial: bool = True) -> dict:
    rng = random.Random(a.seed)
    mix = np.array(a.mix) / sum(a.mix)
    train_done: list[float] = []  # finish time of each trainer step
    stale: list[int] = []
    shifts: list[float] = []
    trained = np.zeros(3)

    def version_at(t: float) -> int:
        return bisect.bisect_right(train_done, t)  # train_done is increasing

    def train(batch_items: list[tuple[int, int]], ready_at: float) -> None:
        step = len(train_done)
        start = max(ready_at, train_done[-1] if train_done else 0.0)
        train_done.append(start + a.train_time)
        counts = np.bincount([d for d, _ in batch_items], minlength=3).astype(float)
        shifts.append(total_variation(counts, mix))
        trained[:] += counts
        stale.extend(step - v for _, v in batch_items)

    if mode == "sync":
        t = 0.0
        for step in range(a.steps):
            items = [sample_task(rng, mix, a) for _ in range(a.batch)]
            t += max(lat for _, lat in items)  # all in parallel (concurrency >= batch), wait for the slowest
            train([(d, step) for d, _ in items], t)
            t = train_done[-1]  # generation idles while the trainer trains
        return {**_summary(mode, train_done, stale, shifts, trained, mix), "dropped_frac": 0.0, "partial_rollouts": 0}

    window = {"async": 1, "greedy": None, "windowed_fifo": a.window}[mode]
    q: RolloutQueue[tuple[int, int]] = RolloutQueue(window)
    events: list[tuple[float, int, int, int]] = []  # (finish time, position, difficulty, launch version)
    # position -> (finish, since: launch or relaunch time, first launch time, difficulty, launch version, resumes)
    running: dict[int, tuple[float, float, float, int, int, int]] = {}
    moved: set[int] = set()  # positions whose rollout was aborted and re-queued (stale heap entries)
    durations: list[float] = []  # whole durations (first launch to finish) of finished rollouts
    dropped = partials = 0

    def threshold() -> float:
        if len(durations) < MIN_FINISHED:
            return float("inf")
        return a.straggler_factor * float(np.median(durations[-RECENT:]))

    def requeue_stragglers(now: float) -> None:
        """The orchestrator's straggler rule (module docstring): abort, leave the position, relaunch at the tail;
        the rollout still finishes when its remaining tokens are done."""
        nonlocal partials, dropped
        limit, limit_t = q.head + (q.window or 0), threshold()
        for pos in [p for p in running if p < limit]:
            finish, since, first, d, v, resumes = running[pos]
            if resumes >= a.max_resumes or now - since <= limit_t:
                continue
            del running[pos]
            moved.add(pos)
            q.discard(pos)
            if len(train_done) - v > a.max_off_policy:  # its oldest token can never be trained: cancelled
                dropped += 1
                continue
            new = q.launch()
            running[new] = (finish, now, first, d, v, resumes + 1)
            heapq.heappush(events, (finish, new, d, v))
            partials += 1

    def fill(now: float) -> None:
        # Launch only what can still be trained within the staleness bound: the outstanding rollouts fill the
        # rest of the batch being filled and then the next ones, and the newest of them must be at most max_off_policy steps ahead of
        # the current policy (AReaL's admission rule; the orchestrator's loop uses the same).
        v = version_at(now)
        while q.in_flight < a.concurrency and (
                len(train_done) + (len(batch) + q.outstanding) // a.batch - v <= a.max_off_policy):
            d, lat = sample_task(rng, mix, a)
            pos = q.launch()
            running[pos] = (now + lat, now, now, d, version_at(now), 0)
            heapq.heappush(events, (now + lat, pos, d, version_at(now)))

    def gate() -> float:
        """When the step being filled may be taken: its policy lag is one step (one_step_off), so step N waits
        until the trainer has finished step N - 2 (the orchestrator's `weights.ensure(N - 1)`)."""
        n = len(train_done) - 2
        return train_done[n] if n >= 0 else 0.0

    batch: list[tuple[int, int]] = []
    fill(0.0)
    t = 0.0
    while len(train_done) < a.steps:
        next_finish = events[0][0] if events else float("inf")
        if partial and q.window is not None and t >= gate():  # when a rollout in the window turns straggler
            limit, limit_t = q.head + q.window, threshold()
            due = [r[1] + limit_t for p, r in running.items()
                   if p < limit and r[5] < a.max_resumes and r[1] + limit_t > t]
            next_finish = min([next_finish, *due])
        later = [x for x in train_done if x > t]  # a finished trainer step may admit new launches
        if t < gate() <= next_finish:
            t = gate()  # nothing finishes before the trainer catches up: jump to that moment
        elif later and later[0] < next_finish:
            t = later[0]
        elif not events:
            raise RuntimeError(f"{mode}: stalled with nothing in flight")
        elif events and events[0][0] > next_finish:
            t = next_finish  # a straggler's abort is due
        else:
            t, pos, d, v = heapq.heappop(events)
            if pos in moved:
                moved.discard(pos)
                continue
            durations.append(t - running.pop(pos)[2])
            q.finish(pos, (d, v))
        if partial and q.window is not None and t >= gate():  # the loop checks while it collects a step
            requeue_stragglers(t)
        while t >= gate() and len(train_done) < a.steps:
            taken = q.take(a.batch - len(batch))
            if not taken:
                break
            for _, (d, v) in taken:
                if len(train_done) - v > a.max_off_policy:  # too stale for the step being filled: wasted
                    dropped += 1
                    continue
                batch.append((d, v))
            if len(batch) == a.batch:
                train(batch, t)
                batch = []
        fill(t)
    return {**_summary(mode, train_done, stale, shifts, trained, mix), "dropped_frac": dropped / (dropped + len(stale)),
            "partial_rollouts": partials}


def _summary(mode, train_done, stale, shifts, trained, mix) -> dict:
    return {
        "mix_shift_tv": total_variation(trained, mix),
        "batch_tv_mean": float(np.mean(shifts)),
        "mode": mode,
        "steps_per_time": len(train_done) / train_done[-1],
        "staleness_max": int(max(stale)),
        "staleness_mean": float(np.mean(stale)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="rollouts per trainer step")
    p.add_argument("--concurrency", type=int, default=128, help="rollouts in flight (async modes)")
    p.add_argument("--window", type=int, default=64, help="windowed FIFO's W")
    p.add_argument("--train-time", type=float, default=1.0, help="trainer time per step")
    p.add_argument("--mix", type=float, nargs=3, default=[0.5, 0.3, 0.2], help="dataset easy/normal/hard")
    p.add_argument("--mu", type=float, nargs=3, default=[0.0, 0.7, 1.4], help="log-median latency per difficulty")
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--straggler-p", type=float, default=0.01, help="chance of a 50x straggler")
    p.add_argument("--max-off-policy", type=int, default=2, help="drop rollouts staler than this many steps")
    p.add_argument("--straggler-factor", type=float, default=4.0,
                   help="partial rollouts: a window member running longer than this x the recent median is aborted")
    p.add_argument("--max-resumes", type=int, default=3, help="partial rollouts: relaunches per rollout at most")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    results = {m: simulate(m, a) for m in ("sync", "async", "greedy", "windowed_fifo")}
    results["windowed_no_partial"] = simulate("windowed_fifo", a, partial=False)
    base = results["sync"]["steps_per_time"]
    print(f"{'mode':<20}{'throughput/sync':>16}{'stale max':>11}{'stale mean':>12}{'mix shift (TV)':>16}{'dropped':>9}")
    for m, r in results.items():
        r["throughput_vs_sync"] = r["steps_per_time"] / base
        print(f"{m:<20}{r['throughput_vs_sync']:>16.2f}{r['staleness_max']:>11d}{r['staleness_mean']:>12.2f}"
              f"{r['mix_shift_tv']:>16.3f}{r['dropped_frac']:>9.3f}")
    g, w = results["greedy"], results["windowed_fifo"]
    throughput_ratio = w["steps_per_time"] / g["steps_per_time"]
    shift_ratio = w["mix_shift_tv"] / max(g["mix_shift_tv"], 1e-12)
    ok = throughput_ratio >= 0.8 and shift_ratio <= 1 / 3
    print(json.dumps({
        "benchmark": "scheduler_sim",
        "value": round(throughput_ratio, 4),
        "target": 0.8,
        "ok": ok,
        "windowed_vs_greedy_throughput": round(throughput_ratio, 4),
        "windowed_vs_greedy_mix_shift": round(shift_ratio, 4),
        "mix_shift_target": round(1 / 3, 4),
        **{f"{m}_{k}": round(v, 4) if isinstance(v, float) else v
           for m, r in results.items() for k, v in r.items() if k != "mode"},
        "params": {k: v for k, v in vars(a).items()},
    }))


if __name__ == "__main__":
    main()
