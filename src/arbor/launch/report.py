"""`arbor-report OUT`: PNG plots and a markdown summary of a run, with a dollars-per-million-tokens figure.

Reads `OUT/metrics.jsonl` (one merged row per step), `OUT/timings.jsonl` (each process's wall-clock per launch,
written by `rl`) and the `[cost]` table of `OUT/configs/rl.toml`. Writes into `OUT/report/`: reward.png,
staleness.png, throughput.png, wait_ratio.png (trainer `time/wait / time/step`: near 1 the trainer starves and
generation is the bottleneck, near 0 the trainer is), mismatch.png (`mismatch_kl`, trainer vs inference
logprobs) and report.md (steps, wall time from the last row's `elapsed_s`, reward, staleness, throughput, cost,
and the measured throughput match, `throughput/trainer_wait_frac`, `throughput/generator_idle_frac` and
`throughput/queue_depth`, next to `rl plan`'s estimates for the run's config with its advice for the next run).

Cost = gpu_hour_usd x (inference GPUs x inference-pool hours + trainer GPUs x trainer-pool hours), where a pool's
hours are the measured wall-clock of its processes summed over launches (a resumed run counts every attempt: the
GPUs were paid for). Without timings.jsonl (a metrics file copied from elsewhere) the pools' hours fall back to
the sum of `time/step`, which leaves out start-up and is marked as such. A run on a shared fleet (`rl --fleet`)
pays for its share of the fleet instead: its seconds on it x its share of the slot-seconds spent meanwhile, on
`[cost] inference_gpus` (the fleet's GPUs), and the report shows that share and the fleet's utilisation.

`arbor-report FLEET_DIR` (a `fleet`'s output directory) writes the fleet's report instead: its $/Mtok generated,
its utilisation, and each run's share and $/Mtok (arbor.monitor.fleet_cost).

A command beside `rl`, not a part of arbor.monitor: it shows the planner's estimates (arbor.planner), which sit
above the metrics code the processes import.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from pydantic import ValidationError

from arbor.config.base import ConfigError
from arbor.config.loader import format_validation_error
from arbor.config.rl import RLConfig
from arbor.monitor.fleet_cost import fleet_cost, fleet_summary, is_fleet_dir, run_share
from arbor.monitor.metrics import read_jsonl
from arbor.planner import advice, plan
from arbor.run_dir import configs_dir, metrics_path, timings_path

PLOTS = {
    "reward": (("reward/mean", "mean"), ("reward/max", "max")),
    "staleness": (("staleness/mean", "mean (policy versions)"), ("staleness/max", "max")),
    "throughput": (("tokens/s", "trainer tokens/s"), ("rollouts/s", "rollouts/s (orchestrator)")),
    "wait_ratio": (("wait_ratio", "trainer time/wait / time/step"),),
    "mismatch": (("mismatch_kl", "mismatch_kl (trainer vs inference)"),),
}


def load_rows(out: Path) -> list[dict[str, Any]]:
    rows = read_jsonl(metrics_path(out))
    if not rows:
        raise SystemExit(f"arbor-report: error: {metrics_path(out)} is missing or empty")
    for r in rows:
        if r.get("time/step"):
            r["wait_ratio"] = r.get("time/wait", 0.0) / r["time/step"]
    return rows


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    paths = []
    for name, series in PLOTS.items():
        fig = Figure(figsize=(6.4, 3.6), dpi=100)  # no pyplot: no GUI backend, none needed on a cluster node
        ax = fig.subplots()
        drawn = False
        for key, label in series:
            pts = [
                (r["step"] + 1, r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3, label=label)
                drawn = True
        if name == "reward" and any("reward/std" in r for r in rows):
            xs = [r["step"] + 1 for r in rows if "reward/std" in r]
            mean = [r["reward/mean"] for r in rows if "reward/std" in r]
            std = [r["reward/std"] for r in rows if "reward/std" in r]
            ax.fill_between(
                xs,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                alpha=0.2,
                label="mean ± std",
            )
        if name == "mismatch" and drawn and all(r.get("mismatch_kl", 0) > 0 for r in rows if "mismatch_kl" in r):
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name.replace("_", " "))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        paths.append(path)
    return paths


def pool_hours(out: Path, rows: list[dict[str, Any]]) -> tuple[float, float, bool]:
    """(inference hours, trainer hours, measured): from timings.jsonl, else the sum of time/step."""
    timings = read_jsonl(timings_path(out))
    if timings:
        inf = sum(t["seconds"].get("inference", 0.0) for t in timings)
        tr = sum(t["seconds"].get("trainer", 0.0) + t["seconds"].get("sft", 0.0) for t in timings)
        return inf / 3600, tr / 3600, True
    steps = sum(r.get("time/step", 0.0) for r in rows) / 3600
    return steps, steps, False


def run_config(out: Path) -> dict[str, Any]:
    path = configs_dir(out) / "rl.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


def cost(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any] | None:
    conf = run_config(out)
    table = conf.get("cost", {})
    price = args.gpu_hour_usd if args.gpu_hour_usd is not None else table.get("gpu_hour_usd", 0.0)
    if not price:
        return None
    slurm = conf.get("slurm") or {}
    nproc = conf.get("trainer", {}).get("parallel", {}).get("nproc", 1)
    inf_gpus = (
        args.inference_gpus
        if args.inference_gpus is not None
        else table.get("inference_gpus", slurm.get("inference_nodes", 0) * slurm.get("gpus_per_node", 0) or 1)
    )
    tr_gpus = (
        args.trainer_gpus
        if args.trainer_gpus is not None
        else table.get("trainer_gpus", nproc * (slurm.get("trainer_nodes", 1) if slurm.get("inference_nodes") else 1))
    )
    inf_h, tr_h, measured = pool_hours(out, rows)
    shared = run_share(out)
    if shared is not None:  # no inference process of its own: its share of the fleet's hours
        inf_h = shared["hours"]
    usd = price * (inf_gpus * inf_h + tr_gpus * tr_h)
    trained = sum(r.get("num_tokens", 0.0) for r in rows)
    batch = conf.get("orchestrator", {}).get("batch_size")
    generated = sum(r.get("completion_len/mean", 0.0) * batch for r in rows) if batch else 0.0
    if shared is not None:
        generated = shared["completion_tokens"]  # counted by the fleet's router
    return {
        "fleet": shared,
        "usd": usd,
        "gpu_hour_usd": price,
        "inference_gpus": inf_gpus,
        "trainer_gpus": tr_gpus,
        "inference_hours": inf_h,
        "trainer_hours": tr_h,
        "measured": measured,
        "trained_tokens": trained,
        "generated_tokens": generated,
        "usd_per_m_trained": usd / (trained / 1e6) if trained else None,
        "usd_per_m_generated": usd / (generated / 1e6) if generated else None,
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "n/a" if v is None else format(v, spec)


MEASURED = {
    "throughput/trainer_wait_frac": ("trainer wait", "trainer_wait"),
    "throughput/generator_idle_frac": ("generator idle", "generator_idle"),
    "throughput/queue_depth": ("queue depth", None),
}
"""Run-time figures of the throughput match (metrics.jsonl keys) -> (label, the planner's matching estimate)."""


def planner_lines(out: Path, rows: list[dict[str, Any]]) -> list[str]:
    """The measured throughput-match figures next to `rl plan`'s estimates for the run's config, and its advice."""
    try:
        p = plan(RLConfig.model_validate(run_config(out)))
    except ValidationError as e:  # a config written by another arbor version
        p, why = None, format_validation_error(e)
    except ConfigError as e:  # no [hardware] layer
        p, why = None, str(e)
    lines = []
    for key, (label, estimate) in MEASURED.items():
        mean = _mean(rows, key)
        measured = f"{_fmt(mean, '.2f')} measured (mean)" if mean is not None else f"not recorded (no `{key}`)"
        planned = (
            f", planner {_fmt(p['now'][estimate], '.2f')}"
            if p is not None and p["now"] is not None and estimate is not None
            else ""
        )
        lines.append(f"- {label}: {measured}{planned}")
    lines.append(f"- planner advice for the next run: {advice(p)}" if p is not None else f"- planner: n/a ({why})")
    return lines


def summary(out: Path, rows: list[dict[str, Any]], c: dict[str, Any] | None) -> str:
    first, last = rows[0], rows[-1]
    wait = _mean(rows, "wait_ratio")
    verdict = (
        "n/a"
        if wait is None
        else "generation-bound: the trainer waits for rollouts most of the time"
        if wait > 0.5
        else "trainer-bound: rollouts are ready before the trainer asks"
        if wait < 0.1
        else "balanced"
    )
    lines = [
        f"# arbor run report: {out}",
        "",
        f"- steps: {len(rows)} (last step {last['step'] + 1})",
        f"- wall time: {_fmt(last['elapsed_s'] / 60 if 'elapsed_s' in last else None, '.1f')} min "
        f"(`elapsed_s` of the last step: the RL processes' time, resumes included, downtime not)",
        f"- reward/mean: first {_fmt(first.get('reward/mean'))}, last {_fmt(last.get('reward/mean'))}, "
        f"best {_fmt(max(r.get('reward/mean', -math.inf) for r in rows))}",
        f"- staleness/max: mean {_fmt(_mean(rows, 'staleness/max'))}; dropped as stale: "
        f"{sum(r.get('dropped/stale', 0) for r in rows)}",
        f"- throughput: trainer {_fmt(_mean(rows, 'tokens/s'), '.0f')} tokens/s, orchestrator "
        f"{_fmt(_mean(rows, 'rollouts/s'), '.1f')} rollouts/s (means)",
        f"- trainer wait ratio (time/wait / time/step): {_fmt(wait, '.2f')}, {verdict}",
        f"- mismatch_kl: mean {_fmt(_mean(rows, 'mismatch_kl'), '.2e')}, max "
        f"{_fmt(max(r.get('mismatch_kl', 0) for r in rows), '.2e')}",
    ]
    if c is None:
        lines.append(
            "- cost: set `[cost] gpu_hour_usd` (or pass --gpu-hour-usd) for a dollars-per-million-tokens figure"
        )
    else:
        how = "measured wall-clock" if c["measured"] else "sum of time/step (no timings.jsonl: start-up not counted)"
        lines += [
            f"- cost: ${c['usd']:.4f} = ${c['gpu_hour_usd']}/GPU-hour x ({c['inference_gpus']} inference GPU(s) x "
            f"{c['inference_hours']:.4f} h + {c['trainer_gpus']} trainer GPU(s) x {c['trainer_hours']:.4f} h; {how})",
            f"- ${_fmt(c['usd_per_m_trained'], '.4g')} per million trained tokens ({c['trained_tokens']:.0f} tokens), "
            f"${_fmt(c['usd_per_m_generated'], '.4g')} per million generated tokens ({c['generated_tokens']:.0f})",
        ]
        if c["fleet"] is not None:
            f = c["fleet"]
            util = "n/a" if f["fleet_utilisation"] is None else f"{100 * f['fleet_utilisation']:.1f}%"
            lines.append(
                f"- on the shared fleet {f['fleet']}: {f['seconds'] / 3600:.4f} h, {100 * f['share']:.1f}% of "
                f"the slot-seconds spent meanwhile (the inference hours above); fleet utilisation {util}"
            )
    lines += planner_lines(out, rows)
    lines += ["", *(f"![{name}]({name}.png)" for name in PLOTS), ""]
    return "\n".join(lines)


def fleet_main(out: Path, args: argparse.Namespace) -> int:
    """The report of a fleet's directory."""
    c = fleet_cost(out, args.gpu_hour_usd, args.inference_gpus)
    report_dir = out / "report"
    report_dir.mkdir(exist_ok=True)
    (report_dir / "report.md").write_text(fleet_summary(out, c))
    (report_dir / "cost.json").write_text(json.dumps(c, indent=1))
    print(f"report: {report_dir / 'report.md'}")
    per_m = c["usd_per_m_generated"]
    util = c["utilisation"]
    print(
        f"fleet: {'n/a' if per_m is None else f'${per_m:.4g}'} per million generated tokens, utilisation "
        f"{'n/a' if util is None else f'{100 * util:.1f}%'}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="arbor-report", description=__doc__.split("\n")[0])
    p.add_argument("output_dir", type=Path, help="the run directory (holds metrics.jsonl)")
    p.add_argument(
        "--gpu-hour-usd", type=float, help="GPU-hour price; default: [cost] gpu_hour_usd of the run's config"
    )
    p.add_argument("--inference-gpus", type=int, help="GPUs of the inference pool; default: from the run's config")
    p.add_argument("--trainer-gpus", type=int, help="GPUs of the trainer pool; default: from the run's config")
    args = p.parse_args(argv)
    out = args.output_dir
    if is_fleet_dir(out):
        return fleet_main(out, args)
    rows = load_rows(out)
    report_dir = out / "report"
    report_dir.mkdir(exist_ok=True)
    plot(rows, report_dir)
    c = cost(out, rows, args)
    (report_dir / "report.md").write_text(summary(out, rows, c))
    if c is not None:
        (report_dir / "cost.json").write_text(json.dumps(c, indent=1))
    print(f"report: {report_dir / 'report.md'} ({len(PLOTS)} plots)")
    if c is not None:
        print(f"cost: ${_fmt(c['usd_per_m_trained'], '.4g')} per million trained tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
