"""RL from a warm-up checkpoint: the reverse_text example's RL steps against TRL's GRPOTrainer from the same weights.

    uv run --group bench python benchmarks/warm_start_vs_trl.py        # issue 34's Llama, raw prompts, seeds 0, 1
    uv run --group bench python benchmarks/warm_start_vs_trl.py --model DIR --prompt-format chat

How much can RL add to a warm-up's policy, and does arbor add what the strongest baseline would? Per seed, arbor
runs the example as a user does, `rl @ examples/reverse_text/rl.toml --model.name M
--orchestrator.environment.prompt-format F --seed S`: its SFT warm-up, then its RL steps. TRL's GRPOTrainer then
starts from that warm-up's weights (`<run>/sft`) with the same run's RL settings, read from the config `rl`
resolves (vs_trl_task.GRPOSettings: batch and group, steps, lr and AdamW, clip low / high, token-normalised loss,
advantage, temperature, top-p, max tokens; a setting TRL's arm has no equal of is refused in one line). What
differs: TRL is on-policy while the example runs one step off (`--arms arbor,arbor_sync,trl` adds arbor on the
`sync` schedule from the same warm-up); TRL draws the same dataset's tasks shuffled and decodes with transformers.
Without TRL installed the TRL arm is skipped, saying so. The default model is issue 34's: a transformers
`LlamaForCausalLM` of qwen3-tiny's shape, random weights from `--init-seed`, arbor's byte tokenizer.

Figures per arm and seed: the step rewards' first five mean, the last five's and the last 30's (what
tests/models/test_hub_models.py asserts), the rises from the first five; held-out figures
(reverse_text_ceiling.measure: greedy and sampled reward on `--tasks` tasks of another seed) of the warm-up and of
each arm's final weights, and the held-out sampled reward's rise from the warm-up's (the same question without the
noise of 16 prompts a step). The last line is JSON: `value` is arbor's mean rise (first five -> last 30) minus
TRL's, `target` 0 (arbor's RL adds at least what TRL's does from the same weights), `rise_target` issue 34's 0.1.
Figures measured are kept in docs/models.md, not here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from reverse_text_ceiling import measure, tiny_llama
from smoke import parse_args
from vs_trl_task import GRPOSettings, newest_published, score, trl_grpo_config

from arbor.config.environment import EnvironmentConfig
from arbor.config.loader import load_config
from arbor.config.rl import RLConfig
from arbor.environments import load_environment
from arbor.environments.protocol import raw_prompt
from arbor.environments.reverse_text import ReverseTextEnv
from arbor.monitor.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("arbor", "arbor_sync", "trl")
EXAMPLE = ROOT / "examples/reverse_text/rl.toml"
HELD_OUT_SEED = 123
"""The held-out tasks' dataset seed (reverse_text_ceiling.py's): neither the warm-up nor RL draws from it."""
RISE_TARGET = 0.1
"""Issue 34's rise of the example's RL after its warm-up."""


def rl_args(a: argparse.Namespace, model: Path, seed: int, out: Path) -> list[str]:
    """`rl`'s command line for the example with `model`, the prompt format, the seed and the smoke sizes."""
    args = ["@", str(EXAMPLE), "--model.name", str(model), "--orchestrator.environment.prompt-format"]
    args += [a.prompt_format, "--seed", str(seed), "--output-dir", str(out)]
    if a.max_steps is not None:
        args += ["--max-steps", str(a.max_steps)]
    if a.sft_steps is not None:
        args += ["--sft.steps", str(a.sft_steps)]
    return args


def grpo_settings(cfg: RLConfig) -> GRPOSettings:
    """The run's RL settings as TRL's GRPOTrainer takes them; a setting it has no equal of is refused in one line."""
    o, t = cfg.orchestrator, cfg.trainer
    fixed = {
        "trainer.loss.name": (t.loss.name, "ppo_clip"),
        "trainer.optim.name": (t.optim.name, "adamw"),
        "trainer.lr_schedule.name": (t.lr_schedule.name, "constant"),
        "trainer.lr_schedule.warmup_steps": (t.lr_schedule.warmup_steps, 0),
        "trainer.mini_batches": (t.mini_batches, 1),
        "trainer.epochs": (t.epochs, 1),
        "orchestrator.advantage.name": (o.advantage.name, "grpo"),
        "orchestrator.batching.normalization": (o.batching.normalization, "token"),
        "orchestrator.environment.id": (o.environment.id, "reverse_text"),
    }
    for field, (have, want) in fixed.items():
        if have != want:
            raise SystemExit(f"{field} = {have!r}: TRL's arm of this benchmark maps only {want!r}")
    if not cfg.sft.steps:
        raise SystemExit("sft.steps = 0: this benchmark starts both arms from the run's SFT warm-up")
    return GRPOSettings(
        prompts=o.batch_size // o.group_size,
        group=o.group_size,
        max_tokens=o.sampling.max_tokens,
        lr=t.optim.lr,
        temperature=o.sampling.temperature,
        top_p=o.sampling.top_p,
        clip_low=t.loss.clip_low,
        clip_high=t.loss.clip_high,
        std_normalize=o.advantage.std_normalize,
        kl_coef=t.loss.kl_coef,
        betas=tuple(t.optim.betas),
        eps=t.optim.eps,
        weight_decay=t.optim.weight_decay,
        max_norm=t.optim.max_norm,
        steps=cfg.max_steps,
        shuffle=True,
    )


# ---- arms ----


def arbor_arm(argv: list[str], run: Path) -> dict:
    """`rl` with `argv`; its step rewards and its final published weights."""
    proc = subprocess.run([sys.executable, "-m", "arbor.launch.rl", *argv], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}{proc.stdout[-2000:]}")
    rewards = [r["reward/mean"] for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    return {"rewards": rewards, "final": str(newest_published(run))}


def trl_worker(spec: dict) -> None:
    """TRL's arm in a process of its own (`--trl-worker SPEC`): GRPO from spec["ckpt"] with spec["settings"];
    writes the step rewards to spec["out"]/result.json and the final weights beside it."""
    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    out, settings = Path(spec["out"]), GRPOSettings(**{**spec["settings"], "betas": tuple(spec["settings"]["betas"])})
    env = load_environment(EnvironmentConfig(**spec["environment"]))
    chat = spec["prompt_format"] == "chat"
    rows = [
        {"prompt": env.prompt(t) if chat else raw_prompt(env.prompt(t)), "task": t} for t in env.dataset(spec["seed"])
    ]
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["task"]["answer"]} for r in rows])

    def reward(completions: list, answer: list[str], **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return asyncio_score(env, answer, texts)

    rewards: list[float] = []

    class Rewards(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001 (TrainerCallback's signature)
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    tok = AutoTokenizer.from_pretrained(spec["ckpt"])
    model = AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32)
    config = trl_grpo_config(out / "trl", spec["seed"], settings)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok, callbacks=[Rewards()]
    )
    trainer.train()
    trainer.save_model(str(out / "final"))
    (out / "result.json").write_text(json.dumps({"rewards": rewards, "final": str(out / "final")}))


def asyncio_score(env: ReverseTextEnv, answers: list[str], texts: list[str]) -> list[float]:
    """The environment's own similarity of each text to its answer (one event loop per batch)."""
    return asyncio.run(score(env, [{"answer": x} for x in answers], texts))


def trl_arm(spec: dict) -> dict:
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", json.dumps(spec)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL arm exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


# ---- figures ----


def rises(rewards: list[float]) -> dict[str, float]:
    """The step rewards' first five mean, last five and last 30 (all of them in a shorter run) and the rises."""
    first, last5, last30 = (statistics.mean(x) for x in (rewards[:5], rewards[-5:], rewards[-30:]))
    return {
        "steps": len(rewards),
        "first5": round(first, 4),
        "last5": round(last5, 4),
        "last30": round(last30, 4),
        "rise_last5": round(last5 - first, 4),
        "rise_last30": round(last30 - first, 4),
    }


def held_out(path: Path, a: argparse.Namespace, tasks: list[dict]) -> dict:
    figures = measure(path, tasks, a.prompt_format, 0, 0)
    return {k: figures[k] for k in ("greedy", "sampled", "greedy_exact", "sampled_exact")}


def run_seed(a: argparse.Namespace, arms: list[str], model: Path, seed: int, tmp: Path, tasks: list[dict]) -> dict:
    """Every arm on one seed: the example first (its warm-up is where the others start)."""
    run = tmp / f"arbor_{seed}"
    args = rl_args(a, model, seed, run)
    cfg = load_config(RLConfig, args)
    settings = grpo_settings(cfg)
    res = {"arbor": arbor_arm(args, run)}
    warm = run / "sft"
    if "arbor_sync" in arms:
        sync_run = tmp / f"arbor_sync_{seed}"
        sync_args = [*rl_args(a, warm, seed, sync_run), "--sft.steps", "0", "--orchestrator.scheduler.mode", "sync"]
        res["arbor_sync"] = arbor_arm(sync_args, sync_run)
    if "trl" in arms:
        spec = {"ckpt": str(warm), "out": str(tmp / f"trl_{seed}"), "seed": seed, "threads": a.trl_threads}
        spec |= {"settings": dataclasses.asdict(settings), "prompt_format": a.prompt_format}
        spec["environment"] = cfg.orchestrator.environment.model_dump(include={"id", "args"})
        res["trl"] = trl_arm(spec)
    res["warm_up"] = held_out(warm, a, tasks)
    for arm in (x for x in ARMS if x in res):
        figures = held_out(Path(res[arm]["final"]), a, tasks)
        rise = round(figures["sampled"] - res["warm_up"]["sampled"], 4)
        res[arm] = {**rises(res[arm]["rewards"]), "held_out": figures, "held_out_sampled_rise": rise}
    res["settings"] = dataclasses.asdict(settings)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: issue 34's Llama)")
    p.add_argument("--init-seed", type=int, default=0, help="the default Llama's random weights' seed")
    p.add_argument("--prompt-format", default="raw", choices=["raw", "chat"])
    p.add_argument("--seeds", default="0,1", help="comma-separated run seeds")
    p.add_argument("--arms", default="arbor,trl", help="comma-separated: arbor (always), arbor_sync, trl")
    p.add_argument("--max-steps", type=int, default=None, help="RL steps (default: the example's)")
    p.add_argument("--sft-steps", type=int, default=None, help="warm-up steps (default: the example's)")
    p.add_argument("--tasks", type=int, default=200, help="held-out tasks for the greedy and sampled figures")
    p.add_argument("--trl-threads", type=int, default=len(os.sched_getaffinity(0)), help="TRL's torch threads")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    pre = p.parse_known_args()[0]
    if pre.trl_worker:
        trl_worker(json.loads(pre.trl_worker))
        return
    a = parse_args(p, seeds="0", max_steps=3, sft_steps=2, tasks=4)
    arms = ["arbor", *(x for x in a.arms.split(",") if x and x != "arbor")]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"--arms: unknown arm(s) {sorted(unknown)}; choose from arbor, arbor_sync, trl")
    trl_skipped = "trl" in arms and importlib.util.find_spec("trl") is None
    if trl_skipped:
        print(
            "TRL is not installed: skipping the TRL arm (uv run --group bench python benchmarks/warm_start_vs_trl.py)"
        )
        arms.remove("trl")
    torch.set_num_threads(1)
    tasks = ReverseTextEnv(min_len=2, max_len=5, alphabet="abcdefgh").dataset(HELD_OUT_SEED)[: a.tasks]
    results = []
    with tempfile.TemporaryDirectory(prefix="warm_start_vs_trl_") as tmp_name:
        tmp = Path(tmp_name)
        model = a.model or tiny_llama(tmp / "llama", "qwen3-tiny", a.init_seed)
        for seed in (int(s) for s in a.seeds.split(",")):
            results.append(run_seed(a, arms, model, seed, tmp, tasks))
            print(f"seed {seed}: {json.dumps(results[-1])}", flush=True)
    print_result(a, results, trl_skipped)


def print_result(a: argparse.Namespace, results: list[dict], trl_skipped: bool) -> None:
    def mean_rise(arm: str, key: str = "rise_last30") -> float | None:
        xs = [r[arm][key] for r in results if arm in r]
        return round(statistics.mean(xs), 4) if xs else None

    arbor, trl = mean_rise("arbor"), mean_rise("trl")
    value = None if trl is None else round(arbor - trl, 4)
    summary = {"benchmark": "warm_start_vs_trl", "value": value, "target": 0.0, "ok": value is not None and value >= 0}
    summary |= {"rise_target": RISE_TARGET, "arbor_rise": arbor, "trl_rise": trl}
    summary["arbor_sync_rise"] = mean_rise("arbor_sync")
    summary["held_out_sampled_rise"] = {arm: mean_rise(arm, "held_out_sampled_rise") for arm in ARMS}
    summary |= {
        "model": str(a.model or f"issue 34's Llama (init seed {a.init_seed})"),
        "prompt_format": a.prompt_format,
    }
    summary["trl"] = "skipped: trl is not installed (uv run --group bench)" if trl_skipped else "ran"
    print(json.dumps({**summary, "seeds": results}))


if __name__ == "__main__":
    main()
