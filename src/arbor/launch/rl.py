"""`rl`: resolves one layered config, then runs inference, trainer and orchestrator as supervised children.

Order: validate the whole config (a bad one fails here, before any process starts) -> write the resolved
configs to `<output_dir>/configs/` (`--dry-run` stops here) -> prepare the run directory (fresh or resume) ->
optional SFT warm-up -> inference (wait for /health) -> trainer and orchestrator -> print one line per step
from metrics.jsonl until both finish. Any child that dies stops everything and `rl` exits non-zero naming it
and its log. This module never imports torch, so `--dry-run` and config errors answer in well under a second.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

from arbor.config.loader import ConfigError, load_config, main_guard
from arbor.config.rl import RLConfig
from arbor.config.toml_writer import dumps
from arbor.launch.console import Console
from arbor.launch.process import Supervisor, tail
from arbor.launch.watchdog import Watchdog


class ChildFailed(RuntimeError):
    pass


class Stalled(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve(cfg: RLConfig) -> RLConfig:
    """Fills in what only the launcher knows: the inference port and address, the warm-up model path."""
    # Under `rl` an unset port means "any free one", so that two runs on one machine do not collide.
    if cfg.inference.port == 0 or "port" not in cfg.inference.model_fields_set:
        cfg.inference.port = free_port()
    host = "127.0.0.1" if cfg.inference.host in ("0.0.0.0", "::") else cfg.inference.host
    cfg.orchestrator.client.base_urls = [f"http://{host}:{cfg.inference.port}"]
    if cfg.sft.steps:
        warm = cfg.model.model_copy(update={"name": str(cfg.output_dir / "sft"), "tokenizer": None})
        for section in (cfg.trainer, cfg.orchestrator, cfg.inference):
            section.model = warm
    return cfg


def write_configs(cfg: RLConfig) -> Path:
    out = cfg.output_dir / "configs"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl.toml").write_text(dumps(cfg.to_toml_dict()))
    for name in ("trainer", "orchestrator", "inference", "sft"):
        (out / f"{name}.toml").write_text(dumps(getattr(cfg, name).to_toml_dict()))
    return out


def prepare_run_dir(cfg: RLConfig) -> int:
    """Returns the step the run starts at; clears what a previous attempt left past that step."""
    from arbor.monitor.metrics import all_metrics_paths, truncate_jsonl
    from arbor.trainer.checkpoint import latest_checkpoint
    from arbor.transport.weights import broadcast_dir, published_steps

    out = cfg.output_dir
    start = latest_checkpoint(out) if cfg.resume else None
    if not cfg.resume and latest_checkpoint(out) is not None:
        raise ConfigError(f"output_dir {out} holds checkpoints of an earlier run: pass --resume, or choose another --output-dir")
    start = start or 0
    for d in (out / "rollouts").glob("step_*"):
        if int(d.name.split("_")[1]) >= start:
            shutil.rmtree(d)
    for step in published_steps(out):
        if step > start or not cfg.resume:
            shutil.rmtree(broadcast_dir(out, step))
    for path in all_metrics_paths(out):
        truncate_jsonl(path, start)
    # Heartbeats of an earlier attempt name pids that may now belong to someone else: never signal those.
    shutil.rmtree(out / "heartbeats", ignore_errors=True)
    return start


def child_env() -> dict[str, str]:
    # Configs are fully resolved into files; inherited ARBOR_ variables would apply a second time.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARBOR_")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def trainer_argv(cfg: RLConfig, conf: Path) -> list[str]:
    n = cfg.trainer.parallel.nproc
    if n == 1:
        return [sys.executable, "-m", "arbor.trainer.main", "@", str(conf)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
        "-m", "arbor.trainer.main", "@", str(conf),
    ]


def wait_healthy(sup: Supervisor, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_children(sup, finished=set())
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise ChildFailed(f"inference did not become healthy within {timeout:.0f}s; see {sup.children['inference'].log_path}")


def check_children(sup: Supervisor, finished: set[str], may_finish: tuple[str, ...] = ("trainer", "orchestrator", "sft")) -> None:
    for name, child in sup.children.items():
        if name in finished:
            continue
        rc = child.poll()
        if rc is None:
            continue
        if rc == 0 and name in may_finish:
            finished.add(name)
            continue
        raise ChildFailed(f"{name} exited with code {rc}; see {child.log_path}\n{tail(child.log_path)}")


def record_timings(output_dir: Path, sup: Supervisor) -> None:
    """Appends each process's wall-clock seconds of this launch to `timings.jsonl` (arbor-report's cost figure)."""
    row = {name: round(c.ended - c.started, 3) for name, c in sup.children.items() if c.ended is not None}
    with open(output_dir / "timings.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "seconds": row}) + "\n")


def run(cfg: RLConfig) -> int:
    start = prepare_run_dir(cfg)
    conf = cfg.output_dir / "configs"
    sup = Supervisor(cfg.output_dir / "logs", child_env())
    console = Console(cfg.output_dir, cfg.max_steps, start)
    console.say(f"arbor rl: {cfg.output_dir} (steps {start}..{cfg.max_steps}, logs in {cfg.output_dir / 'logs'})")
    try:
        if cfg.sft.steps and not (cfg.output_dir / "sft" / "config.json").exists():
            console.say(f"SFT warm-up: {cfg.sft.steps} steps")
            sup.start("sft", [sys.executable, "-m", "arbor.trainer.sft", "@", str(conf / "sft.toml")])
            finished: set[str] = set()
            while "sft" not in finished:
                check_children(sup, finished)
                time.sleep(0.2)
        sup.start("inference", [sys.executable, "-m", "arbor.inference.server", "@", str(conf / "inference.toml")])
        wait_healthy(sup, cfg.orchestrator.client.base_urls[0], cfg.inference_startup_timeout)
        sup.start("trainer", trainer_argv(cfg, conf / "trainer.toml"))
        sup.start("orchestrator", [sys.executable, "-m", "arbor.orchestrator.main", "@", str(conf / "orchestrator.toml")])
        finished = {"sft"}
        watchdog = Watchdog(cfg.output_dir, cfg.stall_timeout)
        while not {"trainer", "orchestrator"} <= finished:
            check_children(sup, finished)
            console.poll()
            if watchdog.stalled(console.seen):
                dumps = watchdog.dump_stacks()
                raise Stalled(
                    f"no step completed in {cfg.stall_timeout:.0f}s (stall_timeout); stacks of {len(dumps)} "
                    f"processes in {cfg.output_dir / 'logs' / 'stacks'}; last heartbeats:\n{watchdog.diagnosis()}"
                )
            time.sleep(0.2)
        console.poll()
        console.say(f"done: {cfg.output_dir / 'metrics.jsonl'}")
        return 0
    except ChildFailed as e:
        console.say(f"rl: error: {e}", err=True)
        return 1
    except Stalled as e:
        console.say(f"rl: error: {e}", err=True)
        return 3
    except KeyboardInterrupt:
        console.say("rl: interrupted; stopping every process", err=True)
        return 130
    finally:
        sup.stop()
        record_timings(cfg.output_dir, sup)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(RLConfig, argv, prog="rl")
    if cfg.slurm is not None:
        from arbor.launch.slurm import submit

        write_configs(resolve(cfg.model_copy(deep=True)))
        return submit(cfg, cfg.dry_run)
    if not cfg.dry_run:
        from arbor.launch.preflight import run_checks

        run_checks(cfg)  # before resolve(): an explicitly set port is still marked as set
    cfg = resolve(cfg)
    write_configs(cfg)
    if cfg.dry_run:
        print(f"resolved configs written to {cfg.output_dir / 'configs'}")
        return 0
    # SIGTERM (from a scheduler or `kill`) stops the run like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    return run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
