"""FP8 block-scaled linear layers: what a layer pays, against the same layer in bf16.

CPU: forward + backward of one linear layer (tokens x in -> out) as `nn.Linear` in fp32 and as `FP8Linear` on
the reference path (quantisation + per-128-block fp32 GEMMs). The reference exists for correctness and CPU
runs, not speed: the target only guards against a pathological slowdown. GPU (Hopper, when present): the layer
as training runs it, `FP8Linear` with the chosen backend (DeepGEMM, else torch's scaled_mm) quantising its bf16
input and weight on every call, forward + backward (dgrad and wgrad GEMMs with their own quantisation), against
`nn.Linear` in bf16 at a DeepSeek-like shape; the value is that speedup. The GEMM alone on operands quantised
beforehand (what the kernel could give, without the quantisation a layer pays) is reported beside it.

On one H100 (2026-11-27, torch 2.11, no DeepGEMM installed, defaults), GEMM alone: scaled_mm 0.241 ms against
bf16 0.311 ms at 4096x7168x4096 -> 1.29x; the layer's figure has not been measured on a GPU yet. CPU reference
3.45x fp32 (target <= 8).

Usage: uv run python benchmarks/fp8.py [--tokens 2048] [--hidden 512] [--inter 1536]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from smoke import parse_args

from arbor.models.fp8 import FP8Linear, block_gemm, quantize_blocks, quantize_tiles, select_backend

CPU_TARGET = 8.0
"""Largest acceptable reference-path slowdown (FP8 fwd+bwd time / fp32 fwd+bwd time) on CPU."""
GPU_TARGET = 1.2
"""Smallest acceptable FP8 GEMM speedup over bf16 on Hopper."""


def _time(fn, repeat: int) -> float:
    fn()  # warm-up (and JIT compile on GPU)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def cpu_overhead(tokens: int, hidden: int, inter: int) -> tuple[float, float]:
    torch.manual_seed(0)
    ref = torch.nn.Linear(hidden, inter, bias=False)
    fp8 = copy.deepcopy(ref)
    fp8.__class__ = FP8Linear
    fp8.fp8_backend = "reference"
    x = torch.randn(tokens, hidden, requires_grad=True)

    def step(layer):
        return lambda: layer(x).square().mean().backward()

    return _time(step(ref), 5), _time(step(fp8), 5)


def gpu_gemm(m: int, k: int, n: int) -> tuple[str, float, float]:
    """(backend, bf16 ms, FP8 ms) of the forward GEMM alone, on operands quantised beforehand."""
    dev = torch.device("cuda")
    backend = select_backend(dev)
    x, w = torch.randn(m, k, device=dev), torch.randn(n, k, device=dev)
    xq, xs = quantize_tiles(x)
    wq, ws = quantize_blocks(w)
    xb, wb = x.bfloat16(), w.bfloat16()
    bf16 = _time(lambda: torch.mm(xb, wb.t()), 20)
    fp8 = _time(lambda: block_gemm(xq, xs, wq, ws, backend), 20)
    return backend, bf16, fp8


def gpu_layer(m: int, k: int, n: int) -> tuple[float, float]:
    """(bf16 s, FP8 s) of one layer's forward + backward as training runs it: weights in bf16 (FSDP2's compute
    dtype), the FP8 layer quantising input, weight and gradients on every call."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = copy.deepcopy(ref)
    fp8.__class__ = FP8Linear
    fp8.fp8_backend = select_backend(dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def step(layer):
        return lambda: layer(x).float().square().mean().backward()

    return _time(step(ref), 20), _time(step(fp8), 20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=1536)
    a = parse_args(p, tokens=128, hidden=128, inter=256)
    fp32, fp8 = cpu_overhead(a.tokens, a.hidden, a.inter)
    ratio = fp8 / fp32
    print(
        f"CPU linear {a.tokens}x{a.hidden}->{a.inter} fwd+bwd: fp32 {fp32 * 1e3:.1f} ms, "
        f"FP8 reference {fp8 * 1e3:.1f} ms ({ratio:.2f}x)"
    )
    result = {
        "benchmark": "fp8",
        "value": round(ratio, 3),
        "target": CPU_TARGET,
        "ok": ratio < CPU_TARGET,
        "unit": "cpu reference slowdown (x)",
        "cpu_fp32_ms": round(fp32 * 1e3, 2),
        "cpu_fp8_ms": round(fp8 * 1e3, 2),
    }
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        m, k, n = 4096, 7168, 4096
        backend, bf16, fp8g = gpu_gemm(m, k, n)
        layer_bf16, layer_fp8 = gpu_layer(m, k, n)
        speedup = layer_bf16 / layer_fp8
        print(
            f"GPU layer {m}x{k}->{n} fwd+bwd: bf16 {layer_bf16 * 1e3:.3f} ms, FP8 {backend} {layer_fp8 * 1e3:.3f} ms "
            f"({speedup:.2f}x); GEMM alone, operands quantised beforehand: {bf16 / fp8g:.2f}x"
        )
        result.update(
            value=round(speedup, 3),
            target=GPU_TARGET,
            ok=speedup >= GPU_TARGET,
            unit=f"gpu speedup of an FP8Linear ({backend}) over bf16 nn.Linear, fwd+bwd (x)",
            gpu_backend=backend,
            gpu_layer_bf16_ms=round(layer_bf16 * 1e3, 3),
            gpu_layer_fp8_ms=round(layer_fp8 * 1e3, 3),
            gpu_gemm_speedup=round(bf16 / fp8g, 3),
            gpu_gemm_bf16_ms=round(bf16 * 1e3, 3),
            gpu_gemm_fp8_ms=round(fp8g * 1e3, 3),
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
