"""The `eval` entry point and the evaluation core that `rl` also runs periodically (`[orchestrator.eval]`).

For each eval environment, the first `num_tasks` tasks of `dataset(seed)` are sampled `k` times; each sample is
scored by the environment (reward components summed with its `reward_weights`). Reported per environment:
`avg@k` (mean reward over all samples), `pass@k` (fraction of tasks with at least one sample whose reward
reaches `solve_threshold`), `pass@1` (the unbiased single-sample solve rate c/n averaged over tasks), plus the
mean completion length. Generation goes through the same token-ids-in API as training: a running server (the
`InferenceClient`) or, standalone, arbor's local engine in this process.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Awaitable, Callable

from arbor.config.eval import EvalConfig, EvalSettings
from arbor.config.loader import load_config, main_guard

Generate = Callable[[list[int], int, int], Awaitable[list[str]]]
"""(prompt ids, n, seed) -> n completion texts."""


async def evaluate(generate: Generate, tokenizer: Any, cfg: EvalSettings, max_prompt: int | None = None) -> dict[str, float]:
    """avg@k / pass@k / pass@1 per environment, as `eval/<env id>/<figure>`."""
    from arbor.environments import env_prompt_ids, load_environment, total_reward

    out: dict[str, float] = {}
    for env_cfg in cfg.environments:
        env = load_environment(env_cfg)
        tasks = env.dataset(cfg.seed)[: cfg.num_tasks]
        name = env_cfg.id.rsplit(":", 1)[-1]

        async def one(i: int, task: dict) -> tuple[list[float], list[int]]:
            prompt = env_prompt_ids(env, task, tokenizer)
            if max_prompt is not None and len(prompt) > max_prompt:
                raise ValueError(f"eval task {i} of {env_cfg.id}: prompt of {len(prompt)} tokens exceeds {max_prompt}")
            seed = zlib.crc32(f"eval/{cfg.seed}/{name}/{i}".encode()) & 0x7FFFFFFF
            texts = await generate(prompt, cfg.k, seed)
            scores = await asyncio.gather(*(env.score(task, t) for t in texts))
            return [total_reward(s, env_cfg.reward_weights) for s in scores], [len(t) for t in texts]

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
        rewards = [r for rs, _ in results for r in rs]
        solved = [sum(r >= cfg.solve_threshold for r in rs) for rs, _ in results]
        out[f"eval/{name}/avg@{cfg.k}"] = sum(rewards) / len(rewards)
        out[f"eval/{name}/pass@{cfg.k}"] = sum(c > 0 for c in solved) / len(solved)
        out[f"eval/{name}/pass@1"] = sum(c / cfg.k for c in solved) / len(solved)
        out[f"eval/{name}/completion_chars"] = sum(n for _, ns in results for n in ns) / len(rewards)
    return out


def client_generator(client, cfg: EvalSettings) -> Generate:
    async def generate(prompt: list[int], n: int, seed: int) -> list[str]:
        completions = await client.generate(prompt, n, cfg.max_tokens, cfg.temperature, cfg.top_p, seed)
        return [c.text for c in completions]

    return generate


def engine_generator(engine, cfg: EvalSettings) -> Generate:
    from arbor.inference.sampling import SamplingParams

    async def generate(prompt: list[int], n: int, seed: int) -> list[str]:
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, n=n, seed=seed)
        engine.check(prompt, params)
        out = await asyncio.wrap_future(engine.submit(prompt, params))
        return [c.text for c in sorted(out.completions, key=lambda c: c.index)]

    return generate


async def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    from arbor.models import build_tokenizer

    tokenizer = build_tokenizer(cfg.model)
    t0 = time.perf_counter()
    if cfg.base_url:
        from arbor.orchestrator.client import InferenceClient

        async with InferenceClient([cfg.base_url], 600.0, 3) as client:
            figures = await evaluate(client_generator(client, cfg), tokenizer, cfg)
    else:
        import torch

        from arbor.inference.engine import Engine
        from arbor.models import build_model

        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        from arbor.models.fp8 import apply_fp8

        model = build_model(cfg.model)
        apply_fp8(model, cfg.model)
        engine = Engine(model, tokenizer, seq_len=cfg.seq_len, max_batch_size=cfg.max_batch_size, seed=cfg.seed)
        engine.start()
        try:
            figures = await evaluate(engine_generator(engine, cfg), tokenizer, cfg, cfg.seq_len - cfg.max_tokens)
        finally:
            engine.stop()
    record = {"model": cfg.model.name, "k": cfg.k, "num_tasks": cfg.num_tasks, **figures,
              "time/eval": time.perf_counter() - t0}
    path = Path(cfg.output_dir) / "eval.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(EvalConfig, argv, prog="eval")  # before torch: a bad config fails in milliseconds
    record = asyncio.run(run_eval(cfg))
    for key, value in record.items():
        if key.startswith("eval/"):
            print(f"{key}: {value:.4f}", file=sys.stderr)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
