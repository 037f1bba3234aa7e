"""MTP draft heads trained online against heads frozen at step 0, and speculative decoding's decode speed, one run.

Two real `rl` runs on CPU (reverse_text, a model with one MTP module, speculative decoding on, same seed) differ
only in `trainer.draft.enabled`: "online" trains the MTP module every step with the top-K KL to the policy
(arbor.trainer.draft), "frozen" keeps it as it was at step 0 while the policy moves. Each step's acceptance rate
(`spec/acceptance_rate` in metrics.jsonl: drafts accepted / drafted while generating that step's rollouts) is
read back (the two runs go side by side; a completed run already in `--output-dir` is read, not rerun); the
start is the mean of the first `--window` steps, the end the mean of the last `--window`.
Target: online ends at >= 0.9 of its start while frozen ends below its own start.

Then decode speed: the online run's final weights serve the same requests (`--requests` reverse_text-like
prompts, `--batch` at a time, temperature 1) in the local engine with and without speculation (`--draft-tokens`
drafts), one pair of measurements per repeat with the arms' order alternating; decode tokens/s = tokens appended
by decode steps / seconds in decode steps (the engine's own counters). The speed-up is the median of the paired
ratios (a pair shares the machine's state of the moment; single 0.3 s measurements on this shared VM varied by
up to 2x). Runs are read back only when their settings (`bench_settings.json`) match. Target: >= 1.5x. On a
tiny model the draft module is a large share of a forward (one block of the decoder's few, plus the head), and on
a loaded shared CPU timings vary by tens of percent.

Measured on a shared 2-core CPU (qwen3-tiny-mtp, 3 drafts, batch 8): online 0.927 -> 0.966 (x1.04), frozen
0.947 -> 0.943 (x1.00: its passthrough start from the last layer is a good draft while the 30 steps leave the
policy spread out, so it barely falls), decode 297 -> 505 tokens/s = 1.70x at acceptance 0.959.

Measured again on the idle machine (load < 1): the same run, online 0.927 -> 0.966, frozen 0.947 -> 0.943, decode
1607 -> 2155 tokens/s = 1.34x at acceptance 0.959 (plain decoding is fast enough idle that drafting and
verifying cost more of the gain); with `--steps 100` online 0.927 -> 0.914 and frozen 0.947 -> 0.955 (reward
0.06 -> 0.20 in both: at temperature 1 the policy stays spread out, so even the frozen draft keeps ~0.95), decode
1.15x at acceptance 0.836. The targets hold only under load here; a model whose policy sharpens is the test.

With `--sft-steps 60` (the reverse_text example's warm-up, which now fits the drafts too: `sft.draft`) the policy
RL starts from is sharp (reward 0.47), and the one-block MTP module does not keep up with it: `sft/draft_kl` rose
from 0.001 to 0.34 over the warm-up, `draft/kl` stayed at 0.5-0.8 over 30 RL steps at lr 3e-3 (the policy moving
fast too: reward 0.47 -> 0.36 online, 0.28 frozen), acceptance online 0.346 -> 0.282, frozen 0.331 -> 0.354, decode
0.55x at acceptance 0.26 (2,802 plain against 1,543 speculative tokens/s; load average 4). Drafts for a sharp policy
need far more training than the policy's own warm-up (DeepSeek-V3 trains its MTP modules through pre-training).

After drawing every uniform a row needs per step at once and sampling drafts, acceptance and the last token
batched over the rows (arbor.inference.speculative; the speculative step went from 9.4 to 7.1 ms at batch 8),
idle machine, same 30-step runs (online 0.930 -> 0.974, x1.05; frozen 0.956 -> 0.942, x0.99): paired-median
speed-up 1.44x, 1.50x, 1.39x (three invocations, acceptance 0.98; before the change 1.13-1.33x in the same
side-by-side measurement); `--draft-tokens 4`: 1.49x, with frozen heads x1.01. The speed target sits at the edge
of this machine's noise, and the frozen heads' fall (x0.99) is within it: the heads criterion needs a policy
that moves further than 30 steps from a random preset take it.

Last line: `{"benchmark": "mtp_speculative", "value": speedup, "target": 1.5, "ok": ..., ...}`.

    uv run python benchmarks/mtp_speculative.py [--model qwen3-tiny-mtp] [--steps 30] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from arbor.config.model import ModelConfig
from arbor.inference.engine import Engine
from arbor.inference.sampling import SamplingParams
from arbor.models import build_model, build_tokenizer
from arbor.models.hf import load_weights
from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import broadcast_dir

SETTINGS = "bench_settings.json"
"""Written into each arm's run directory: a later invocation reads a run back only if its settings match."""
RUN = [
    "--seq-len", "64", "--orchestrator.scheduler.mode", "sync",
    "--orchestrator.batch-size", "64", "--orchestrator.group-size", "8", "--orchestrator.sampling.max-tokens", "24",
    "--orchestrator.environment.id", "reverse_text",
    "--orchestrator.environment.args", "{ min_len = 3, max_len = 8, alphabet = \"abcdefgh\" }",
    "--trainer.optim.lr", "3e-3", "--trainer.num-threads", "1", "--inference.num-threads", "1",
    "--inference.max-batch-size", "64", "--inference.speculative.enabled", "true",
]


def rl_argv(out: Path, model: str, steps: int, draft_tokens: int, online: bool, sft_steps: int) -> list[str]:
    return [sys.executable, "-m", "arbor.launch.rl", "--output-dir", str(out), "--model.name", model,
            "--max-steps", str(steps), "--inference.speculative.draft-tokens", str(draft_tokens),
            "--trainer.draft.enabled", "true" if online else "false", *RUN,
            "--sft.steps", str(sft_steps), "--sft.batch-size", "64", "--sft.lr", "3e-3"]


def acceptance(out: Path, steps: int, settings: dict) -> list[float] | None:
    """Each step's acceptance rate of a completed run in `out` with these `settings` (None if it has not run all
    `steps`, or ran with other settings)."""
    if not (out / SETTINGS).exists() or json.loads((out / SETTINGS).read_text()) != settings:
        return None
    rows = read_jsonl(out / "metrics.jsonl")
    return [r["spec/acceptance_rate"] for r in rows] if len(rows) >= steps else None


def rl_runs(root: Path, model: str, steps: int, draft_tokens: int, sft_steps: int) -> dict[str, list[float]]:
    """Both arms' acceptance rates. The runs go side by side, so machine load hits both alike; an arm whose
    directory already holds a completed run (a previous invocation with this `--output-dir`) is read back."""
    settings = {"model": model, "steps": steps, "draft_tokens": draft_tokens, "sft_steps": sft_steps}
    procs = {}
    for arm in ("online", "frozen"):
        if acceptance(root / arm, steps, settings) is None:
            shutil.rmtree(root / arm, ignore_errors=True)
            argv = rl_argv(root / arm, model, steps, draft_tokens, arm == "online", sft_steps)
            procs[arm] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for arm, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"rl run in {root / arm} failed:\n{err[-4000:]}")
        (root / arm / SETTINGS).write_text(json.dumps(settings))
    return {arm: acceptance(root / arm, steps, settings) for arm in ("online", "frozen")}  # type: ignore[misc]


def decode_speed(model: torch.nn.Module, tokenizer, draft_tokens: int, batch: int, requests: int, max_tokens: int,
                 seed: int) -> tuple[float, float]:
    """(decode tokens/s, acceptance rate) of one engine serving `requests` requests, `batch` at a time."""
    gen = torch.Generator().manual_seed(seed)
    letters = [ord(c) for c in "abcdefgh"]
    prompts = [[letters[int(i)] for i in torch.randint(0, 8, (8,), generator=gen)] for _ in range(requests)]
    with Engine(model, tokenizer, seq_len=128, max_batch_size=batch, draft_tokens=draft_tokens) as engine:
        futures = [engine.submit(p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i))
                   for i, p in enumerate(prompts)]
        for f in futures:
            f.result(600)
        s = engine.stats()
    return s.decode_tokens / s.decode_seconds, s.accepted_draft_tokens / max(s.draft_tokens, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-tiny-mtp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    ap.add_argument("--sft-steps", type=int, default=0,
                    help="SFT warm-up of both arms (it fits the drafts too); 0 starts RL from the random preset")
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="concurrent requests in the speed measurement")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--requests", type=int, default=32, help="requests per speed measurement, --batch at a time")
    ap.add_argument("--repeats", type=int, default=7, help="paired speed measurements (plain and speculative)")
    ap.add_argument("--output-dir", default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args()
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="arbor-mtp-bench-"))
    rates = rl_runs(root, args.model, args.steps, args.draft_tokens, args.sft_steps)
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
        # one pair per repeat, the arms' order alternating, so that a drift of the machine's speed hits both
        for k in (0, args.draft_tokens) if r % 2 == 0 else (args.draft_tokens, 0):
            tps, acc = decode_speed(model, tokenizer, k, args.batch, args.requests, args.max_tokens, seed=1000 * r)
            speeds[k].append(tps)
            if k:
                acceptance.append(acc)
    plain, spec = statistics.median(speeds[0]), statistics.median(speeds[args.draft_tokens])
    speedup = statistics.median(s / p for s, p in zip(speeds[args.draft_tokens], speeds[0]))
    print(f"decode tokens/s without / with speculation ({args.draft_tokens} drafts, batch {args.batch}): medians "
          f"{plain:.0f} / {spec:.0f}, median of the {args.repeats} paired ratios {speedup:.2f}x at acceptance "
          f"{statistics.mean(acceptance):.3f} (target >= 1.5x)")
    heads_ok = ratio["online"] >= 0.9 and ratio["frozen"] < 1.0
    print(json.dumps({
        "benchmark": "mtp_speculative", "value": round(speedup, 3), "target": 1.5,
        "ok": bool(speedup >= 1.5 and heads_ok), "heads_ok": heads_ok,
        "online_ratio": round(ratio["online"], 3), "frozen_ratio": round(ratio["frozen"], 3),
        "online_acceptance": [round(x, 3) for x in ends["online"]],
        "frozen_acceptance": [round(x, 3) for x in ends["frozen"]],
        "acceptance_at_speed": round(statistics.mean(acceptance), 3),
        "decode_tokens_per_s": {"plain": round(plain, 1), "speculative": round(spec, 1)},
        "model": args.model, "steps": args.steps, "sft_steps": args.sft_steps, "draft_tokens": args.draft_tokens,
        "batch": args.batch,
    }))


if __name__ == "__main__":
    main()
