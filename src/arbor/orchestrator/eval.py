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

Generate = Callable[..., Awaitable[list[Any]]]
"""`InferenceClient.generate`'s signature: (prompt ids, n, max_tokens, temperature, top_p, seed) -> n completions
(token_ids, logprobs, policy_versions, text, finish_reason), so multi-turn environments run whole episodes."""


async def evaluate(generate: Generate, tokenizer: Any, cfg: EvalSettings, max_prompt: int | None = None,
                   seq_len: int | None = None) -> dict[str, float]:
    """avg@k / pass@k / pass@1 per environment, as `eval/<env id>/<figure>`. A multi-turn environment plays `k`
    whole episodes per task (tools run, context managed, as in training; `seq_len` bounds a branch) and each
    episode counts once with its reward; an episode its environment failed for good counts as reward 0."""
    from arbor.environments import env_prompt_ids, is_multi_turn, load_environment, total_reward

    out: dict[str, float] = {}
    for env_cfg in cfg.environments:
        env = load_environment(env_cfg)
        tasks = env.dataset(cfg.seed)[: cfg.num_tasks]
        name = env_cfg.id.rsplit(":", 1)[-1]
        if is_multi_turn(env) and seq_len is None:
            raise ValueError(f"eval environment {env_cfg.id} is multi-turn: evaluate(..., seq_len=) is required")

        async def one(i: int, task: dict) -> tuple[list[float], list[int]]:
            seed = zlib.crc32(f"eval/{cfg.seed}/{name}/{i}".encode()) & 0x7FFFFFFF
            if is_multi_turn(env):
                return await _episodes(generate, env, env_cfg, task, tokenizer, cfg, seq_len, seed, i)
            prompt = env_prompt_ids(env, task, tokenizer)
            if max_prompt is not None and len(prompt) > max_prompt:
                raise ValueError(f"eval task {i} of {env_cfg.id}: prompt of {len(prompt)} tokens exceeds {max_prompt}")
            completions = await generate(prompt, cfg.k, cfg.max_tokens, cfg.temperature, cfg.top_p, seed)
            texts = [c.text for c in completions]
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


async def _episodes(generate: Generate, env, env_cfg, task: dict, tokenizer: Any, cfg: EvalSettings, seq_len: int,
                    seed: int, i: int) -> tuple[list[float], list[int]]:
    """`k` episodes of one multi-turn task: per episode its reward (shared by its branches) and its text length."""
    from arbor.orchestrator.episode import EpisodeSettings, run_group_episodes

    settings = EpisodeSettings(cfg.max_tokens, cfg.temperature, cfg.top_p, seq_len, env_cfg)
    rollouts = await run_group_episodes(generate, env, task, tokenizer, settings, cfg.k, seed, i)
    episodes: dict[int, list] = {}
    for r in rollouts:
        episodes.setdefault(r.episode_id, []).append(r)
    rewards = [branches[0].reward for branches in episodes.values()]
    lengths = [sum(len(r.text) for r in branches) for branches in episodes.values()]
    missing = cfg.k - len(episodes)  # skipped after environment failures
    return rewards + [0.0] * missing, lengths + [0] * missing


def client_generator(client, cfg: EvalSettings) -> Generate:
    """The fleet's `generate` (the settings come with each call)."""
    return client.generate


def engine_generator(engine, cfg: EvalSettings) -> Generate:
    from arbor.inference.sampling import SamplingParams

    async def generate(prompt: list[int], n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None = None) -> list[Any]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=n, seed=seed)
        engine.check(prompt, params)
        out = await asyncio.wrap_future(engine.submit(prompt, params))
        return sorted(out.completions, key=lambda c: c.index)

    return generate


async def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    from arbor.models import build_tokenizer

    tokenizer = build_tokenizer(cfg.model)
    t0 = time.perf_counter()
    if cfg.base_url:
        from arbor.orchestrator.client import InferenceClient

        async with InferenceClient([cfg.base_url], 600.0, 3) as client:
            figures = await evaluate(client_generator(client, cfg), tokenizer, cfg, seq_len=cfg.seq_len)
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
            figures = await evaluate(engine_generator(engine, cfg), tokenizer, cfg, cfg.seq_len - cfg.max_tokens,
                                     seq_len=cfg.seq_len)
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
