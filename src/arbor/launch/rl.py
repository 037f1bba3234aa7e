"""`rl`: resolves one layered config, then runs inference, trainer and orchestrator as supervised children.

Validate the config -> preflight (`--check` stops here) -> write the resolved configs (`--dry-run` stops here) ->
optional SFT warm-up -> start every process at once and print one line per step. A child that dies stops
everything (exit 1, 3 for a stall) unless `max_restarts` resumes the run; SIGTERM is the clean stop (exit 143).
Dead or frozen inference servers are restarted (arbor.launch.servers). Each child's command line and the start
order: arbor.launch.children; the waits and the watch over the children: arbor.launch.supervise. This module (and
those) never imports torch, so config errors answer in well under a second. The whole sequence: docs/operations.md,
"What `rl` does"."""

from __future__ import annotations

import json
import signal
import sys
from functools import partial
from pathlib import Path

from tomli_w import dumps

from arbor import run_dir
from arbor.checkpoint_manifest import CheckpointDamaged, resume_step
from arbor.config.admin import is_loopback, new_admin_token
from arbor.config.loader import ConfigError, load_config, main_guard
from arbor.config.rl import SECTIONS, RLConfig
from arbor.launch.children import child_env, start_all
from arbor.launch.console import Console
from arbor.launch.cores import split_cores
from arbor.launch.on_fleet import Registration, resolve_on_fleet
from arbor.launch.preflight import model_path_line, run_checks
from arbor.launch.process import ChildFailed, Supervisor, Terminated, free_port, on_sigterm
from arbor.launch.servers import RESTART_BACKOFF, Servers
from arbor.launch.slurm import submit
from arbor.launch.supervise import Stalled, record_timings, show_waiting, watch_run
from arbor.launch.twin import plan_twin, write_twin_model
from arbor.monitor.metrics import read_jsonl, truncate_jsonl
from arbor.planner import plan, render
from arbor.transport.router_wire import use_vllm_router


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


def run(cfg: RLConfig, note: str | None = None) -> int:
    """Runs the resolved config; `note` (the core split, arbor.launch.cores) is printed after the first line."""
    try:
        start = prepare_run_dir(cfg)
    except CheckpointDamaged as e:  # ckpt.on_damage = "fail"
        print(f"rl: error: {e}", file=sys.stderr, flush=True)
        return 2
    sup = Supervisor(run_dir.logs_dir(cfg.output_dir), child_env())
    console = open_console(cfg, start, note)
    shared = Registration(cfg) if cfg.fleet is not None else None
    servers: list[Servers] = []
    waits = partial(show_waiting, sup, console)
    try:
        start_all(cfg, sup, console, shared, servers, waits)
        watch_run(cfg, sup, servers, console, waits)
        say_finished(cfg, console)
        return 0
    except (ChildFailed, ConfigError, Stalled, KeyboardInterrupt, Terminated) as e:
        return stopped_by(e, console)
    finally:
        shut_down(cfg, sup, servers, console, shared)


def open_console(cfg: RLConfig, start: int, note: str | None) -> Console:
    """The run's console, after its first line (where it runs and logs) and `note`."""
    console = Console(cfg.output_dir, cfg.max_steps, start, cfg.sft.steps)
    console.say(
        f"arbor rl: {cfg.output_dir} (steps {start}..{cfg.max_steps}, logs in {run_dir.logs_dir(cfg.output_dir)})"
    )
    if note:
        console.say(note)
    return console


def say_finished(cfg: RLConfig, console: Console) -> None:
    """The run's last lines: where it stopped if `max_minutes` ended it, and where its metrics are."""
    stopped = run_dir.stopped_path(cfg.output_dir)
    if stopped.exists():  # the trainer's max_minutes ended the run at a checkpoint
        at = json.loads(stopped.read_text())["step"]
        console.say(
            f"stopped at step {at}/{cfg.max_steps} by max_minutes ({cfg.max_minutes:g}), checkpoint "
            f"written: continue with --resume and a larger --max-minutes"
        )
    console.say(f"done: {run_dir.metrics_path(cfg.output_dir)}")


def stopped_by(e: BaseException, console: Console) -> int:
    """Says in one line why the run stopped early and returns its exit status."""
    if isinstance(e, ChildFailed):
        console.say(f"rl: error: {e}", err=True)
        return e.exit_code
    if isinstance(e, ConfigError):  # the fleet refused the run
        console.say(f"rl: error: {e}", err=True)
        return 1
    if isinstance(e, Stalled):
        console.say(f"rl: error: {e}", err=True)
        return 3
    if isinstance(e, KeyboardInterrupt):
        console.say("rl: interrupted; stopping every process", err=True)
        return 130  # 128 + SIGINT, as a shell reports Ctrl-C
    console.say("rl: terminated (SIGTERM); stopping every process", err=True)
    return 143  # 128 + SIGTERM


def shut_down(
    cfg: RLConfig, sup: Supervisor, servers: list[Servers], console: Console, shared: Registration | None
) -> None:
    """Stops every process, records their timings and, on a shared fleet, ends the run's registration."""
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
