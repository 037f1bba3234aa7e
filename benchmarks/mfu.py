"""Trainer tokens/s and MFU on real model shapes: arbor's RL step (`arbor.trainer.step.train_step`) on random
weights of Qwen3-0.6B's, Qwen3-4B's or Qwen3-30B-A3B's shape (no download), bf16 compute with fp32 master
weights, activation checkpointing and FSDP2 on one device (a mesh of one rank, so the parameters are DTensors
gathered in bf16 exactly as on many GPUs), packed rows of `--row-tokens` (16k by default).

MFU = model FLOPs per second / the device's dense bf16 peak. Model FLOPs per trained token (PaLM's formula):
6 x N + 12 x layers x heads x head_dim x S, where N counts the matmul parameters one token passes through (the
decoder's, experts at top_k / num_experts, and the LM head; not the embedding lookup) and S = sum(len^2) / sum(len)
over the row's documents (PaLM's S is the sequence a token attends over, here its own document; causal masking
is not halved out, as in PaLM). Activation checkpointing's recomputed forward is not counted (it is overhead,
not model FLOPs). The peak is read from the device name (`PEAK_TFLOPS`); it is printed with the figure.
prime-rl's published figure for the 0.6B shape at 16k tokens on one H100 (11.9k tokens/s, 11.1% MFU) is printed
beside it. Last line: `{"benchmark": "mfu", "value": mfu, "target": 0.111, ...}`.

    uv run python benchmarks/mfu.py [--shape qwen3-0.6b] [--row-tokens 16384] [--steps 3] [--device cuda]

The 30B-A3B shape keeps `--layers` of its 48 decoder layers; by default as many as fit in 60% of the device's free
memory at 16 bytes a parameter (fp32 weights, gradients and two AdamW moments; ~10 GB a layer of 128 experts),
about 7 on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time

import torch
import torch.distributed as dist
from smoke import parse_args
from torch.distributed.device_mesh import init_device_mesh
from trainer_throughput import synthetic_batch

from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.config.trainer import LossConfig, TrainerConfig
from arbor.models.args import ModelArgs
from arbor.models.family import family_of
from arbor.trainer.loss import ppo_clip
from arbor.trainer.optim import build_optimizer
from arbor.trainer.parallel import ParallelDims, apply_fsdp, init_distributed, parallelize
from arbor.trainer.step import train_step

QWEN3_VOCAB = 151_936
SHAPES: dict[str, ModelArgs] = {
    # Hugging Face config.json of Qwen/Qwen3-0.6B, Qwen/Qwen3-4B and Qwen/Qwen3-30B-A3B.
    "qwen3-0.6b": ModelArgs(QWEN3_VOCAB, 1024, 3072, 28, 16, 8, 128, max_position_embeddings=40_960),
    "qwen3-4b": ModelArgs(QWEN3_VOCAB, 2560, 9728, 36, 32, 8, 128, max_position_embeddings=40_960),
    "qwen3-30b-a3b": ModelArgs(
        QWEN3_VOCAB,
        2048,
        6144,
        48,
        32,
        4,
        128,
        tie_word_embeddings=False,
        max_position_embeddings=40_960,
        architecture="Qwen3MoeForCausalLM",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # The CPU smoke run's shape: every code path above (dense), a few hundred thousand parameters.
    "tiny": ModelArgs(1024, 64, 128, 2, 4, 2, 16),
    "tiny-moe": ModelArgs(
        1024,
        64,
        128,
        2,
        4,
        2,
        16,
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
}
"""Shapes by name; weights are random."""

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}
"""Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by a name the device's name contains; SXM figures."""

PRIME_RL = {"shape": "qwen3-0.6b", "row_tokens": 16_384, "gpu": "H100", "tokens_per_s": 11_900, "mfu": 0.111}
"""prime-rl's published trainer figure for the same shape on one H100."""


def build_shape(name: str, layers: int | None, device: torch.device) -> torch.nn.Module:
    """The shape's model on `device` in fp32 with random weights (normal(0, 0.02), norms at one), built on the
    device itself: initialising billions of parameters on the CPU would take minutes."""
    args = SHAPES[name]
    if layers is not None:
        args = dataclasses.replace(args, num_hidden_layers=layers)
    with torch.device(device):
        model = family_of(args).build(args)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def fitting_layers(args: ModelArgs, device: torch.device, fraction: float = 0.6) -> int:
    """Decoder layers whose training state (16 bytes a parameter) fits in `fraction` of the device's free memory,
    beside the embeddings and head; all of them off CUDA."""
    if device.type != "cuda":
        return args.num_hidden_layers
    h = args.hidden_size
    attention = 2 * h * args.num_attention_heads * args.head_dim + 2 * h * args.num_key_value_heads * args.head_dim
    if args.is_moe:  # every expert's weights and the router
        mlp = 3 * h * args.moe_intermediate_size * args.num_experts + h * args.num_experts
    else:
        mlp = 3 * h * args.intermediate_size
    embeddings = args.vocab_size * h * (1 if args.tie_word_embeddings else 2)
    free = torch.cuda.mem_get_info(device)[0] * fraction / 16
    return max(1, min(args.num_hidden_layers, int((free - embeddings) // (attention + mlp))))


def matmul_params(args: ModelArgs) -> float:
    """Parameters a token multiplies through: attention and MLP (routed experts at top_k / num_experts, the router),
    and the LM head."""
    h, q, kv = args.hidden_size, args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    attention = h * q * 2 + h * kv * 2
    per_layer = []
    for i in range(args.num_hidden_layers):
        if args.is_moe_layer(i):
            mlp = 3 * h * args.moe_intermediate_size * args.num_experts_per_tok + h * args.num_experts
        else:
            mlp = 3 * h * args.intermediate_size
        per_layer.append(attention + mlp)
    return float(sum(per_layer) + h * args.vocab_size)


def flops_per_token(args: ModelArgs, seq_lens: list[int]) -> float:
    """PaLM's 6N + 12 L H Q S (see the module docstring), S from the documents' lengths."""
    s = sum(n * n for n in seq_lens) / sum(seq_lens)
    return 6 * matmul_params(args) + 12 * args.num_hidden_layers * args.num_attention_heads * args.head_dim * s


def peak_tflops(device: torch.device) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak (None where `PEAK_TFLOPS` does not know it, e.g. a CPU)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers kept; default: all that fit")
    p.add_argument("--row-tokens", type=int, default=16_384)
    p.add_argument("--micro-batches", type=int, default=1, help="packed rows a step")
    p.add_argument("--sample-tokens", type=int, nargs=2, default=[16_384, 16_384], help="document length range")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (FlexAttention compiles)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    a = parse_args(
        p, shape="tiny", row_tokens=256, sample_tokens=[48, 128], steps=1, warmup=1, dtype="float32", device="cpu"
    )
    device, _ = init_distributed("auto" if a.device.startswith("cuda") else "gloo")
    model = build_shape(a.shape, a.layers or fitting_layers(SHAPES[a.shape], device), device)
    args = model.args
    cfg = TrainerConfig(
        model=ModelConfig(name="qwen3-test", dtype=a.dtype), parallel=ParallelConfig(activation_checkpointing=True)
    )
    dims = ParallelDims.from_world(1)
    state = dataclasses.replace(parallelize(model, dims, cfg, device.type), vocab=args.vocab_size)
    # FSDP2 over a mesh of one rank: what `parallelize` does on several ranks, so bf16 comes from its
    # mixed-precision all-gather rather than from autocast.
    apply_fsdp(model, init_device_mesh(device.type, (1,)), getattr(torch, a.dtype))
    optimizer = build_optimizer(model, cfg.optim)
    batch = synthetic_batch(args.vocab_size, a.micro_batches, a.row_tokens, sample_tokens=tuple(a.sample_tokens))
    seq_lens = [int(n) for mb in batch.micro_batches for n in mb.seq_lens]
    tokens = sum(seq_lens)
    ctx = contextlib.nullcontext()  # FSDP2's policy casts; no autocast on top

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        train_step(model, optimizer, batch, ppo_clip, LossConfig(), 1.0, device, 1, ctx, state=state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    for _ in range(a.warmup):
        step()
    times = [step() for _ in range(a.steps)]
    tps = tokens / statistics.median(times)
    name, peak = peak_tflops(device)
    flops = flops_per_token(args, seq_lens)
    mfu = tps * flops / (peak * 1e12) if peak else None
    print(
        json.dumps(
            {
                "benchmark": "mfu",
                "value": round(mfu, 4) if mfu is not None else None,
                "target": PRIME_RL["mfu"],
                "ok": mfu is not None and mfu >= PRIME_RL["mfu"],
                "tokens_per_s": round(tps, 1),
                "mfu": round(mfu, 4) if mfu is not None else None,
                "shape": a.shape,
                "layers": args.num_hidden_layers,
                "matmul_params": matmul_params(args),
                "flops_per_token": flops,
                "flops_formula": "6*N + 12*layers*heads*head_dim*S, S = sum(len^2)/sum(len)",
                "device": name,
                "peak_tflops": peak,
                "row_tokens": a.row_tokens,
                "tokens_per_step": tokens,
                "step_s": [round(t, 4) for t in times],
                "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
                if device.type == "cuda"
                else None,
                "prime_rl": PRIME_RL,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
