"""The local engine's decode tokens/s on a real model shape: arbor's built-in engine (`arbor.inference.engine`) on
random weights of a `benchmarks/mfu.py` shape (Qwen3-0.6B's by default), `--batch` requests decoded together.

The engine gets the byte tokenizer (random weights need no real one): the model still computes its whole
151,936-row head every token, the sampler draws among the tokenizer's ids. Requests sample at temperature 1 and
stop at `--max-tokens` or at the tokenizer's end token, so the figure is generated tokens over the wall time of
the whole batch (after one warm-up batch), with the mean completion length beside it. Last line:
`{"benchmark": "decode", "tokens_per_s": ..., ...}`.

    uv run python benchmarks/decode.py [--shape qwen3-0.6b] [--batch 64] [--max-tokens 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from mfu import build_shape
from smoke import parse_args

from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.models.tokenizer import ByteTokenizer


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Generated tokens and wall seconds of one batch submitted at once."""
    t = time.perf_counter()
    futures = [engine.submit(p, SamplingParams(max_tokens=max_tokens, seed=i)) for i, p in enumerate(prompts)]
    outputs = [f.result() for f in futures]
    return sum(len(c.token_ids) for o in outputs for c in o.completions), time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = parse_args(p, shape="tiny", batch=4, prompt_tokens=16, max_tokens=8, dtype="float32", device="cpu")
    device = torch.device(a.device)
    model = build_shape(a.shape, None, device).to(getattr(torch, a.dtype))
    tokenizer = ByteTokenizer()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (a.prompt_tokens,), generator=gen).tolist() for _ in range(a.batch)]
    seq_len = a.prompt_tokens + a.max_tokens
    with Engine(model, tokenizer, seq_len=seq_len, max_batch_size=a.batch) as engine:
        run_batch(engine, prompts, a.max_tokens)  # warm-up: kernels, caches
        generated, seconds = run_batch(engine, prompts, a.max_tokens)
    print(
        json.dumps(
            {
                "benchmark": "decode",
                "tokens_per_s": round(generated / seconds, 1),
                "shape": a.shape,
                "batch": a.batch,
                "mean_completion_tokens": round(generated / a.batch, 1),
                "max_tokens": a.max_tokens,
                "prompt_tokens": a.prompt_tokens,
                "dtype": a.dtype,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()
