"""Trainer parallelism: step throughput at 1 and 2 ranks, and per-rank parameter + optimizer memory with FSDP2.

One run spawns a world of 1 and then a world of 2 (gloo on CPU; NCCL when there are 2 GPUs), each training the
same global batch with `arbor.trainer.step.train_step` on a model parallelised by `arbor.trainer.parallel`
(FSDP2; for an MoE preset also expert parallel over both ranks with `--ep 2`). Reported: global tokens/s (all
non-padding tokens of the step over the median step time) at each world size, and the bytes of parameters and
AdamW state one rank holds at 2 ranks as a fraction of the unsharded model's (target <= 0.55). Last line:
`{"benchmark": "parallel", "value": memory fraction, ...}`.

    uv run python benchmarks/parallel.py [--model qwen3-small] [--ep 1] [--repeats 3] [--row-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.config.trainer import LossConfig, TrainerConfig
from arbor.models import build_model, build_tokenizer
from arbor.trainer.loss import ppo_clip
from arbor.trainer.optim import build_optimizer
from arbor.trainer.parallel import ParallelDims, forward_context, init_distributed, parallelize
from arbor.trainer.step import train_step

sys.path.insert(0, str(Path(__file__).parent))
from smoke import parse_args  # noqa: E402
from trainer_throughput import synthetic_batch  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _worker(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(a.threads)
    use_cuda = torch.cuda.device_count() >= world
    device, _ = init_distributed("auto" if use_cuda else "gloo")
    cfg = TrainerConfig(
        model=ModelConfig(name=a.model), parallel=ParallelConfig(nproc=world, ep=a.ep if world > 1 else 1)
    )
    model = build_model(cfg.model, device="cpu")
    full_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()) * 3
    dims = ParallelDims.from_config(cfg.parallel)
    if not dims.fsdp_enabled:
        model.to(device)
    state = parallelize(model, dims, cfg, device.type)
    optimizer = build_optimizer(model, cfg.optim)
    batch = synthetic_batch(build_tokenizer(cfg.model).vocab_size, a.micro_batches, a.row_tokens)
    tokens = sum(int(mb.seq_lens.sum()) for mb in batch.micro_batches)
    k = a.micro_batches // world
    batch.micro_batches = batch.micro_batches[rank * k : (rank + 1) * k]  # same global batch at every world size
    times = []
    for i in range(a.warmup + a.repeats):
        dist.barrier()
        t = time.perf_counter()
        train_step(
            model,
            optimizer,
            batch,
            ppo_clip,
            LossConfig(),
            1.0,
            device,
            dims.dp_size,
            forward_context(dims, cfg, device.type),
            state=state,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    held = sum(_local_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
    for o in optimizer.optimizers:
        for state in o.state.values():
            held += sum(_local_bytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    held_t = torch.tensor([held], dtype=torch.float64)
    dist.all_reduce(held_t, op=dist.ReduceOp.MAX)  # the most any rank holds
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "tokens_per_s": tokens / statistics.median(times),
                    "max_rank_bytes": held_t.item(),
                    "full_bytes": full_bytes,
                    "tokens": tokens,
                    "device": str(device),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result.json")
        mp.start_processes(_worker, args=(world, _free_port(), a, out), nprocs=world, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-small")
    p.add_argument("--ep", type=int, default=1, help="expert parallel degree at 2 ranks (MoE presets)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--row-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    a = parse_args(p, model="qwen3-test", micro_batches=2, row_tokens=256, repeats=1, warmup=0)
    one, two = run(1, a), run(2, a)
    for world, r in ((1, one), (2, two)):
        print(
            f"{world} rank(s): {r['tokens_per_s']:.0f} tok/s, largest rank holds "
            f"{r['max_rank_bytes'] / 2**20:.1f} MiB of parameters + optimizer state",
            flush=True,
        )
    fraction = two["max_rank_bytes"] / two["full_bytes"]
    print(
        json.dumps(
            {
                "benchmark": "parallel",
                "value": round(fraction, 4),
                "target": 0.55,
                "ok": fraction <= 0.55,
                "metric": "per-rank parameter+optimizer bytes at 2 ranks / unsharded",
                "tokens_per_s_1_rank": round(one["tokens_per_s"], 1),
                "tokens_per_s_2_ranks": round(two["tokens_per_s"], 1),
                "speedup_2_ranks": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                "one_rank_fraction": round(one["max_rank_bytes"] / one["full_bytes"], 4),
                "model": a.model,
                "ep": a.ep,
                "device": two["device"],
                "tokens_per_step": two["tokens"],
            }
        )
    )


if __name__ == "__main__":
    main()
