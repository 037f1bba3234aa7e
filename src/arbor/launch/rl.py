"""`rl`: resolves one layered config, then runs inference, trainer and orchestrator as supervised children.

Validate the config -> preflight (`--check` stops here) -> write the resolved configs (`--dry-run` stops here) ->
optional SFT warm-up -> start every process at once and print one line per step. A child that dies stops
everything (exit 1, 3 for a stall) unless `max_restarts` resumes the run; SIGTERM is the clean stop (exit 143).
Dead or frozen inference servers are restarted (arbor.launch.servers). This module never imports torch, so config
errors answer in well under a second. The whole sequence: docs/operations.md, "What `rl` does"."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tomli_w import dumps

from arbor import run_dir
from arbor.checkpoint_manifest import CheckpointDamaged, resume_step
from arbor.colocate import ready_path
from arbor.config.admin import ADMIN_TOKEN_ENV, CLIENT_TOKEN_ENV, is_loopback, new_admin_token, token_value
from arbor.config.fleet import FleetConfig
from arbor.config.loader import ConfigError, load_config, main_guard
from arbor.config.rl import SECTIONS, RLConfig
from arbor.launch.console import Console
from arbor.launch.cores import split_cores
from arbor.launch.on_fleet import Registration, resolve_on_fleet
from arbor.launch.preflight import model_path_line, run_checks
from arbor.launch.process import ChildFailed, Supervisor, stop_reason, tail
from arbor.launch.servers import RESTART_BACKOFF, Servers, healthy
from arbor.launch.slurm import submit
from arbor.launch.twin import plan_twin, write_twin_model
from arbor.launch.watchdog import Watchdog
from arbor.monitor.metrics import read_jsonl, truncate_jsonl
from arbor.planner import plan, render
from arbor.transport.router_wire import use_vllm_router, vllm_router_argv


class Stalled(RuntimeError):
    pass


class Terminated(BaseException):
    """SIGTERM arrived (a scheduler's or `kill`'s stop): `rl` stops every process and exits 143 (128 + 15).
    A BaseException, like the KeyboardInterrupt of SIGINT, so that no `except Exception` on the way swallows it."""


def on_sigterm(signum: int, frame: object) -> None:
    # Further SIGTERMs (a scheduler may repeat them) must not cut the shutdown that this one starts.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve(cfg: RLConfig) -> RLConfig:
    """Fills in what only the launcher knows: ports and addresses (replicas, router), the warm-up model path."""
    inf = cfg.inference
    # Under `rl` an unset port means "any free one", so that two runs on one machine do not collide.
    if inf.port == 0 or "port" not in inf.model_fields_set:
        inf.port = free_port()
    host = "127.0.0.1" if inf.host in ("0.0.0.0", "::") else inf.host
    if inf.replicas == 1:
        cfg.orchestrator.client.base_urls = [f"http://{host}:{inf.port}"]
    else:
        ports = [inf.port] + [free_port() for _ in range(inf.replicas - 1)]
        inf.router.backends = [f"http://{host}:{p}" for p in ports]
        if inf.router.port == 0:
            inf.router.port = free_port()
        rhost = "127.0.0.1" if inf.router.host in ("0.0.0.0", "::") else inf.router.host
        cfg.orchestrator.client.base_urls = [f"http://{rhost}:{inf.router.port}"]
        # vllm-router has no admin routes: weight updates then go to every backend directly.
        cfg.orchestrator.client.admin_urls = inf.router.backends if use_vllm_router(inf.router) else []
    client = cfg.orchestrator.client
    if "reconnect_timeout" not in client.model_fields_set:  # a restarted server gets its whole start-up time
        client.reconnect_timeout = max(client.reconnect_timeout, cfg.inference_startup_timeout + RESTART_BACKOFF)
    token = cfg.run_admin_token()
    public = [inf.host] + ([inf.router.host] if inf.replicas > 1 else [])
    if token is None and not all(is_loopback(h) for h in public):
        token = new_admin_token()
    inf.admin_token = inf.router.admin_token = cfg.orchestrator.client.admin_token = token
    if cfg.teacher is not None and cfg.orchestrator.teacher is not None:  # on-policy distillation's teacher
        teacher = cfg.teacher
        if teacher.port == 0 or "port" not in teacher.model_fields_set:
            teacher.port = free_port()
        teacher.admin_token = token if token is not None or is_loopback(teacher.host) else new_admin_token()
        thost = "127.0.0.1" if teacher.host in ("0.0.0.0", "::") else teacher.host
        cfg.orchestrator.teacher.url = f"http://{thost}:{teacher.port}"
        if cfg.orchestrator.teacher.model is None:
            cfg.orchestrator.teacher.model = teacher.model.name
    if cfg.sft.steps:
        warm = cfg.model.model_copy(update={"name": str(run_dir.sft_model_dir(cfg.output_dir)), "tokenizer": None})
        if warm.lora is not None:  # the warm-up's adapter is merged into sft/: RL starts a fresh adapter on it
            warm.lora = warm.lora.model_copy(update={"path": None})
        for section in (cfg.trainer, cfg.orchestrator, cfg.inference):
            section.model = warm
    return cfg


def write_configs(cfg: RLConfig) -> Path:
    out = run_dir.configs_dir(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "rl.toml").write_text(dumps(cfg.to_toml_dict()))
        for name in ("trainer", "orchestrator", "inference", "sft"):
            (out / f"{name}.toml").write_text(dumps(getattr(cfg, name).to_toml_dict()))
        (out / "router.toml").write_text(dumps(cfg.inference.router.to_toml_dict()))
        if cfg.teacher is not None:
            (out / "teacher.toml").write_text(dumps(cfg.teacher.to_toml_dict()))
    except OSError as e:  # `--dry-run` reaches here without preflight's writability check
        raise ConfigError(f"output_dir {cfg.output_dir} is not writable: {e.strerror or e}") from None
    return out


def prepare_run_dir(cfg: RLConfig) -> int:
    """Returns the step the run starts at: on a resume the newest checkpoint that verifies (a damaged newer one is
    said in one line and set aside, or refused with `ckpt.on_damage = "fail"`: CheckpointDamaged). Clears what a
    previous attempt left past that step, every published version included (the trainer republishes it)."""
    out = cfg.output_dir
    latest = run_dir.latest_checkpoint(out)
    if not cfg.resume and latest is not None:
        raise ConfigError(
            f"output_dir {out} holds checkpoints of an earlier run: pass --resume, or choose another --output-dir"
        )
    start = 0
    if cfg.resume:
        say = lambda line: print(f"rl: {line}", file=sys.stderr, flush=True)  # noqa: E731
        start = resume_step(out, cfg.trainer.ckpt.on_damage, orchestrator=True, say=say) or 0
    run_dir.clear_after(out, start)
    for path in run_dir.all_metrics_paths(out):
        truncate_jsonl(path, start)
    return start


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


def wait_offloaded(cfg: RLConfig, sup: Supervisor, on_wait: Callable[[], None] | None = None) -> None:
    """A colocated run: waits (bounded by `inference_startup_timeout`, watching the trainer) until the trainer has
    built, republished on a resume, and offloaded its state (arbor.colocate.ready_path)."""
    path = ready_path(cfg.output_dir)
    deadline = time.monotonic() + cfg.inference_startup_timeout
    while not path.exists():
        check_children(sup, finished=set())
        if time.monotonic() > deadline:
            raise ChildFailed(
                f"colocated run: the trainer did not build and offload its state within "
                f"{cfg.inference_startup_timeout:.0f}s ({path}); see {sup.children['trainer'].log_path}"
            )
        if on_wait is not None:
            on_wait()
        time.sleep(0.2)


def wait_ready(
    sup: Supervisor,
    servers: Sequence[Servers],
    timeout: float,
    on_wait: Callable[[], None] | None = None,
    watch: Sequence[Servers] | None = None,
) -> None:
    """Waits for each server of each group to answer /health, then counts it as ready (restarted if it dies);
    meanwhile a death among `watch` (default: `servers`) is handled as their group says."""
    for group in servers:
        for name, url in group.urls.items():
            wait_healthy(sup, url, timeout, name, servers if watch is None else watch, on_wait)
            group.ready.add(name)
            group.last_ok[name] = time.monotonic()
        group.watch()


def wait_healthy(
    sup: Supervisor,
    url: str,
    timeout: float,
    name: str = "inference",
    servers: Sequence[Servers] = (),
    on_wait: Callable[[], None] | None = None,
) -> None:
    """Polls `url`/health until it answers 200; calls `on_wait` between polls (the console's "waiting for")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_children(sup, finished=set(), servers=servers)
        if on_wait is not None:
            on_wait()
        if healthy(url):
            return
        time.sleep(0.3)
    raise ChildFailed(f"{name} did not become healthy within {timeout:.0f}s; see {sup.children[name].log_path}")


def check_children(
    sup: Supervisor,
    finished: set[str],
    may_finish: tuple[str, ...] = ("trainer", "orchestrator", "sft"),
    servers: Sequence[Servers] = (),
    console: Console | None = None,
) -> None:
    for name, child in list(sup.children.items()):
        if name in finished:
            continue
        rc = child.poll()
        if rc is None:
            continue
        if rc == 0 and name in may_finish:
            finished.add(name)
            continue
        group = next((g for g in servers if name in g.argv), None)
        if group is not None:
            group.on_death(name, rc, console.say if console is not None else None)
            continue
        stopped = stop_reason(child.log_path)  # a full disk or a damaged checkpoint: its one line is the error
        if stopped is not None:
            code = run_dir.DISK_FULL_EXIT if stopped.startswith("disk full") else 1
            raise ChildFailed(f"{name} stopped: {stopped}", exit_code=code)
        raise ChildFailed(f"{name} exited with code {rc}; see {child.log_path}\n{tail(child.log_path)}")
    for group in servers:
        group.check_liveness(console.say if console is not None else None)


def record_timings(output_dir: Path, sup: Supervisor) -> None:
    """Appends each process's wall-clock seconds of this launch to `timings.jsonl` (arbor-report's cost figure)."""
    row = {name: round(c.ended - c.started, 3) for name, c in sup.children.items() if c.ended is not None}
    with open(run_dir.timings_path(output_dir), "a") as f:
        f.write(json.dumps({"time": time.time(), "seconds": row}) + "\n")


def run(cfg: RLConfig, note: str | None = None) -> int:
    """Runs the resolved config; `note` (the core split, arbor.launch.cores) is printed after the first line."""
    try:
        start = prepare_run_dir(cfg)
    except CheckpointDamaged as e:  # ckpt.on_damage = "fail"
        print(f"rl: error: {e}", file=sys.stderr, flush=True)
        return 2
    conf = run_dir.configs_dir(cfg.output_dir)
    sup = Supervisor(run_dir.logs_dir(cfg.output_dir), child_env())
    console = Console(cfg.output_dir, cfg.max_steps, start, cfg.sft.steps)
    console.say(
        f"arbor rl: {cfg.output_dir} (steps {start}..{cfg.max_steps}, logs in {run_dir.logs_dir(cfg.output_dir)})"
    )
    if note:
        console.say(note)
    shared = Registration(cfg) if cfg.fleet is not None else None
    servers: list[Servers] = []

    def waits() -> None:
        console.waiting({n: c.started for n, c in sup.children.items() if n != "sft"})

    try:
        if cfg.sft.steps and not (run_dir.sft_model_dir(cfg.output_dir) / "config.json").exists():
            warm_up(cfg, conf, sup, console)
        if shared is not None:  # a run on a shared fleet: its trainer, orchestrator (and teacher) only
            teacher = start_run(cfg, conf, sup, {CLIENT_TOKEN_ENV: shared.register()})
            console.say(f"on fleet {cfg.fleet} as run {shared.name!r} (adapter {shared.name!r})")
            servers = [] if teacher is None else [teacher]
        else:
            servers = start_processes(cfg, conf, sup, waits)  # the router joins them once the replicas are ready
        wait_ready(sup, servers, cfg.inference_startup_timeout, on_wait=waits)
        if shared is None and cfg.inference.replicas > 1:
            router = Servers(
                sup,
                {"router": router_argv(cfg, conf)},
                {"router": cfg.orchestrator.client.base_urls[0]},
                token_env(cfg, ADMIN_TOKEN_ENV),
                cfg.inference.restart_dead_replicas,
                "routers",
                cfg.inference.liveness_timeout,
                cfg.inference_startup_timeout,
            )
            servers.append(router)
            router.start("router")
            wait_ready(sup, [router], cfg.inference_startup_timeout, on_wait=waits, watch=servers)
        finished = {"sft"}
        watchdog = Watchdog(cfg.output_dir, cfg.stall_timeout)
        while not {"trainer", "orchestrator"} <= finished:
            check_children(sup, finished, servers=servers, console=console)
            console.poll()
            waits()
            if watchdog.stalled(console.seen):
                dumps = watchdog.dump_stacks()
                raise Stalled(
                    f"no step completed in {cfg.stall_timeout:.0f}s (stall_timeout); "
                    f"{watchdog.stacks_summary(dumps)}; last heartbeats:\n{watchdog.diagnosis()}"
                )
            time.sleep(0.2)
        console.poll()
        stopped = run_dir.stopped_path(cfg.output_dir)
        if stopped.exists():  # the trainer's max_minutes ended the run at a checkpoint
            at = json.loads(stopped.read_text())["step"]
            console.say(
                f"stopped at step {at}/{cfg.max_steps} by max_minutes ({cfg.max_minutes:g}), checkpoint "
                f"written: continue with --resume and a larger --max-minutes"
            )
        console.say(f"done: {run_dir.metrics_path(cfg.output_dir)}")
        return 0
    except ChildFailed as e:
        console.say(f"rl: error: {e}", err=True)
        return e.exit_code
    except ConfigError as e:  # the fleet refused the run
        console.say(f"rl: error: {e}", err=True)
        return 1
    except Stalled as e:
        console.say(f"rl: error: {e}", err=True)
        return 3
    except KeyboardInterrupt:
        console.say("rl: interrupted; stopping every process", err=True)
        return 130  # 128 + SIGINT, as a shell reports Ctrl-C
    except Terminated:
        console.say("rl: terminated (SIGTERM); stopping every process", err=True)
        return 143  # 128 + SIGTERM
    finally:
        for group in servers:
            group.close()
        sup.stop()
        record_timings(cfg.output_dir, sup)
        if shared is not None:
            try:
                shared.end()
            except ConfigError as e:  # the fleet is gone: the run's own outcome still stands
                console.say(f"rl: the run's use of the fleet was not recorded, nor the run unregistered: {e}", err=True)


def run_attempts(cfg: RLConfig, note: str | None = None) -> int:
    """`run`, then `run` again from the last checkpoint after each failed attempt (exit 1: a process died for
    good; 3: a stall) that completed a step, at most `max_restarts` times."""
    rc = 0
    for attempt in range(cfg.max_restarts + 1):
        start = (run_dir.latest_checkpoint(cfg.output_dir) if cfg.resume else None) or 0
        rc = run(cfg, note)
        if rc not in (1, 3) or attempt == cfg.max_restarts or last_step(cfg.output_dir) < start:
            return rc
        try:
            print(
                f"rl: restart {attempt + 1}/{cfg.max_restarts}: resuming from the last checkpoint "
                f"(step {run_dir.latest_checkpoint(cfg.output_dir) or 0})",
                file=sys.stderr,
                flush=True,
            )
            cfg = resume_everywhere(cfg)
            write_configs(cfg)
        except KeyboardInterrupt:
            return 130
        except Terminated:
            return 143
    return rc


def last_step(output_dir: Path) -> int:
    """The last step in metrics.jsonl (-1: none)."""
    return max((int(r["step"]) for r in read_jsonl(run_dir.metrics_path(output_dir))), default=-1)


def resume_everywhere(cfg: RLConfig) -> RLConfig:
    """`cfg` with `resume` set in every process's section and in the run's config, as `--resume` at load time
    does (the top level by copy: an assignment would validate the whole config again, its load-time rules
    included)."""
    for section in SECTIONS:
        sub = getattr(cfg, section)
        if "resume" in type(sub).model_fields:
            sub.resume = True
    return cfg.model_copy(update={"resume": True})


def plan_main(argv: list[str]) -> int:
    """`rl plan @ config.toml`: prints the throughput planner's table for the config and starts nothing."""
    cfg = load_config(RLConfig, argv, prog="rl plan")
    print(render(plan(cfg)))
    return 0


def twin_config(cfg: RLConfig, argv: list[str]) -> RLConfig:
    """`rl --twin`: prints what the twin changes and why, writes its tiny model (not under `--dry-run`), and
    returns the twin's config, loaded from the same layers with the changes on top."""
    twin = plan_twin(cfg)
    print(twin.render(), flush=True)
    out = load_config(RLConfig, argv, prog="rl --twin", overrides=twin.overrides)
    if not out.dry_run:  # `--check` checks the twin's model files too
        write_twin_model(twin, out.model.init_seed)
    return out


@main_guard
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    cfg = load_config(RLConfig, argv, prog="rl")
    if cfg.twin:
        cfg = twin_config(cfg, argv)
    if cfg.check:
        for line in run_checks(cfg):
            print(f"skipped: {line}")
        if path_line := model_path_line(cfg.model):
            print(path_line)
        print(f"preflight passed: {cfg.output_dir} is ready for the run (nothing was started)")
        return 0
    if cfg.slurm is not None:
        write_configs(resolve(cfg.model_copy(deep=True)))
        return submit(cfg, cfg.dry_run)
    if not cfg.dry_run:
        run_checks(cfg)  # before resolve(): an explicitly set port is still marked as set
        if path_line := model_path_line(cfg.model):
            print(path_line)
    cfg = resolve_on_fleet(cfg) if cfg.fleet is not None else resolve(cfg)
    cores = split_cores(cfg)  # before write_configs: a resumed run reads the threads its last attempt ran with
    write_configs(cfg)
    if cfg.dry_run:
        print(f"resolved configs written to {run_dir.configs_dir(cfg.output_dir)}")
        backend = cfg.inference.engine_backend()
        command = backend.command(cfg.inference)
        if command is not None:
            print(f"{backend.title} server command: {command}")
        return 0
    # SIGTERM (from a scheduler or `kill`) stops the run as Ctrl-C does, but exits 143, not 130.
    signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C and `kill -INT` stop it too where it started with SIGINT ignored (which a child inherits: a shell's
    # background job, nohup, a test runner's worker), where Python would leave it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return run_attempts(cfg, cores)


if __name__ == "__main__":
    raise SystemExit(main())
