"""`fleet @ fleet.toml`: one base model's inference servers and the router in front of them, started once and
shared by any number of runs (`rl @ run.toml --fleet URL`), until it is stopped (Ctrl-C or SIGTERM: exit 0).

It starts `inference.replicas` servers on free ports and the router (`inference.router.host`/`port`; 0: a free
one) with `backend_slots` set, so that runs share the fleet by weight (arbor.inference.router.tenants); writes the
router's URL to `<output_dir>/url` once it answers; then, every `metrics_interval` seconds, appends the router's
fleet-wide and per-run figures (tokens, tokens/s, slot-seconds, utilisation) to `<output_dir>/fleet_usage.jsonl`,
which `arbor-report <output_dir>` turns into the fleet's $/Mtok and utilisation. A dead replica is restarted as
under `rl`; a dead router, or no replica left alive, stops the fleet (exit 1).

Admin token: when the router or a server binds beyond loopback and the config gives none, one is generated and
written to `<output_dir>/admin_token` (mode 0600): runs register with it (`ARBOR_FLEET_TOKEN`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

from tomli_w import dumps

from arbor import run_dir
from arbor.config.admin import ADMIN_TOKEN_ENV, is_loopback, new_admin_token
from arbor.config.fleet import FleetConfig
from arbor.config.loader import load_config, main_guard
from arbor.launch.children import child_env, replica_servers, router_argv, token_env
from arbor.launch.process import ChildFailed, Supervisor, Terminated, free_port, on_sigterm
from arbor.launch.supervise import check_children, record_timings, wait_healthy, wait_ready
from arbor.transport.router_wire import parse_router_metrics, parse_run_metrics


def resolve(cfg: FleetConfig) -> FleetConfig:
    """Ports of the replicas and the router, and the fleet's admin token."""
    inf, router = cfg.inference, cfg.inference.router
    host = "127.0.0.1" if inf.host in ("0.0.0.0", "::") else inf.host
    router.backends = [f"http://{host}:{free_port()}" for _ in range(inf.replicas)]
    inf.port = int(router.backends[0].rsplit(":", 1)[1])
    if router.port == 0:
        router.port = free_port()
    token = cfg.admin_token or inf.admin_token or router.admin_token
    if token is None and not (is_loopback(inf.host) and is_loopback(router.host)):
        token = new_admin_token()
        path = cfg.output_dir / "admin_token"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token.get_secret_value())
    cfg.admin_token = inf.admin_token = router.admin_token = token
    return cfg


def url_of(cfg: FleetConfig) -> str:
    router = cfg.inference.router
    host = "127.0.0.1" if router.host in ("0.0.0.0", "::") else router.host
    return f"http://{host}:{router.port}"


def write_configs(cfg: FleetConfig) -> Path:
    out = run_dir.configs_dir(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.toml").write_text(dumps(cfg.to_toml_dict()))
    (out / "inference.toml").write_text(dumps(cfg.inference.to_toml_dict()))
    (out / "router.toml").write_text(dumps(cfg.inference.router.to_toml_dict()))
    return out


def record_usage(cfg: FleetConfig, url: str) -> None:
    """Appends the router's fleet-wide and per-run figures to `fleet_usage.jsonl`."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    row = {"time": time.time(), "fleet": parse_router_metrics(text), "runs": parse_run_metrics(text)}
    with open(run_dir.fleet_usage_path(cfg.output_dir), "a") as f:
        f.write(json.dumps(row) + "\n")


def serve(cfg: FleetConfig, conf: Path, sup: Supervisor) -> None:
    """Starts the replicas and the router, then watches them until a signal or a fatal death."""
    fleet = replica_servers(cfg, conf, sup, routed=True)
    for name in fleet.argv:
        fleet.start(name)
    wait_ready(sup, [fleet], cfg.startup_timeout)
    sup.start("router", router_argv(cfg, conf), token_env(cfg, ADMIN_TOKEN_ENV))
    url = url_of(cfg)
    wait_healthy(sup, url, cfg.startup_timeout, "router", [fleet])
    run_dir.write_text_atomic(run_dir.fleet_url_path(cfg.output_dir), url + "\n")
    print(
        f"fleet: {cfg.model.name} on {len(fleet.argv)} replica(s) at {url}; runs join with "
        f"`rl @ run.toml --fleet {url}`; Ctrl-C stops it",
        flush=True,
    )
    next_row = time.monotonic()
    while True:
        check_children(sup, set(), may_finish=(), servers=[fleet])
        if time.monotonic() >= next_row:
            try:
                record_usage(cfg, url)
            except OSError as e:  # the router is busy or restarting: the next row catches up
                print(f"fleet: usage not recorded this time: {e}", file=sys.stderr, flush=True)
            next_row = time.monotonic() + cfg.metrics_interval
        time.sleep(0.2)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(FleetConfig, sys.argv[1:] if argv is None else argv, prog="fleet")
    cfg = resolve(cfg)
    conf = write_configs(cfg)
    signal.signal(signal.SIGTERM, on_sigterm)
    sup = Supervisor(run_dir.logs_dir(cfg.output_dir), child_env())
    print(f"arbor fleet: {cfg.output_dir} (logs in {run_dir.logs_dir(cfg.output_dir)})", flush=True)
    try:
        serve(cfg, conf, sup)
    except ChildFailed as e:
        print(f"fleet: error: {e}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, Terminated):
        print("fleet: stopping (the runs on it lose their generation server)", file=sys.stderr, flush=True)
        return 0
    finally:
        if sup.children.get("router") is not None and sup.children["router"].poll() is None:
            try:
                record_usage(cfg, url_of(cfg))  # the last row: what was used since the previous one
            except OSError as e:
                print(f"fleet: the last usage row was not recorded: {e}", file=sys.stderr, flush=True)
        sup.stop()
        record_timings(cfg.output_dir, sup)
        run_dir.fleet_url_path(cfg.output_dir).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
