"""The `eval` console script: evaluates a model on the `[eval]` environments and appends a line to `eval.jsonl`.

Generation goes to a running server through the orchestrator's `InferenceClient` (`base_url`), or, standalone,
to arbor's local engine started in this process. With `[model.lora]` it evaluates an adapter: `model.lora.path`
loaded into the local engine, or the server's adapter named `model.lora.name` (default "arbor"). Composing the two sides
is why this entry point lives outside
the orchestrator and inference packages, which never import each other; the evaluation itself
(`arbor.orchestrator.evaluator.evaluate`, also run periodically by `rl`) is the orchestrator's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from arbor import runloop
from arbor.config.eval import EvalConfig, EvalSettings
from arbor.config.loader import load_config, main_guard
from arbor.inference.engine.params import SamplingParams
from arbor.run_dir import eval_path

if TYPE_CHECKING:  # an annotation only: the orchestrator's modules load torch, which `main` defers
    from arbor.orchestrator.evaluator import Generate


def engine_generator(engine: Any, cfg: EvalSettings) -> Generate:
    """The local engine's `generate`, with the signature of `InferenceClient.generate`."""

    adapter = cfg.model.lora.adapter_name() if cfg.model.lora is not None and cfg.model.lora.path else None

    async def generate(
        prompt: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
        images: dict[str, Any] | None = None,
    ) -> list[Any]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=n, seed=seed)
        engine.check(prompt, params, adapter)
        out = await asyncio.wrap_future(engine.submit(prompt, params, adapter=adapter, images=images))
        return sorted(out.completions, key=lambda c: c.index)

    return generate


async def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    # Loaded once `main` has parsed the config: these bring torch, and a bad config must fail before it.
    import torch  # after the config check, see above

    from arbor.inference.engine.core import Engine  # after the config check, see above
    from arbor.models import build_model, build_tokenizer  # after the config check, see above
    from arbor.models.fp8 import apply_fp8  # after the config check, see above
    from arbor.orchestrator.client import InferenceClient  # after the config check, see above
    from arbor.orchestrator.evaluator import client_generator, evaluate  # after the config check, see above

    tokenizer = build_tokenizer(cfg.model)
    t0 = time.perf_counter()
    lora = cfg.model.lora
    if cfg.base_url:  # with [model.lora], the server's adapter of that name (it must be loaded there)
        async with InferenceClient(
            [cfg.base_url],
            600.0,
            3,
            vocab_size=tokenizer.vocab_size,
            stop_token_ids=tokenizer.stop_token_ids,
            **({"model": lora.adapter_name()} if lora is not None else {}),
        ) as client:
            figures = await evaluate(client_generator(client, cfg), tokenizer, cfg, seq_len=cfg.seq_len)
    else:  # arbor's engine in this process, stopped when done
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        model = build_model(cfg.model)
        apply_fp8(model, cfg.model)
        engine = Engine(model, tokenizer, seq_len=cfg.seq_len, max_batch_size=cfg.max_batch_size, seed=cfg.seed)
        engine.start()
        if lora is not None and lora.path is not None:
            await asyncio.wrap_future(engine.load_adapter(lora.adapter_name(), lora.path, 0))
        try:
            figures = await evaluate(
                engine_generator(engine, cfg), tokenizer, cfg, cfg.seq_len - cfg.max_tokens, seq_len=cfg.seq_len
            )
        finally:
            engine.stop()
    record = {
        "model": cfg.model.name,
        "k": cfg.k,
        "num_tasks": cfg.num_tasks,
        **figures,
        "time/eval": time.perf_counter() - t0,
    }
    path = eval_path(cfg.output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(EvalConfig, argv, prog="eval")  # before torch: a bad config fails in milliseconds
    record = runloop.run(run_eval(cfg), threads=max(env.threads for env in cfg.environments))
    for key, value in record.items():
        if key.startswith("eval/"):
            print(f"{key}: {value:.4f}", file=sys.stderr)
    print(json.dumps(record))
    runloop.exit_if_stuck()  # an environment call that never returned must not keep eval from ending
    return 0


if __name__ == "__main__":
    sys.exit(main())
