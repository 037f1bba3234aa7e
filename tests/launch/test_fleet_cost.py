"""arbor-report on a shared fleet: the fleet's $/Mtok and utilisation with each run's share, and a run's cost
as its share of the fleet it ran on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arbor.launch.report import main


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fleet_row(uptime: float, tokens: float, slot_s: float, runs: dict[str, tuple[float, float, float]]) -> dict:
    return {
        "time": uptime,
        "fleet": {
            "uptime_s": uptime,
            "completion_tokens": tokens,
            "slot_seconds": slot_s,
            "slots": 8.0,
            "utilisation": slot_s / (8 * uptime),
        },
        "runs": {
            name: {"completion_tokens": t, "slot_seconds": s, "seconds": age} for name, (t, s, age) in runs.items()
        },
    }


def test_fleet_report_prices_the_fleet_and_shares_it_between_runs_by_slot_seconds(tmp_path: Path) -> None:
    out = tmp_path / "fleet"
    (out / "configs").mkdir(parents=True)
    (out / "configs" / "fleet.toml").write_text("[cost]\ngpu_hour_usd = 3.6\n[inference]\nreplicas = 2\n")
    _jsonl(out / "timings.jsonl", [{"time": 0, "seconds": {"router": 3600.0, "inference_0": 3600.0}}])
    _jsonl(
        out / "fleet_usage.jsonl",
        [
            _fleet_row(10, 100, 40, {"": (0, 0, 10), "a": (100, 40, 9)}),
            # b registers later; a unregisters before the third row: its last figures still count.
            _fleet_row(20, 400, 160, {"": (0, 0, 20), "a": (300, 120, 19), "b": (100, 40, 5)}),
            # b unregisters and a run of the same name registers anew: both registrations count.
            _fleet_row(30, 500, 200, {"": (0, 0, 30), "b": (100, 40, 2)}),
        ],
    )
    assert main([str(out)]) == 0
    cost = json.loads((out / "report" / "cost.json").read_text())
    assert cost["usd"] == pytest.approx(3.6 * 2 * 1.0)  # 2 GPUs (one per replica) for the router's hour
    assert cost["usd_per_m_generated"] == pytest.approx(7.2 / 500e-6)
    assert cost["utilisation"] == pytest.approx(200 / (8 * 30))
    a, b = cost["runs"]["a"], cost["runs"]["b"]
    assert a["share"] == pytest.approx(0.6) and b["share"] == pytest.approx(0.4)
    assert a["usd_per_m"] == pytest.approx(7.2 * 0.6 / 300e-6)
    text = (out / "report" / "report.md").read_text()
    assert "utilisation" in text and "| a | 300 | 60.0% |" in text


@pytest.mark.slow
def test_a_run_on_a_fleet_pays_its_share_of_the_fleets_hours(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = [{"step": i, "reward/mean": 0.1 * i, "time/step": 1.0, "num_tokens": 1000.0} for i in range(4)]
    _jsonl(out / "metrics.jsonl", rows)
    (out / "configs").mkdir()
    (out / "configs" / "rl.toml").write_text("[cost]\ngpu_hour_usd = 2.0\ninference_gpus = 4\ntrainer_gpus = 1\n")
    _jsonl(out / "timings.jsonl", [{"time": 0, "seconds": {"trainer": 1800.0, "orchestrator": 1800.0}}])
    # Half an hour on a fleet busy 50% of the time, a quarter of those slot-seconds the run's own.
    _jsonl(
        out / "fleet_usage.jsonl",
        [
            {
                "time": 0,
                "fleet": "http://f",
                "run": "run",
                "seconds": 1800.0,
                "completion_tokens": 5000.0,
                "slot_seconds": 100.0,
                "fleet_completion_tokens": 20000.0,
                "fleet_slot_seconds": 400.0,
                "fleet_utilisation": 0.5,
            }
        ],
    )
    assert main([str(out)]) == 0
    cost = json.loads((out / "report" / "cost.json").read_text())
    assert cost["inference_hours"] == pytest.approx(0.5 * 0.25)
    assert cost["usd"] == pytest.approx(2.0 * (4 * 0.125 + 1 * 0.5))
    assert cost["usd_per_m_generated"] == pytest.approx(cost["usd"] / 5000e-6)
    text = (out / "report" / "report.md").read_text()
    assert "on the shared fleet http://f" in text and "25.0% of the slot-seconds" in text and "50.0%" in text
