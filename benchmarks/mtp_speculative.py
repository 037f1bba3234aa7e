"""MTP draft heads trained online against heads frozen at step 0, and speculative decoding's decode speed, one run.

Two real `rl` runs on CPU (reverse_text, a model with one MTP module, speculative decoding on, same seed) differ
only in `trainer.draft.enabled`: "online" trains the MTP module every step with the top-K KL to the policy
(arbor.trainer.draft), "frozen" keeps it as it was at step 0 while the policy moves. Both start from the same
short SFT warm-up (`--sft-steps`, which fits the drafts too: `sft.draft`), so that RL starts from a policy that
has learnt the task's format and moves from there; from the random preset the policy stays spread out over 30
steps and even a frozen draft keeps ~0.95. Each step's acceptance rate (`spec/acceptance_rate` in metrics.jsonl:
drafts accepted / drafted while generating that step's rollouts) is read back (the two runs go side by side; a
completed run already in `--output-dir` is read, not rerun); the start is the mean of the first `--window`
steps, the end the mean of the last `--window`. Target: online ends at >= 0.9 of its start while frozen ends
below its own start.

Then decode speed: the online run's final weights serve `--requests` prompts of the run's own environment (the
chat template, tasks drawn with another seed), `--batch` at a time, sampled as in the run (temperature 1, the
same max_tokens), in the local engine with and without speculation (`--draft-tokens` drafts); one pair of
measurements per repeat with the arms' order alternating; decode tokens/s = tokens appended by decode steps /
seconds in decode steps (the engine's own counters). The speed-up is the median of the paired ratios (a pair
shares the machine's state of the moment; single 0.3 s measurements on this shared VM varied by up to 2x). Runs
are read back only when their settings (`bench_settings.json`) match. Target: >= 1.5x.

The model is `qwen3-deep-mtp` (12 layers): speculation pays when a draft costs a small share of a target
forward, and the MTP module is one decoder block. In real MTP models it is one block beside dozens (DeepSeek-V3:
61); in the 4-layer `qwen3-tiny-mtp` it is a quarter of the decoder, and three drafts cost about as much as a
forward, so the gain there is mostly gone (1.17x at acceptance 0.88, against 1.81x for the 12-layer preset, both
from the random preset on the idle machine).

Measured on the idle 2-core machine (defaults: qwen3-deep-mtp, SFT 20 steps, 30 RL steps at lr 1e-3, 3 drafts,
batch 8): online 0.970 -> 0.954 (x0.98), frozen 0.947 -> 0.694 (x0.73); decode 923 -> 1460 tokens/s, median
paired ratio 1.55x at acceptance 0.926 (a second invocation reading the same runs back: 1.60x; a fresh third,
whose frozen arm did not collapse: frozen x0.92, 1.46x). The frozen arm's last steps in the first include two
where the policy briefly collapsed (below).

Then the MTP cache of the prompt moved into the prefill (arbor.inference.engine.speculative: before, the first decode
step after a request joined caught the module up over its whole prompt, padding every row of the batch to that
length, and with the trained policy's short completions, 8-12 tokens, and 64 requests through 8 slots nearly
every step had a newcomer): the speculative step went from 15.8 to 12.3 ms at batch 8, and the third
invocation's runs, read back, gave 931 -> 1675 tokens/s, 1.79x at acceptance 0.925.

History, and what it showed:
- From the random preset (`--sft-steps 0`, qwen3-tiny-mtp, lr 3e-3, the earlier defaults): online 0.930 ->
  0.974, frozen 0.956 -> 0.942 (x0.99): the frozen heads' fall was within noise, since the policy barely moves;
  the speed-up 1.39-1.50x at acceptance 0.98 on raw letter prompts, where the policy is spread out.
- With `--sft-steps 60` the policy RL starts from is sharp (reward 0.47) and the one-block module of the 4-layer
  preset does not keep up with it: acceptance ~0.3, decode 0.55x.
- After the SFT warm-up, lr 3e-3 moved the 12-layer preset's weights by ~5% a step and the policy collapsed now
  and then to near-uniform output for a step or two (entropy 5.5 nats, every completion truncated, reward 0,
  then back), with or without speculation (the same happened in a plain-decoding run), so not the drafts. In
  the collapsed weights the residual stream is dominated by one large activation of layer 0's MLP (norm ~67
  against the stream's ~8 per channel): the last layers add ~4 to it, against ~34 one step later, and the final
  norm then leaves little but that one direction, whose logits are nearly flat. A few percent of weight change
  tips the balance, a property of this narrow 12-layer model under Adam's lr-sized steps on a flat reward. lr
  1e-3 with a 3-step warm-up makes it rarer; it still shows once or twice in 30 steps.

Last line: `{"benchmark": "mtp_speculative", "value": speedup, "target": 1.5, "ok": ..., ...}`.

    uv run python benchmarks/mtp_speculative.py [--model qwen3-deep-mtp] [--sft-steps 20] [--steps 30] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import torch
from smoke import parse_args

from arbor.config.model import ModelConfig
from arbor.environments.protocol import env_prompt_ids
from arbor.environments.reverse_text import ReverseTextEnv
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.models import build_model, build_tokenizer
from arbor.models.hf import load_weights
from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import broadcast_dir

SETTINGS = "bench_settings.json"
"""Written into each arm's run directory: a later invocation reads a run back only if its settings match."""
ENV_ARGS = '{ min_len = 3, max_len = 8, alphabet = "abcdefgh" }'
MAX_TOKENS = 24
RL_BATCH = 64
"""Samples per RL step and the inference server's slots, as RUN passes them (`--rl-batch`; 8 per prompt)."""
RUN = [
    "--seq-len",
    "64",
    "--orchestrator.scheduler.mode",
    "sync",
    "--orchestrator.batch-size",
    "64",
    "--orchestrator.group-size",
    "8",
    "--orchestrator.sampling.max-tokens",
    str(MAX_TOKENS),
    "--orchestrator.environment.id",
    "reverse_text",
    "--orchestrator.environment.args",
    ENV_ARGS,
    # After the SFT warm-up, lr 3e-3 moves the weights of the 12-layer preset by ~5% a step: the policy
    # collapsed to uniform output for a step or two now and then (entropy 5.5 nats, reward 0), with or without
    # speculation. A warm-up, as Adam's first steps move every weight by about lr.
    "--trainer.optim.lr",
    "1e-3",
    "--trainer.lr-schedule.warmup-steps",
    "3",
    "--trainer.num-threads",
    "1",
    "--inference.num-threads",
    "1",
    "--inference.max-batch-size",
    "64",  # RL_BATCH
    "--inference.speculative.enabled",
    "true",
]


def rl_argv(
    out: Path, model: str, steps: int, draft_tokens: int, online: bool, sft_steps: int, batch: int = RL_BATCH
) -> list[str]:
    # another `batch` (`--rl-batch`) overrides RUN's, as later arguments win
    other = (
        [] if batch == RL_BATCH else ["--orchestrator.batch-size", str(batch), "--inference.max-batch-size", str(batch)]
    )
    return [
        sys.executable,
        "-m",
        "arbor.launch.rl",
        "--output-dir",
        str(out),
        "--model.name",
        model,
        "--max-steps",
        str(steps),
        "--inference.speculative.draft-tokens",
        str(draft_tokens),
        "--trainer.draft.enabled",
        "true" if online else "false",
        *RUN,
        *other,
        "--sft.steps",
        str(sft_steps),
        "--sft.batch-size",
        "64",
        "--sft.lr",
        "3e-3",
        "--sft.num-threads",
        "1",
    ]  # the arms run side by side: two processes of 2 threads thrash on 2 cores


def acceptance(out: Path, steps: int, settings: dict) -> list[float] | None:
    """Each step's acceptance rate of a completed run in `out` with these `settings` (None if it has not run all
    `steps`, or ran with other settings)."""
    if not (out / SETTINGS).exists() or json.loads((out / SETTINGS).read_text()) != settings:
        return None
    rows = read_jsonl(out / "metrics.jsonl")
    return [r["spec/acceptance_rate"] for r in rows] if len(rows) >= steps else None


def rl_runs(
    root: Path, model: str, steps: int, draft_tokens: int, sft_steps: int, batch: int = RL_BATCH
) -> dict[str, list[float]]:
    """Both arms' acceptance rates. The runs go side by side, so machine load hits both alike; an arm whose
    directory already holds a completed run (a previous invocation with this `--output-dir`) is read back."""
    settings = {"model": model, "steps": steps, "draft_tokens": draft_tokens, "sft_steps": sft_steps, "run": RUN}
    if batch != RL_BATCH:
        settings["rl_batch"] = batch
    procs = {}
    for arm in ("online", "frozen"):
        if acceptance(root / arm, steps, settings) is None:
            shutil.rmtree(root / arm, ignore_errors=True)
            argv = rl_argv(root / arm, model, steps, draft_tokens, arm == "online", sft_steps, batch)
            procs[arm] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for arm, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"rl run in {root / arm} failed:\n{err[-4000:]}")
        (root / arm / SETTINGS).write_text(json.dumps(settings))
    return {arm: acceptance(root / arm, steps, settings) for arm in ("online", "frozen")}  # type: ignore[misc]


def decode_speed(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    draft_tokens: int,
    batch: int,
    max_tokens: int,
    seed: int,
) -> tuple[float, float]:
    """(decode tokens/s, acceptance rate) of one engine serving `prompts`, `batch` at a time, sampled as in the
    RL run (temperature 1)."""
    with Engine(model, tokenizer, seq_len=128, max_batch_size=batch, draft_tokens=draft_tokens) as engine:
        futures = [
            engine.submit(p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i))
            for i, p in enumerate(prompts)
        ]
        for f in futures:
            f.result(600)
        s = engine.stats()
    return s.decode_tokens / s.decode_seconds, s.accepted_draft_tokens / max(s.draft_tokens, 1)


def task_prompts(tokenizer, requests: int, seed: int) -> list[list[int]]:
    """`requests` prompts of the RL run's environment (its args, the chat template), drawn with another seed
    than the run's: the distribution the drafts were trained on."""
    env = ReverseTextEnv(**tomllib.loads(f"args = {ENV_ARGS}")["args"])
    tasks = random.Random(seed).sample(env.dataset(seed), requests)
    return [env_prompt_ids(env, task, tokenizer) for task in tasks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-deep-mtp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    ap.add_argument(
        "--sft-steps",
        type=int,
        default=20,
        help="SFT warm-up of both arms (it fits the drafts too); 0 starts RL from the random preset",
    )
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="concurrent requests in the speed measurement")
    ap.add_argument("--requests", type=int, default=64, help="requests per speed measurement, --batch at a time")
    ap.add_argument("--repeats", type=int, default=7, help="paired speed measurements (plain and speculative)")
    ap.add_argument("--output-dir", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--rl-batch", type=int, default=RL_BATCH, help="samples per RL step (8 per prompt)")
    args = parse_args(
        ap,
        model="qwen3-test-mtp",
        steps=2,
        window=1,
        sft_steps=0,
        draft_tokens=2,
        batch=2,
        requests=2,
        repeats=1,
        rl_batch=16,
    )
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="arbor-mtp-bench-"))
    rates = rl_runs(root, args.model, args.steps, args.draft_tokens, args.sft_steps, args.rl_batch)
    w = args.window
    ends = {arm: (statistics.mean(r[:w]), statistics.mean(r[-w:])) for arm, r in rates.items()}
    ratio = {arm: end / start for arm, (start, end) in ends.items()}
    for arm, (start, end) in ends.items():
        print(f"{arm:>6} heads: acceptance {start:.3f} (first {w} steps) -> {end:.3f} (last {w}), x{ratio[arm]:.2f}")

    torch.set_num_threads(1)
    cfg = ModelConfig(name=args.model)
    model, tokenizer = build_model(cfg), build_tokenizer(cfg)
    load_weights(model, broadcast_dir(root / "online", args.steps))
    speeds: dict[int, list[float]] = {0: [], args.draft_tokens: []}
    acceptance = []
    for r in range(args.repeats):
        prompts = task_prompts(tokenizer, args.requests, seed=1000 + r)  # the same for both arms of a pair
        # one pair per repeat, the arms' order alternating, so that a drift of the machine's speed hits both
        for k in (0, args.draft_tokens) if r % 2 == 0 else (args.draft_tokens, 0):
            tps, acc = decode_speed(model, tokenizer, prompts, k, args.batch, MAX_TOKENS, seed=1000 * r)
            speeds[k].append(tps)
            if k:
                acceptance.append(acc)
    plain, spec = statistics.median(speeds[0]), statistics.median(speeds[args.draft_tokens])
    speedup = statistics.median(s / p for s, p in zip(speeds[args.draft_tokens], speeds[0]))
    print(
        f"decode tokens/s without / with speculation ({args.draft_tokens} drafts, batch {args.batch}): medians "
        f"{plain:.0f} / {spec:.0f}, median of the {args.repeats} paired ratios {speedup:.2f}x at acceptance "
        f"{statistics.mean(acceptance):.3f} (target >= 1.5x)"
    )
    heads_ok = ratio["online"] >= 0.9 and ratio["frozen"] < 1.0
    print(
        json.dumps(
            {
                "benchmark": "mtp_speculative",
                "value": round(speedup, 3),
                "target": 1.5,
                "ok": bool(speedup >= 1.5 and heads_ok),
                "heads_ok": heads_ok,
                "online_ratio": round(ratio["online"], 3),
                "frozen_ratio": round(ratio["frozen"], 3),
                "online_acceptance": [round(x, 3) for x in ends["online"]],
                "frozen_acceptance": [round(x, 3) for x in ends["frozen"]],
                "acceptance_at_speed": round(statistics.mean(acceptance), 3),
                "decode_tokens_per_s": {"plain": round(plain, 1), "speculative": round(spec, 1)},
                "model": args.model,
                "steps": args.steps,
                "sft_steps": args.sft_steps,
                "draft_tokens": args.draft_tokens,
                "batch": args.batch,
            }
        )
    )


if __name__ == "__main__":
    main()
