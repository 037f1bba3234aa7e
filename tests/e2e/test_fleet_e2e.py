"""`rl` with two local inference replicas behind the built-in router: neither a killed replica nor a killed router
fails the run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import tomllib
import urllib.request

import pytest
from test_rl_e2e import _finish, _rl, _wait_for

from arbor.monitor.metrics import read_jsonl
from arbor.transport.router_wire import parse_router_metrics

pytestmark = pytest.mark.slow


def test_two_replicas_survive_a_killed_one_and_take_it_back_and_a_killed_router(tmp_path):
    out = tmp_path / "run"
    steps = 250  # long enough (~25 s even on an idle machine) for the restart and re-admission to happen mid-run
    proc = _rl(out, "--max-steps", str(steps), "--inference.replicas", "2", "--inference.router.eject-after", "3")
    _wait_for(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 2, 180, "two steps")
    backends = tomllib.loads((out / "configs" / "router.toml").read_text())["backends"]
    victim_port = backends[1].rsplit(":", 1)[1]
    lines = subprocess.run(["pgrep", "-af", f"arbor.inference.server @ {out}"], capture_output=True, text=True).stdout
    pids = [int(line.split()[0]) for line in lines.splitlines() if line.endswith(f"--port {victim_port}")]
    assert len(pids) == 1, lines
    router = tomllib.loads((out / "configs" / "orchestrator.toml").read_text())["client"]["base_urls"][0]
    # Kill it while the router has a request in flight on it, so that request must be retried elsewhere. A
    # reverse_text completion takes a few milliseconds, less than the time between seeing it in /metrics and a
    # kill: the replica is frozen once one is seen, and killed (which hangs up on it) only if one is still there.
    busy = f'arbor_router_outstanding{{backend="{backends[1]}"}} '

    def in_flight() -> bool:
        text = urllib.request.urlopen(router + "/metrics", timeout=5).read().decode()
        return any(line.startswith(busy) and float(line.split()[-1]) > 0 for line in text.splitlines())

    deadline = time.monotonic() + 120
    while True:
        _wait_for(in_flight, 120, "a request in flight on the second replica")
        os.kill(pids[0], signal.SIGSTOP)
        time.sleep(0.2)  # well within the router's ejection (3 failed health checks)
        if in_flight():
            break
        os.kill(pids[0], signal.SIGCONT)
        assert time.monotonic() < deadline, "no request stayed in flight on the frozen replica"
    os.kill(pids[0], signal.SIGKILL)
    seen: dict[str, float] = {}
    while proc.poll() is None and seen.get("readmissions", 0) < 1:  # the launcher restarts it; the router takes it back
        try:
            with urllib.request.urlopen(router + "/metrics", timeout=5) as r:
                seen = parse_router_metrics(r.read().decode())
        except OSError:
            pass
        time.sleep(0.5)
    # Then the router: the launcher restarts it on its port, and the orchestrator's requests wait for it.
    lines = subprocess.run(
        ["pgrep", "-af", f"arbor.inference.router.app @ {out}"], capture_output=True, text=True
    ).stdout
    routers = [int(line.split()[0]) for line in lines.splitlines()]
    assert proc.poll() is None and len(routers) == 1, lines
    before = len(read_jsonl(out / "metrics.jsonl"))
    os.kill(routers[0], signal.SIGKILL)
    rc, stdout, stderr = _finish(proc, timeout=400)
    assert rc == 0, stderr + stdout
    assert "inference_1 exited with code -9; restarting it" in stderr
    assert "router exited with code -9; restarting it" in stderr
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))
    assert before < steps, "the run ended before the router was killed"
    # The router's counters start again with it: the replica's ejection and retry are in the rows before.
    assert max(r["router/ejections"] for r in rows[:before]) >= 1
    assert max(r["router/retries"] for r in rows[:before]) >= 1
    assert seen.get("readmissions", 0) >= 1, f"the restarted replica never came back into rotation: {seen}"
    assert rows[-1]["client/reconnects"] >= 1 and rows[-1]["router/backends_in_rotation"] in (1, 2)
    assert rows[0]["router/ejections"] == 0 and rows[0]["router/retries"] == 0
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, "processes outlived the launcher"
