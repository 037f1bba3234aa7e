"""Context-parallel memory: peak memory of one forward + backward of the trainer's packed logprobs under cp = 2
(gloo, 2 CPU ranks) at several sequence lengths, for each cp style (Ulysses, ring, DSA), on a tiny preset model.

What it shows: no buffer quadratic in the sequence. Ulysses attends one document at a time through a flash
kernel (no mask), ring attention scores a block of queries at a time and recomputes it in the backward, and
DSA-CP builds the indexer's mask one query block at a time (arbor.trainer.context_parallel, arbor.trainer.dsa_cp).
The score is the growth exponent between the two longest lengths, `log2(peak(2T) / peak(T))` per doubling,
the worst over the styles: 1 is linear, 2 quadratic; target <= 1.15 (the model's own activations are linear).

One pair of processes (2 ranks) measures every style and length in turn, each on a model of its own and one
row of one document filling the sequence, as a long sample does; rank 0 reports, per (style, length), the peak of
the bytes torch's allocator holds over that forward and backward alone (what earlier ones held is freed), from
the profiler's memory events (every tensor allocation and free, summed in time order): the tensors that exist
at once, which is what grows with the sequence (the resident set adds the C allocator's caching and the
profiler's own buffers, too noisy at these sizes to score).

    uv run python benchmarks/cp_memory.py [--lengths 2048,4096,8192,16384] [--styles ulysses,ring,dsa]

On 2 CPU cores (2026-11-28, torch 2.13, defaults; allocated MiB at 2k / 4k / 8k / 16k tokens): Ulysses 8.5 / 16.9 /
33.8 / 69.1, ring 53.6 / 107.7 / 215.3 / 431.4 (its `[H, 512, Tl]` fp32 score blocks), DSA 10.6 / 21.2 / 43.1 /
86.2 -> growth exponents 1.03, 1.00, 1.00 (target <= 1.15, met). Before this change Ulysses built a `[T, T]` mask and
SDPA's fp32 scores over it (2 GiB of scores alone per rank at 16k with qwen3-test's 2 heads per rank), ring a
`[Tl, Tl]` mask and `[H, Tl, Tl]` scores per chunk kept for the backward, DSA-CP a `[Tl, T]` mask per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from smoke import parse_args
from torch.profiler import ProfilerActivity, profile

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.attention import position_ids_for
from arbor.trainer.context_parallel import apply_cp
from arbor.trainer.dsa_cp import apply_dsa_cp
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import packed_logprobs

TARGET = 1.15
MODELS = {"ulysses": "qwen3-test", "ring": "qwen3-test", "dsa": "dsa-test"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, styles: list[str], lengths: list[int], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh  # DTensor imports sympy: only the ranks need it

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    peaks = {style: {str(T): _peak(style, T, mesh) for T in lengths} for style in styles}
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(peaks))
    dist.destroy_process_group()


def _peak(style: str, T: int, mesh) -> int:
    """The allocator's peak over one forward + backward of a `T`-token row under `style`, on a fresh model."""
    model = build_model(ModelConfig(name=MODELS[style]))
    cp = apply_dsa_cp(model, mesh) if style == "dsa" else apply_cp(model, mesh, style)
    state = dataclasses.replace(ParallelState(vocab=259), cp=cp)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (T,), generator=gen)
    pos = position_ids_for([T], T)[0]
    cpu = torch.device("cpu")
    warm = 64  # the kernels' first-call allocations are not the sequence's
    lp, _ = packed_logprobs(model, ids[:warm], pos[:warm], [warm], 1.0, cpu, state=state)
    lp.sum().backward()
    model.zero_grad(set_to_none=False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        lp, _ = packed_logprobs(model, ids, pos, [T], 1.0, cpu, state=state)
        lp.sum().backward()
        del lp
    return allocator_peak(prof)


def allocator_peak(prof: profile) -> int:
    """The most bytes torch's allocator held at once during the profile, above what it held when it began."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(itertools.accumulate(b for _, b in events), default=0)


def measure(styles: list[str], lengths: list[int]) -> dict[str, dict[int, int]]:
    """Rank 0's peak allocated bytes per style and length, over one forward + backward under cp = 2."""
    with tempfile.TemporaryDirectory(prefix="arbor-cp-memory-") as tmp:
        out = str(Path(tmp) / "peaks.json")
        args = (_free_port(), styles, lengths, out)
        mp.start_processes(_rank, args=args, nprocs=2, join=True, start_method="spawn")
        peaks = json.loads(Path(out).read_text())
    return {style: {int(T): b for T, b in v.items()} for style, v in peaks.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384", help="sequence lengths, each twice the one before")
    p.add_argument("--styles", default="ulysses,ring,dsa")
    a = parse_args(p, lengths="128,256")
    # the ranks inherit these: the profiler's start/stop lines and the allocator's note on blocks allocated
    # before profiling began say nothing about the figures
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    lengths = [int(x) for x in a.lengths.split(",")]
    peaks = measure(a.styles.split(","), lengths)
    growth: dict[str, float] = {}
    for style, by_length in peaks.items():
        for T, b in by_length.items():
            print(f"{style:8s} T = {T:6d}: peak {b / 2**20:8.1f} MiB allocated", flush=True)
        lo, hi = lengths[-2], lengths[-1]
        growth[style] = math.log2(max(by_length[hi], 1) / max(by_length[lo], 1)) / math.log2(hi / lo)
        print(f"{style:8s} growth exponent {lo} -> {hi}: {growth[style]:.2f} (1 linear, 2 quadratic)", flush=True)
    worst = max(growth.values())
    print(
        json.dumps(
            {
                "benchmark": "cp_memory",
                "value": round(worst, 3),
                "target": TARGET,
                "ok": worst <= TARGET,
                "growth": {k: round(v, 3) for k, v in growth.items()},
                "peak_bytes": {k: {str(T): b for T, b in v.items()} for k, v in peaks.items()},
                "models": {k: MODELS[k] for k in peaks},
            }
        )
    )


if __name__ == "__main__":
    main()
