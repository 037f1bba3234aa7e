"""`rl`'s terminal view and start order: the SFT warm-up's own progress lines, an ETA from the RL steps' own rate,
"waiting for" lines named from heartbeats, and the trainer and orchestrator started beside the fleet."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from arbor.config.rl import RLConfig
from arbor.environments.skewed_latency import SkewedLatencyEnv
from arbor.launch import children, rl
from arbor.launch import console as console_mod
from arbor.launch.console import Console, describe_waits
from arbor.run_dir import heartbeats_dir, metrics_path, process_metrics_path


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(console_mod.time, "monotonic", c.monotonic)
    return c


def append(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def test_eta_counts_only_the_rl_steps_own_rate(tmp_path: Path, clock: Clock, capsys) -> None:
    con = Console(tmp_path, max_steps=10, start=0)
    clock.now += 60.0  # start-up and warm-up: not RL time
    append(metrics_path(tmp_path), {"step": 0, "time/step": 2.0})
    con.poll()
    assert capsys.readouterr().out.strip().endswith("60s, eta 18s")  # the first step's own time x 9 left
    clock.now += 6.0
    append(metrics_path(tmp_path), {"step": 1, "time/step": 9.0})
    append(metrics_path(tmp_path), {"step": 2, "time/step": 9.0})
    con.poll()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].endswith("66s, eta 21s")  # 6 s for 2 steps since the first: 3 s x 7 left


def test_sft_warm_up_prints_its_own_progress_lines(tmp_path: Path, clock: Clock, capsys) -> None:
    con = Console(tmp_path, max_steps=60, start=0, sft_steps=60)
    beat_file(tmp_path, "sft", 10.0, "loading torch")
    con.waiting({"sft": 5.0}, "the warm-up's first figures")
    assert capsys.readouterr().out.startswith("waiting for the warm-up's first figures: sft (loading torch) |")
    path = process_metrics_path(tmp_path, "sft")
    append(path, {"step": 10, "sft/loss": 2.5, "sft/time": 5.0})
    append(path, {"step": 20, "sft/loss": 1.25, "sft/time": 10.0})
    con.poll_sft()
    append(path, {"sft/loss": 1.0, "sft/steps": 60})  # the final summary row has no step
    con.poll_sft()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert "SFT warm-up step   20/60 | loss 1.2500" in lines[1] and lines[1].endswith("eta 20s")


def beat_file(output_dir: Path, name: str, time: float, doing: str) -> None:
    heartbeats_dir(output_dir).mkdir(parents=True, exist_ok=True)
    (heartbeats_dir(output_dir) / name).write_text(json.dumps({"name": name, "time": time, "doing": doing}))


def test_waiting_names_what_each_process_does_from_this_launchs_heartbeats(tmp_path: Path, capsys) -> None:
    beat_file(tmp_path, "trainer_rank0", 50.0, "building the model")
    beat_file(tmp_path, "orchestrator", 10.0, "generating step 9")  # an earlier launch's: stale
    beat_file(tmp_path, "inference", 60.0, "serving policy version 0: 3 running, 0 waiting")
    started = {"inference": 40.0, "trainer": 40.0, "orchestrator": 40.0}
    assert describe_waits(tmp_path, started) == (
        "inference (serving policy version 0), trainer (building the model), orchestrator (starting)"
    )
    assert describe_waits(tmp_path, {"inference_1": 40.0}) == "inference_1 (serving policy version 0)"
    con = Console(tmp_path, max_steps=3, start=0)
    con.waiting(started)
    con.waiting(started)  # unchanged: no second line
    beat_file(tmp_path, "inference", 61.0, "serving policy version 0: 7 running, 1 waiting")
    con.waiting(started)  # only a live count changed: still no line
    assert capsys.readouterr().out.count("waiting for the first step:") == 1
    append(metrics_path(tmp_path), {"step": 0})
    con.poll()
    beat_file(tmp_path, "trainer_rank0", 70.0, "training step 1")
    con.waiting(started)  # after the first step nothing is waited for
    assert "waiting" not in capsys.readouterr().out


def test_trainer_and_orchestrator_start_beside_the_fleet(tmp_path: Path) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.started: list[str] = []

        def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
            self.started.append(name)

    cfg = rl.resolve(RLConfig(output_dir=tmp_path, model={"name": "qwen3-test"}))
    sup = Recorder()
    servers = children.start_processes(cfg, tmp_path / "configs", sup)  # returns before any /health answers
    assert sup.started == ["inference", "trainer", "orchestrator"]
    assert [list(group.urls) for group in servers] == [["inference"]]
    distill = rl.resolve(
        RLConfig.model_validate(
            {
                "output_dir": str(tmp_path / "d"),
                "model": {"name": "qwen3-test"},
                "trainer": {"loss": {"name": "distill"}},
                "teacher": {"model": {"name": "qwen3-tiny"}},
            }
        )
    )
    sup = Recorder()
    servers = children.start_processes(distill, tmp_path / "configs", sup)
    assert sup.started == ["inference", "teacher", "trainer", "orchestrator"]
    assert [list(group.urls) for group in servers] == [["inference"], ["teacher"]]


def test_skewed_latency_compute_share_is_cpu_work_with_reverse_text_rewards() -> None:
    waits = SkewedLatencyEnv(median_s=0.001, sigma=0.0, min_len=2, max_len=4, num_tasks=50)
    burns = SkewedLatencyEnv(median_s=0.001, sigma=0.0, compute_p=1.0, min_len=2, max_len=4, num_tasks=50)
    task = waits.dataset(0)[0]
    assert waits.cost(task, 0) == (pytest.approx(burns.cost(task, 0)[0]), False) and burns.cost(task, 0)[1]
    tasks = waits.dataset(0)[:20]
    share = sum(SkewedLatencyEnv(compute_p=0.3).cost(t, 1)[1] for t in tasks) / len(tasks)
    assert 0.0 < share < 1.0
    assert asyncio.run(burns.score(task, task["answer"])) == asyncio.run(waits.score(task, task["answer"]))
    with pytest.raises(ValueError, match="compute_p"):
        SkewedLatencyEnv(compute_p=1.5)


def test_skewed_latency_costs_follow_the_task_and_its_scorings_not_the_completion(monkeypatch) -> None:
    """Two runs that score the same tasks meet the same costs whatever their completions (common random
    numbers for benchmarks/async_vs_sync.py): the k-th scoring of a task draws the k-th cost."""
    waited: list[list[float]] = [[], []]
    for run, completion in enumerate(("policy one wrote this", "another policy, another text")):
        env = SkewedLatencyEnv(median_s=0.01, sigma=0.8, straggler_p=0.3, min_len=2, max_len=4, num_tasks=10)
        monkeypatch.setattr("arbor.environments.skewed_latency.asyncio.sleep", _recorder(waited[run]))
        for task in env.dataset(0)[:5]:
            for _ in range(4):  # a group of four samples
                asyncio.run(env.score(task, completion))
    assert waited[0] == waited[1] and len(set(waited[0])) > 10


def _recorder(out: list[float]):
    async def sleep(seconds: float) -> None:
        out.append(seconds)

    return sleep
