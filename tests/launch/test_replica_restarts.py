"""The launcher's server restarts (arbor.launch.servers): a replica that dies after it was ready is restarted,
alone or behind the router, and so is the distillation teacher; one that never got ready, or keeps dying, is
not; the run fails only when none of a group is left alive; a frozen one is killed, then restarted. The processes
are stand-ins that exit, sleep or answer /health; the end-to-end run is in test_rl_e2e."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from arbor.config.loader import load_config
from arbor.config.rl import RLConfig
from arbor.launch import rl, servers, supervise
from arbor.launch.children import replica_servers, teacher_servers
from arbor.launch.process import ChildFailed, Supervisor
from arbor.launch.process import free_port as _free_port
from arbor.launch.rl import resolve
from arbor.launch.servers import Servers
from arbor.run_dir import configs_dir

pytestmark = pytest.mark.slow

DIE = [sys.executable, "-c", "import sys; sys.exit(3)"]
LIVE = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "RESTART_BACKOFF", 0.0)


def _fleet(tmp_path: Path, replicas: int = 1, restart: bool = True, **argv: list[str]) -> Servers:
    cfg = resolve(
        RLConfig.model_validate(
            {"output_dir": str(tmp_path / "run"), "inference": {"replicas": replicas, "restart_dead_replicas": restart}}
        )
    )
    fleet = replica_servers(cfg, configs_dir(cfg.output_dir), Supervisor(tmp_path / "logs", {}))
    fleet.argv = {name: argv.get(name, DIE) for name in fleet.argv}
    for name in fleet.argv:
        fleet.start(name)
    return fleet


def _died(fleet: Servers, name: str) -> None:
    """Waits for `name` to exit and tells the fleet, as the launcher's poll loop does."""
    rc = fleet.sup.children[name].proc.wait(timeout=30)
    fleet.on_death(name, rc, None)


def test_a_lone_replica_is_restarted_until_it_keeps_dying(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    try:
        fleet.ready.add("inference")
        first = fleet.sup.children["inference"]
        for restarts in range(1, servers.MAX_RESTARTS + 1):
            _died(fleet, "inference")
            assert len(fleet.restarts["inference"]) == restarts
        assert fleet.sup.children["inference"] is not first
        with pytest.raises(
            ChildFailed,
            match=r"inference exited with code 3 after 3 restarts within 600s "
            r"\(not restarted again\); see .*inference.log",
        ):
            _died(fleet, "inference")
    finally:
        fleet.sup.stop()


def test_a_replica_that_dies_before_it_was_ready_is_not_restarted(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    try:
        with pytest.raises(ChildFailed, match="inference exited with code 3 before it was ready"):
            _died(fleet, "inference")
        assert fleet.restarts["inference"] == []
    finally:
        fleet.sup.stop()


def test_without_restarts_a_lone_replicas_death_ends_the_run(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, restart=False)
    try:
        fleet.ready.add("inference")
        with pytest.raises(ChildFailed, match=r"^inference exited with code 3; see .*inference.log"):
            _died(fleet, "inference")
    finally:
        fleet.sup.stop()


def test_behind_a_router_the_others_serve_while_one_is_given_up_on(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, replicas=2, inference_1=LIVE)
    try:
        fleet.ready.update(fleet.argv)
        for _ in range(servers.MAX_RESTARTS + 2):  # restarted 3 times, then left dead: no failure, one still serves
            _died(fleet, "inference_0")
        assert len(fleet.restarts["inference_0"]) == servers.MAX_RESTARTS and fleet.reported == {"inference_0"}
        fleet.sup.children["inference_1"].signal_group(9)
        with pytest.raises(
            ChildFailed,
            match=r"all 2 inference replicas exited \(last: inference_1, code -9\) "
            r"before it was ready",
        ):
            fleet.ready.discard("inference_1")  # died during start-up, say: no restart, and no one left
            _died(fleet, "inference_1")
    finally:
        fleet.sup.stop()


def test_without_restarts_a_routed_fleet_continues_on_the_live_replicas(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, replicas=2, restart=False, inference_1=LIVE)
    try:
        fleet.ready.update(fleet.argv)
        _died(fleet, "inference_0")
        assert fleet.reported == {"inference_0"} and fleet.restarts["inference_0"] == []
    finally:
        fleet.sup.stop()


def test_the_distillation_teacher_is_restarted_like_a_lone_replica(tmp_path: Path) -> None:
    cfg = load_config(
        RLConfig,
        ["--output-dir", str(tmp_path / "run"), "--trainer.loss.name", "distill", "--teacher.model.name", "qwen3-tiny"],
        env={},
    )
    teacher = teacher_servers(resolve(cfg), configs_dir(cfg.output_dir), Supervisor(tmp_path / "logs", {}))
    assert teacher is not None and list(teacher.urls) == ["teacher"] and teacher.restart
    assert teacher.urls["teacher"] == str(cfg.orchestrator.teacher.url)
    assert teacher.argv["teacher"][-1].endswith("teacher.toml")
    teacher.argv["teacher"] = DIE
    teacher.start("teacher")
    try:
        teacher.ready.add("teacher")
        _died(teacher, "teacher")
        assert len(teacher.restarts["teacher"]) == 1
    finally:
        teacher.sup.stop()
    plain = load_config(RLConfig, ["--output-dir", str(tmp_path / "plain")], env={})
    assert teacher_servers(resolve(plain), configs_dir(plain.output_dir), Supervisor(tmp_path / "logs", {})) is None


def test_the_orchestrator_waits_for_a_restart_as_long_as_a_start_up_may_take(tmp_path: Path) -> None:
    slow = resolve(
        load_config(RLConfig, ["--output-dir", str(tmp_path / "a"), "--inference-startup-timeout", "1800"], env={})
    )
    assert slow.orchestrator.client.reconnect_timeout > 1800
    assert (
        resolve(
            load_config(RLConfig, ["--output-dir", str(tmp_path / "b")], env={})
        ).orchestrator.client.reconnect_timeout
        == 600
    )
    mine = resolve(
        load_config(
            RLConfig,
            [
                "--output-dir",
                str(tmp_path / "c"),
                "--inference-startup-timeout",
                "1800",
                "--orchestrator.client.reconnect-timeout",
                "30",
            ],
            env={},
        )
    )
    assert mine.orchestrator.client.reconnect_timeout == 30


def test_a_failed_run_resumes_by_itself_only_after_progress_and_within_max_restarts(
    tmp_path: Path, monkeypatch
) -> None:
    """arbor.launch.rl.run_attempts with a scripted `run`: each attempt prepares the run directory as `run` does,
    appends the steps it completed to metrics.jsonl with a checkpoint after each, and ends with its exit code."""

    def attempts(script: list[tuple[int, int]], max_restarts: int) -> tuple[int, list[bool]]:
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        cfg = load_config(RLConfig, ["--output-dir", str(out), "--max-restarts", str(max_restarts)], env={})
        resumed: list[bool] = []

        def run(cfg: RLConfig, note: str | None = None) -> int:
            resumed.append(cfg.resume and cfg.trainer.resume and cfg.orchestrator.resume)
            start = rl.prepare_run_dir(cfg)
            steps, rc = script[len(resumed) - 1]
            with open(out / "metrics.jsonl", "a") as f:
                for step in range(start, start + steps):
                    f.write(f'{{"step": {step}}}\n')
                    (out / "checkpoints" / f"step_{step + 1}" / "trainer").mkdir(parents=True)
                    (out / "checkpoints" / f"step_{step + 1}" / "trainer" / "DONE").write_text("")
            return rc

        monkeypatch.setattr(rl, "run", run)
        monkeypatch.setattr(rl, "write_configs", lambda cfg: None)
        return rl.run_attempts(cfg), resumed

    assert attempts([(3, 1), (2, 0)], 1) == (0, [False, True])  # died after 3 steps, resumed, finished
    assert attempts([(3, 3), (1, 1)], 1) == (1, [False, True])  # a stall, then out of restarts
    assert attempts([(0, 1)], 2) == (1, [False])  # died before a step: it would only repeat
    assert attempts([(3, 1), (0, 1)], 3) == (1, [False, True])  # the resumed attempt made no progress
    assert attempts([(3, 1)], 0) == (1, [False])  # restarts off (the default)
    assert attempts([(2, 130)], 2) == (130, [False]) and attempts([(2, 143)], 2) == (143, [False])


HEALTHY = [
    sys.executable,
    "-c",
    (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    ),
]
"""A stand-in server that answers GET /health with 200 on the port given."""


def test_a_frozen_server_is_killed_and_restarted_and_a_silent_restart_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ready server that stops answering /health (SIGSTOP: alive, silent) is killed after `liveness_timeout`
    and restarted on its port, then answers again; a restart that never answers is killed after the start-up
    limit, and after MAX_RESTARTS the group fails naming the server."""
    monkeypatch.setattr(servers, "PROBE_INTERVAL", 0.2)
    port = _free_port()
    sup = Supervisor(tmp_path / "logs", {})
    url = f"http://127.0.0.1:{port}"
    group = Servers(
        sup,
        {"inference": [*HEALTHY, str(port)]},
        {"inference": url},
        {},
        True,
        "inference replicas",
        liveness_timeout=1.5,
        startup_timeout=20.0,
    )
    try:
        group.start("inference")
        supervise.wait_ready(sup, [group], 30)
        first = sup.children["inference"]
        first.signal_group(signal.SIGSTOP)
        _poll_until(lambda: sup.children["inference"] is not first, sup, group, 30)
        assert first.proc.returncode == -signal.SIGKILL and len(group.restarts["inference"]) == 1
        _poll_until(lambda: group.last_ok["inference"] > group.last_start["inference"], sup, group, 30)
        group.argv["inference"] = LIVE  # lives, never answers: killed once the start-up limit passes
        group.startup_timeout = 1.0
        sup.children["inference"].signal_group(signal.SIGKILL)
        with pytest.raises(ChildFailed, match=r"inference exited with code -9 after 3 restarts within 600s"):
            _poll_until(lambda: False, sup, group, 60)
    finally:
        group.close()
        sup.stop()


def _poll_until(done, sup: Supervisor, group: Servers, timeout: float) -> None:
    """The launcher's poll loop (supervise.check_children: deaths, then liveness) until `done()`."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        supervise.check_children(sup, set(), servers=[group])
        time.sleep(0.05)
