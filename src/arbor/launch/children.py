"""What `rl` (and `fleet`) start: each child's command line and environment, the server groups, the start order.

The trainer, orchestrator, SFT warm-up, inference replicas, router and teacher are each one command line
(`python -m ...` on a config file `rl` wrote) and an environment (the admin token for the one child that reads
it, never in a config file). Inference servers come as `Servers` groups (arbor.launch.servers), which restart a
dead or frozen member. Apart from `rl`'s sequence so that `run` reads as its steps; light to import, as `rl`."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from arbor import run_dir
from arbor.config.admin import ADMIN_TOKEN_ENV, CLIENT_TOKEN_ENV, token_value
from arbor.config.fleet import FleetConfig
from arbor.config.rl import RLConfig
from arbor.launch.console import Console
from arbor.launch.on_fleet import Registration
from arbor.launch.process import Supervisor
from arbor.launch.servers import Servers
from arbor.launch.supervise import check_children, wait_offloaded, wait_ready
from arbor.transport.router_wire import use_vllm_router, vllm_router_argv


def child_env() -> dict[str, str]:
    # Configs are fully resolved into files; inherited ARBOR_ variables would apply a second time.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARBOR_")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def token_env(cfg: RLConfig | FleetConfig, variable: str) -> dict[str, str]:
    """The run's admin token as `variable` (set by `resolve`), for the one child that reads it; none: empty."""
    token = token_value(cfg.inference.admin_token)
    return {} if token is None else {variable: token}


def teacher_key_env(cfg: RLConfig) -> dict[str, str]:
    """The teacher's API key for the orchestrator (never written to its config): `ARBOR_TEACHER__API_KEY`."""
    key = None if cfg.orchestrator.teacher is None else token_value(cfg.orchestrator.teacher.api_key)
    return {} if key is None else {"ARBOR_TEACHER__API_KEY": key}


def trainer_argv(cfg: RLConfig, conf: Path) -> list[str]:
    n = cfg.trainer.parallel.nproc
    if n == 1:
        return [sys.executable, "-m", "arbor.trainer.main", "@", str(conf)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "-m",
        "arbor.trainer.main",
        "@",
        str(conf),
    ]


def replica_servers(cfg: RLConfig | FleetConfig, conf: Path, sup: Supervisor, routed: bool | None = None) -> Servers:
    """The inference replicas. One replica without a router is `inference`; behind a router (`routed`, default:
    more than one replica) they are `inference_<i>` on the router's backends. `cfg` is an `rl` or a `fleet`
    config."""
    base = [sys.executable, "-m", "arbor.inference.server", "@", str(conf / "inference.toml")]
    inf = cfg.inference
    if not (inf.replicas > 1 if routed is None else routed):
        assert isinstance(cfg, RLConfig)
        argv, urls = {"inference": base}, {"inference": cfg.orchestrator.client.base_urls[0]}
    else:
        argv = {
            f"inference_{i}": [*base, "--replica", str(i), "--port", url.rsplit(":", 1)[1]]
            for i, url in enumerate(inf.router.backends)
        }
        urls = dict(zip(argv, inf.router.backends))
    return Servers(
        sup,
        argv,
        urls,
        token_env(cfg, ADMIN_TOKEN_ENV),
        inf.restart_dead_replicas,
        "inference replicas",
        inf.liveness_timeout,
        startup_timeout(cfg),
        prog="rl" if isinstance(cfg, RLConfig) else "fleet",
    )


def startup_timeout(cfg: RLConfig | FleetConfig) -> float:
    """Seconds a server may take to answer /health, at the launch and after a restart."""
    return cfg.inference_startup_timeout if isinstance(cfg, RLConfig) else cfg.startup_timeout


def teacher_servers(cfg: RLConfig, conf: Path, sup: Supervisor) -> Servers | None:
    """On-policy distillation's teacher server, when the config has a `[teacher]` section to launch."""
    if cfg.teacher is None or cfg.orchestrator.teacher is None:
        return None
    token = token_value(cfg.teacher.admin_token)
    argv = {"teacher": [sys.executable, "-m", "arbor.inference.server", "@", str(conf / "teacher.toml")]}
    return Servers(
        sup,
        argv,
        {"teacher": str(cfg.orchestrator.teacher.url)},
        {} if token is None else {ADMIN_TOKEN_ENV: token},
        cfg.teacher.restart_dead_replicas,
        "teachers",
        cfg.teacher.liveness_timeout,
        cfg.inference_startup_timeout,
    )


def router_argv(cfg: RLConfig | FleetConfig, conf: Path) -> list[str]:
    exe = use_vllm_router(cfg.inference.router)
    if exe is not None:
        return vllm_router_argv(cfg.inference.router, cfg.inference.router.backends, cfg.inference.router.port, exe)
    return [sys.executable, "-m", "arbor.inference.router.app", "@", str(conf / "router.toml")]


def router_servers(cfg: RLConfig, conf: Path, sup: Supervisor) -> Servers:
    """The router in front of the replicas (more than one replica), a group of one restarted like them."""
    return Servers(
        sup,
        {"router": router_argv(cfg, conf)},
        {"router": cfg.orchestrator.client.base_urls[0]},
        token_env(cfg, ADMIN_TOKEN_ENV),
        cfg.inference.restart_dead_replicas,
        "routers",
        cfg.inference.liveness_timeout,
        cfg.inference_startup_timeout,
    )


def warm_up(cfg: RLConfig, conf: Path, sup: Supervisor, console: Console) -> None:
    """Runs the SFT warm-up to its end, with its own progress lines (and what it does before the first)."""
    console.say(f"SFT warm-up: {cfg.sft.steps} steps")
    child = sup.start("sft", [sys.executable, "-m", "arbor.trainer.sft", "@", str(conf / "sft.toml")])
    finished: set[str] = set()
    while "sft" not in finished:
        check_children(sup, finished)
        console.poll_sft()
        if console.sft_seen == 0:
            console.waiting({"sft": child.started}, "the warm-up's first figures")
        time.sleep(0.2)
    console.poll_sft()


def start_run(cfg: RLConfig, conf: Path, sup: Supervisor, env: dict[str, str], trainer: bool = True) -> Servers | None:
    """Starts the teacher server (on-policy distillation; returned), the trainer (unless started already:
    `trainer` False) and the orchestrator (the latter with `env`: the admin token it sends)."""
    teacher = teacher_servers(cfg, conf, sup)
    if teacher is not None:
        teacher.start("teacher")
    if trainer:
        sup.start("trainer", trainer_argv(cfg, conf / "trainer.toml"))
    orchestrator = [sys.executable, "-m", "arbor.orchestrator.main", "@", str(conf / "orchestrator.toml")]
    sup.start("orchestrator", orchestrator, {**env, **teacher_key_env(cfg)})
    return teacher


def start_processes(
    cfg: RLConfig, conf: Path, sup: Supervisor, on_wait: Callable[[], None] | None = None
) -> list[Servers]:
    """Starts the inference replicas, the teacher, the trainer and the orchestrator at once: each builds its model
    while the others start (the orchestrator waits for /health itself, the trainer needs nothing from the fleet).
    A colocated run starts the trainer first and the rest once it has built and offloaded its state, so that the
    engine sizes its memory on a device the trainer has left. Returns the server groups: the replicas, then the
    teacher if any."""
    fleet = replica_servers(cfg, conf, sup)
    colocated = cfg.inference.colocate
    if colocated:
        sup.start("trainer", trainer_argv(cfg, conf / "trainer.toml"))
        wait_offloaded(cfg, sup, on_wait)
    for name in fleet.argv:
        fleet.start(name)
    teacher = start_run(cfg, conf, sup, token_env(cfg, CLIENT_TOKEN_ENV), trainer=not colocated)
    return [fleet] if teacher is None else [fleet, teacher]


def start_all(
    cfg: RLConfig,
    sup: Supervisor,
    console: Console,
    shared: Registration | None,
    servers: list[Servers],
    waits: Callable[[], None],
) -> None:
    """Runs the SFT warm-up if its model is not there yet, then starts every process and waits until each server
    answers /health. On a shared fleet (`shared`) only the run's trainer, orchestrator and teacher start. The
    server groups join `servers` as they start, so that the caller stops them whatever fails later."""
    conf = run_dir.configs_dir(cfg.output_dir)
    if cfg.sft.steps and not (run_dir.sft_model_dir(cfg.output_dir) / "config.json").exists():
        warm_up(cfg, conf, sup, console)
    if shared is not None:  # a run on a shared fleet: its trainer, orchestrator (and teacher) only
        teacher = start_run(cfg, conf, sup, {CLIENT_TOKEN_ENV: shared.register()})
        console.say(f"on fleet {cfg.fleet} as run {shared.name!r} (adapter {shared.name!r})")
        servers[:] = [] if teacher is None else [teacher]
    else:
        servers[:] = start_processes(cfg, conf, sup, waits)  # the router joins them once the replicas are ready
    wait_ready(sup, servers, cfg.inference_startup_timeout, on_wait=waits)
    if shared is None and cfg.inference.replicas > 1:
        router = router_servers(cfg, conf, sup)
        servers.append(router)
        router.start("router")
        wait_ready(sup, [router], cfg.inference_startup_timeout, on_wait=waits, watch=servers)
