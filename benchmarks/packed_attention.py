"""Packed-row attention on CPU: the trainer's forward and backward of one packed row with the row cut into chunks of
whole samples (arbor.models.attention.SegmentMask, what the trainer does) against SDPA over the row's dense
`[T, T]` mask (what it did before), same model, same rows, one run.

Both arms call `arbor.trainer.forward.packed_logprobs` and backpropagate the mean logprob; only the mask differs
(the dense arm patches the model class's `accepts_segment_mask` to False). Arms alternate after a warm-up so that
load on the machine hits both alike. Reported: non-padding tokens per second of each arm over the median of `--repeats`
steps, their ratio chunked / dense (target >= 1.5 on the default shape), and the largest logprob difference
between the arms (the same values within float rounding). The transformers path (`--impl transformers` with a
checkpoint directory) cuts rows on CUDA too; arbor's native models use FlexAttention block masks there, so the
native arm is a CPU figure. Besides, `tree` times attention alone over one merged RL row whose groups share a
root (`--tree`: a cascaded `SegmentMask` against the dense mask). Last line: `{"benchmark": "packed_attention",
"value": chunked/dense, ..., "tree": {"ratio": dense/cascade, ...}}`.

    uv run python benchmarks/packed_attention.py [--model qwen3-small] [--row-tokens 2048] [--sample-tokens 40 300]

Measured (2026-12-02, one thread, defaults): 1.86-1.93x; the figures for other shapes are in docs/training.md
("Prefix-tree merged training").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from unittest import mock

import torch
from smoke import parse_args

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.attention import SegmentMask, attend, position_ids_for, segment_mask, tree_mask
from arbor.trainer.forward import packed_logprobs
from arbor.trainer.parallel_state import ParallelState

TARGET = 1.5


def packed_row(vocab: int, row_tokens: int, low: int, high: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Ids of one row filled with samples of `low..high` tokens (the last cut to fit), and their lengths."""
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < row_tokens:
        lens.append(min(int(torch.randint(low, high + 1, (1,), generator=gen)), row_tokens - sum(lens)))
    return torch.randint(3, vocab, (row_tokens,), generator=gen), lens


def step(model: torch.nn.Module, ids: torch.Tensor, lens: list[int], chunked: bool) -> tuple[float, torch.Tensor]:
    """One forward and backward of the row (dense: with the model's class refusing chunks); seconds, logprobs."""
    refuse = (
        contextlib.nullcontext()
        if chunked
        else mock.patch.object(type(model), "accepts_segment_mask", False, create=True)
    )
    model.zero_grad(set_to_none=True)
    positions = position_ids_for(lens)[0]
    with refuse:
        t = time.perf_counter()
        lp, _ = packed_logprobs(model, ids, positions, lens, 1.0, torch.device("cpu"), False, state=ParallelState())
        lp.mean().backward()
        return time.perf_counter() - t, lp.detach()


def tree_row(root: int, groups: int, prompt: int, completion: int, group: int) -> torch.Tensor:
    """`subtree_end` of one merged RL row: a `root` shared by every prompt (a chat template's first tokens, a
    system prompt), then per group its own `prompt` tokens and `group` completions of `completion` tokens."""
    T = root + groups * (prompt + group * completion)
    ends, at = [T] * root, root
    for _ in range(groups):
        ends += [at + prompt + group * completion] * prompt
        at += prompt
        for _ in range(group):
            ends += [at + completion] * completion
            at += completion
    return torch.tensor(ends)


def tree_ratio(shape: list[int], repeats: int) -> dict:
    """Attention forward and backward (8 query / 4 KV heads of 64) of a `tree_row`: cascaded chunks against the
    dense mask; seconds are medians of `repeats` after one warm-up."""
    end = tree_row(*shape)
    T, seg = end.shape[0], segment_mask(end)
    seconds = {}
    for arm, mask in (("cascade", seg), ("dense", tree_mask(end))):
        q, k, v = (torch.randn(1, h, T, 64, requires_grad=True) for h in (8, 4, 4))
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            attend(q, k, v, mask, True).sum().backward()
            times.append(time.perf_counter() - t)
        seconds[arm] = statistics.median(times[1:])
    print(
        f"tree row of {T} tokens ({type(seg).__name__}): cascade {seconds['cascade'] * 1e3:.1f} ms, dense "
        f"{seconds['dense'] * 1e3:.1f} ms"
    )
    return {"tokens": T, "cut": isinstance(seg, SegmentMask), "ratio": round(seconds["dense"] / seconds["cascade"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-small", help="a preset or a checkpoint directory")
    p.add_argument("--impl", default="auto", choices=["auto", "native", "transformers"])
    p.add_argument("--row-tokens", type=int, default=2048)
    p.add_argument("--sample-tokens", type=int, nargs=2, default=[40, 300], metavar=("LOW", "HIGH"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--tree",
        type=int,
        nargs=5,
        default=[200, 6, 40, 30, 8],
        metavar=("ROOT", "GROUPS", "PROMPT", "COMPLETION", "GROUP"),
        help="the merged RL row whose attention is timed besides (tree_row)",
    )
    tiny = dict(model="qwen3-test", row_tokens=128, sample_tokens=[8, 40], repeats=1, warmup=0, tree=[15, 3, 17, 5, 4])
    a = parse_args(p, **tiny)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=a.model, tokenizer="byte", impl=a.impl))
    ids, lens = packed_row(256, a.row_tokens, *a.sample_tokens, seed=0)
    seconds: dict[str, list[float]] = {"chunked": [], "dense": []}
    logprobs: dict[str, torch.Tensor] = {}
    for i in range(a.warmup + a.repeats):
        for arm in ("chunked", "dense"):
            s, logprobs[arm] = step(model, ids, lens, arm == "chunked")
            if i >= a.warmup:
                seconds[arm].append(s)
    tps = {arm: a.row_tokens / statistics.median(s) for arm, s in seconds.items()}
    ratio = tps["chunked"] / tps["dense"]
    diff = float((logprobs["chunked"] - logprobs["dense"]).abs().max())
    print(f"{a.model}: {len(lens)} samples in a {a.row_tokens}-token row, {a.threads} thread(s)")
    for arm in seconds:
        print(f"  {arm:8s} {tps[arm]:10.0f} tokens/s (median of {len(seconds[arm])} steps)")
    print(f"chunked / dense: {ratio:.2f}x (target >= {TARGET}), largest logprob difference {diff:.1e}")
    result = {
        "benchmark": "packed_attention",
        "value": round(ratio, 3),
        "target": TARGET,
        "ok": ratio >= TARGET,
        "chunked_tokens_per_s": round(tps["chunked"]),
        "dense_tokens_per_s": round(tps["dense"]),
        "max_abs_difference": diff,
        "samples": len(lens),
        "row_tokens": a.row_tokens,
        "tree": tree_ratio(a.tree, a.repeats),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
