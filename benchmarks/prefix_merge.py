"""Prefix-tree merged training against unmerged training on multi-turn agent batches, one run.

The batch is what an agent environment produces for one task: 8 rollouts that start from the same system prompt
and the same conversation history, each running 8 turns (an assistant message, then a tool result); some
rollouts truncate their context part-way (keep the system prompt and the last turns), which branches their
trajectory into a second sample that shares only the system prompt with the rest. Both arms pack the same
rollouts with `arbor.orchestrator.batcher.build_step_batches` (prefix_merge off / on, same row budget) and time
`arbor.trainer.step.train_step` (forward + backward of the real model, the loss, AdamW) on one CPU rank.

Printed: the ideal ratio (tokens / trie tokens of the whole step), the ratio the rows achieve (a trie never
spans rows), the measured step speedup (median unmerged time / median merged time; arms alternate after a
warm-up so machine load hits both alike) and the fraction of the ideal achieved (target >= 0.7). Last line:
`{"benchmark": "prefix_merge", "value": fraction, "target": 0.7, "ok": ..., ...}`.

The token ratio is the ideal of the work linear in tokens. On CPU both arms attend with dense row masks, whose
cost grows with the square of the row length, and merged rows are shorter, so the fraction can exceed 1; timings
on a shared machine vary by tens of percent between runs.

    uv run python benchmarks/prefix_merge.py [--model qwen3-tiny] [--repeats 5] [--row-tokens 3072]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from smoke import parse_args

from arbor.config.model import ModelConfig
from arbor.config.trainer import LossConfig
from arbor.models import build_model, model_args
from arbor.orchestrator.batcher import build_step_batches, sample_arrays
from arbor.orchestrator.prefix_tree import trie_size
from arbor.orchestrator.rollout import Rollout
from arbor.trainer.loss import resolve_loss
from arbor.trainer.step import train_step


def agent_rollouts(
    vocab: int,
    rollouts: int = 8,
    turns: int = 8,
    system: int = 128,
    history: int = 384,
    assistant: int = 12,
    tool: int = 20,
    truncate_every: int = 3,
    truncate_at: int = 4,
    keep_turns: int = 2,
    seed: int = 0,
) -> list[Rollout]:
    """Samples of one task's group. A rollout whose index is a multiple of `truncate_every` truncates its context
    after turn `truncate_at` (system prompt + its last `keep_turns` turns), so it yields two samples."""
    g = np.random.default_rng(seed)

    def toks(n: int) -> list[int]:
        return g.integers(3, vocab, n).tolist()

    sys_ids, hist_ids = toks(system), toks(history)
    out: list[Rollout] = []
    for r in range(rollouts):
        turn_ids = [toks(assistant) + toks(tool) for _ in range(turns)]
        cuts = [truncate_at] if truncate_every and r % truncate_every == 0 and truncate_at < turns else []
        segments, start, prompt = [], 0, sys_ids + hist_ids
        for cut in cuts + [turns]:
            segments.append((prompt, [t for turn in turn_ids[start:cut] for t in turn]))
            prompt = sys_ids + [t for turn in turn_ids[max(0, cut - keep_turns) : cut] for t in turn]
            start = cut
        for prompt_ids, completion in segments:
            n = len(completion)
            out.append(
                Rollout(
                    0,
                    prompt_ids,
                    completion,
                    (-1.0 - g.random(n)).tolist(),
                    [0] * n,
                    "",
                    "stop",
                    advantage=float(g.normal()),
                    group_id=0,
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--rollouts", type=int, default=8, help="rollouts of the task's group")
    ap.add_argument("--turns", type=int, default=8, help="turns per rollout (those past the 4th branch some)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--row-tokens", type=int, default=3072, help="micro_batch_tokens of both arms")
    ap.add_argument("--threads", type=int, default=2)
    args = parse_args(ap, model="qwen3-test", rollouts=4, turns=5, repeats=1, row_tokens=1024, threads=1)
    torch.set_num_threads(args.threads)

    cfg = ModelConfig(name=args.model)
    rollouts = agent_rollouts(model_args(cfg).vocab_size, rollouts=args.rollouts, turns=args.turns)
    tokens = sum(r.num_tokens for r in rollouts)
    ideal = tokens / trie_size([sample_arrays(r) for r in rollouts])
    batches = {
        merge: build_step_batches(rollouts, 0, 1, args.row_tokens, 1.0, 0, "token", merge)[0] for merge in (False, True)
    }
    rows = {m: [mb.num_tokens for mb in b.micro_batches] for m, b in batches.items()}
    achieved = tokens / sum(rows[True])

    model = build_model(cfg)
    model.train()
    loss_fn, loss_cfg = resolve_loss("ppo_clip"), LossConfig()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cpu = torch.device("cpu")
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.repeats + 1):  # the first round warms up both arms
        for merge in (False, True) if rep % 2 == 0 else (True, False):
            t0 = time.perf_counter()
            train_step(model, optimizer, batches[merge], loss_fn, loss_cfg, 1.0, cpu)
            if rep:
                times[merge].append(time.perf_counter() - t0)
    unmerged, merged = statistics.median(times[False]), statistics.median(times[True])
    speedup = unmerged / merged
    fraction = speedup / ideal
    print(f"samples {len(rollouts)}, tokens {tokens}, rows unmerged {rows[False]}, rows merged {rows[True]}")
    print(f"ideal ratio (tokens / trie tokens)    {ideal:.2f}")
    print(f"ratio of the merged rows              {achieved:.2f}")
    print(f"step time unmerged / merged           {unmerged:.3f} s / {merged:.3f} s (median of {args.repeats})")
    print(f"measured speedup                      {speedup:.2f}x")
    print(f"fraction of the ideal achieved        {fraction:.2f} (target >= 0.7)")
    print(
        json.dumps(
            {
                "benchmark": "prefix_merge",
                "value": round(fraction, 3),
                "target": 0.7,
                "ok": fraction >= 0.7,
                "ideal_ratio": round(ideal, 3),
                "row_ratio": round(achieved, 3),
                "speedup": round(speedup, 3),
                "step_s_unmerged": round(unmerged, 4),
                "step_s_merged": round(merged, 4),
                "tokens": tokens,
                "trie_tokens": sum(rows[True]),
                "samples": len(rollouts),
                "model": args.model,
                "row_tokens": args.row_tokens,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
