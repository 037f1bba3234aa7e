"""Cost figures of a shared fleet, for `arbor-report`: the fleet's own ($/Mtok generated, utilisation, and each
run's share) from a fleet directory, and a run's share of the fleet it ran on from the run's directory.

Sharing is priced by capacity used: a run pays the fleet's GPU-hours over its time on the fleet in proportion to
the slot-seconds its requests held (sequences in flight x seconds, arbor.inference.router.tenants) among everyone's
over the same span, so the fleet's idle time is shared out too, and a run that keeps a busy fleet company pays
for half of it rather than for all of an idle one.

- A fleet directory (`fleet @ fleet.toml`) holds `configs/fleet.toml` (its `[cost]`), `timings.jsonl` (the
  router's wall-clock per launch) and `fleet_usage.jsonl` (the router's cumulative figures every
  `metrics_interval`, per run while it is registered). Cost = gpu_hour_usd x GPUs (`cost.inference_gpus`,
  default one per replica) x hours up; each run's share of it is its slot-seconds over all slot-seconds.
- A run directory (`rl --fleet`) holds `fleet_usage.jsonl` rows of the run's own figures and the fleet's over
  the same span (arbor.launch.on_fleet); the run's inference hours are its seconds on the fleet x its share.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import configs_dir, fleet_usage_path, timings_path


def is_fleet_dir(out: Path) -> bool:
    return (configs_dir(out) / "fleet.toml").exists()


def _launches(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The usage rows split per launch of the fleet (the router's counters start again at each)."""
    out: list[list[dict[str, Any]]] = []
    last = None
    for row in rows:
        uptime = row.get("fleet", {}).get("uptime_s", 0.0)
        if last is None or uptime < last:
            out.append([])
        out[-1].append(row)
        last = uptime
    return out


def _registrations(launch: list[dict[str, Any]]) -> list[tuple[str, dict[str, float]]]:
    """Each registration's last figures in one launch's rows: a run's counters are cumulative while it is
    registered and start again when a run of that name registers anew (its `seconds` go down)."""
    out: list[tuple[str, dict[str, float]]] = []
    last: dict[str, dict[str, float]] = {}
    for row in launch:
        for name, figures in row.get("runs", {}).items():
            if name in last and figures.get("seconds", 0.0) < last[name].get("seconds", 0.0):
                out.append((name, last[name]))
            last[name] = figures
    return out + list(last.items())


def fleet_cost(out: Path, price: float | None, gpus: int | None) -> dict[str, Any]:
    """The fleet's cost, utilisation and $/Mtok, and each run's share (by slot-seconds) and $/Mtok."""
    conf = tomllib.loads((configs_dir(out) / "fleet.toml").read_text())
    table = conf.get("cost", {})
    price = price if price is not None else table.get("gpu_hour_usd", 0.0)
    gpus = gpus if gpus is not None else table.get("inference_gpus") or conf.get("inference", {}).get("replicas", 1)
    rows = read_jsonl(fleet_usage_path(out))
    if not rows:
        raise SystemExit(f"arbor-report: error: {fleet_usage_path(out)} is missing or empty: has the fleet run?")
    tokens = slot_seconds = capacity = uptime = 0.0
    runs: dict[str, dict[str, float]] = {}
    for launch in _launches(rows):
        fleet = launch[-1]["fleet"]
        tokens += fleet.get("completion_tokens", 0.0)
        slot_seconds += fleet.get("slot_seconds", 0.0)
        capacity += fleet.get("slots", 0.0) * fleet.get("uptime_s", 0.0)
        uptime += fleet.get("uptime_s", 0.0)
        for name, figures in _registrations(launch):
            mine = runs.setdefault(name or "(unregistered requests)", {"completion_tokens": 0.0, "slot_seconds": 0.0})
            mine["completion_tokens"] += figures.get("completion_tokens", 0.0)
            mine["slot_seconds"] += figures.get("slot_seconds", 0.0)
    timings = read_jsonl(timings_path(out))
    measured = sum(t["seconds"].get("router", 0.0) for t in timings)
    hours = (measured or uptime) / 3600
    usd = price * gpus * hours
    for mine in runs.values():
        share = mine["slot_seconds"] / slot_seconds if slot_seconds else 0.0
        mine.update(
            share=share,
            usd=usd * share,
            usd_per_m=usd * share / (mine["completion_tokens"] / 1e6) if mine["completion_tokens"] else None,
        )
    return {
        "usd": usd,
        "gpu_hour_usd": price,
        "gpus": gpus,
        "hours": hours,
        "generated_tokens": tokens,
        "utilisation": slot_seconds / capacity if capacity else None,
        "usd_per_m_generated": usd / (tokens / 1e6) if tokens and price else None,
        "runs": runs,
    }


def fleet_summary(out: Path, c: dict[str, Any]) -> str:
    util = "n/a (no backend_slots)" if c["utilisation"] is None else f"{100 * c['utilisation']:.1f}%"
    per_m = "n/a" if c["usd_per_m_generated"] is None else f"${c['usd_per_m_generated']:.4g}"
    lines = [
        f"# arbor fleet report: {out}",
        "",
        f"- up {c['hours']:.4f} h on {c['gpus']} GPU(s) at ${c['gpu_hour_usd']}/GPU-hour: ${c['usd']:.4f}",
        f"- utilisation (sequence slots in use over slots x time): {util}",
        f"- {per_m} per million generated tokens ({c['generated_tokens']:.0f} tokens)",
        "",
        "| run | generated tokens | share of slot-seconds | cost | $/Mtok generated |",
        "|---|---|---|---|---|",
    ]
    for name, r in sorted(c["runs"].items()):
        per = "n/a" if r["usd_per_m"] is None else f"${r['usd_per_m']:.4g}"
        lines.append(f"| {name} | {r['completion_tokens']:.0f} | {100 * r['share']:.1f}% | ${r['usd']:.4f} | {per} |")
    return "\n".join(lines) + "\n"


def run_share(out: Path) -> dict[str, Any] | None:
    """A run's use of a shared fleet (its `fleet_usage.jsonl`, summed over launches), or None for a run that had
    fleets of its own."""
    rows = [r for r in read_jsonl(fleet_usage_path(out)) if "run" in r]
    if not rows:
        return None
    seconds = sum(r["seconds"] for r in rows)
    # Each launch's seconds on the fleet, times the run's share of the slot-seconds spent meanwhile.
    shared = sum(
        r["seconds"] * (r["slot_seconds"] / r["fleet_slot_seconds"] if r["fleet_slot_seconds"] else 1.0) for r in rows
    )
    utils = [r["fleet_utilisation"] for r in rows if r.get("fleet_utilisation") is not None]
    return {
        "fleet": rows[-1]["fleet"],
        "seconds": seconds,
        "hours": shared / 3600,
        "share": shared / seconds if seconds else 0.0,
        "completion_tokens": sum(r["completion_tokens"] for r in rows),
        "fleet_utilisation": sum(utils) / len(utils) if utils else None,
    }
