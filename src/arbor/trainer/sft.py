"""The `sft` process: supervised fine-tuning on prompt/completion pairs, also `rl`'s optional warm-up.

Examples come from a JSONL or parquet file (`{"prompt", "completion"}` rows, the prompt sent as one user
message, or `{"messages": [...]}` chat rows in which EVERY assistant turn is a target and everything else, system
and user turns and the template's markup, is masked out of the loss) or, by default, from the environment's
reference answers (a multi-turn environment with a `demonstration(task)` method gives whole correct episodes,
trained like chat rows with its tool schemas in the template). A chat row's targets are found by templating its prefixes: the tokens of assistant turn j are
those after `apply_chat_template(messages[:j], add_generation_prompt=True)` up to and including the end-of-turn
token; a tokenizer whose template does not extend its prefixes that way is reported, not guessed at. Each step packs `batch_size` examples into rows of at most `seq_len` tokens (block-diagonal
attention, as the RL trainer does) and minimises cross-entropy on the target tokens only, averaged over the
step's target tokens. The result is a Hugging Face checkpoint directory `<output_dir>/sft/`, written under a
temporary name and renamed into place, which `model.name` can point at. Single process: the warm-up is small.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arbor.config.loader import ConfigError, load_config, main_guard
from arbor.config.sft import SFTConfig
from arbor.run_dir import process_metrics_path, sft_model_dir

if TYPE_CHECKING:
    import torch

    from arbor.models.tokenizer import Tokenizer

Example = tuple[list[int], list[bool]]
"""(token ids, loss mask): the mask is True on target tokens (each target ends with the end-of-turn token)."""


def _single(prompt: list[int], target: list[int]) -> Example:
    return prompt + target, [False] * len(prompt) + [True] * len(target)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(SFTConfig, argv, prog="sft")  # before torch: a bad config fails in milliseconds
    if cfg.steps == 0:
        raise ConfigError("steps is 0: nothing to train (set --steps N)")
    run_sft(cfg)
    return 0


def load_examples(cfg: SFTConfig, tokenizer: "Tokenizer") -> list[Example]:
    """Tokenised examples from `cfg.data` or the environment; those longer than `seq_len` are dropped."""
    examples = _file_examples(Path(cfg.data), tokenizer) if cfg.data else _environment_examples(cfg, tokenizer)
    kept = [e for e in examples if len(e[0]) <= cfg.seq_len]
    if not kept:
        raise ValueError(f"no SFT example fits in seq_len {cfg.seq_len} tokens (of {len(examples)} examples)")
    return kept


def _environment_examples(cfg: SFTConfig, tokenizer: "Tokenizer") -> list[Example]:
    from arbor.environments import env_prompt_ids, load_environment

    env = load_environment(cfg.environment)
    out = []
    demonstrate = getattr(env, "demonstration", None)
    for task in env.dataset(cfg.seed):
        if callable(demonstrate):  # a multi-turn environment's full correct episode, tool results included
            from arbor.environments.tools import tool_schema

            tools = [tool_schema(fn) for fn in env.tools(task)] or None
            out.append(chat_example(demonstrate(task), tokenizer, f"task {task.get('id')}", tools=tools))
            continue
        reference = env.reference(task)
        if reference is None:
            continue
        prompt = env_prompt_ids(env, task, tokenizer)
        out.append(_single(prompt, tokenizer.encode(reference) + [tokenizer.eos_token_id]))
    if not out:
        raise ValueError(f"environment {cfg.environment.id!r} has no reference answers to fine-tune on")
    return out


def _rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(location, row) pairs from a JSONL or parquet file."""
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file {path} does not exist")
    if path.suffix == ".parquet":
        try:  # optional: the `parquet` extra, needed for parquet data only
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {path} needs pyarrow: install arbor with the `parquet` extra") from None

        return [(f"{path}:row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    return [(f"{path}:{n}", json.loads(line)) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


def chat_example(
    messages: list[dict[str, str]], tokenizer: "Tokenizer", where: str = "row", tools: list[dict] | None = None
) -> Example:
    """A multi-turn chat masked to its assistant turns (see the module docstring); `tools` are the schemas the
    template exposes."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError(f"{where}: a messages row needs at least one assistant message (the targets)")
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
    mask = [False] * len(full)
    for j, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:j], add_generation_prompt=True, tools=tools)
        target = tokenizer.encode(m["content"]) + [tokenizer.eos_token_id]
        end = len(prefix) + len(target)
        if full[: end] != prefix + target:
            raise ValueError(
                f"{where}: the tokenizer's chat template does not extend its prefixes at assistant turn {j}, so "
                "its target tokens cannot be located; use prompt/completion rows"
            )
        mask[len(prefix): end] = [True] * len(target)
    return full, mask


def _file_examples(path: Path, tokenizer: "Tokenizer") -> list[Example]:
    out = []
    for where, row in _rows(path):
        if "messages" in row:
            out.append(chat_example(list(row["messages"]), tokenizer, where))
        elif "prompt" in row and "completion" in row:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
            out.append(_single(prompt, tokenizer.encode(row["completion"]) + [tokenizer.eos_token_id]))
        else:
            raise ValueError(f"{where}: expected keys 'prompt' and 'completion', or 'messages'")
    return out


def batches(examples: list[Example], batch_size: int, seed: int):
    """Endless batches of examples: a fresh shuffle per epoch, every example once per epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        yield batch


def pack(batch: list[Example], row_len: int) -> list[tuple["torch.Tensor", "torch.Tensor", list[int]]]:
    """Packs examples in order into rows of at most `row_len` tokens: (input_ids, loss_mask, seq_lens) per row.
    Token t of a target is in the loss (predicted from everything before it); other tokens are not."""
    import torch

    rows: list[tuple[list[int], list[bool], list[int]]] = []
    for example_ids, example_mask in batch:
        n = len(example_ids)
        if not rows or len(rows[-1][0]) + n > row_len:
            rows.append(([], [], []))
        ids, mask, lens = rows[-1]
        ids += example_ids
        mask += example_mask
        lens.append(n)
    return [(torch.tensor(ids), torch.tensor(mask), lens) for ids, mask, lens in rows]


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    """Fine-tunes for `cfg.steps` steps, writes `<output_dir>/sft/`, returns the final figures."""
    import torch

    from arbor.models import build_model, build_tokenizer
    from arbor.models.attention import position_ids_for
    from arbor.trainer.step import packed_logprobs

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = build_tokenizer(cfg.model)
    examples = load_examples(cfg, tokenizer)
    model = build_model(cfg.model.model_copy(update={"dtype": "float32"}), device=str(device))
    from arbor.models.fp8 import apply_fp8

    apply_fp8(model, cfg.model)  # fp32 masters, FP8 compute as in RL training
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    warmup = max(1, math.ceil(0.1 * cfg.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    dtype = getattr(torch, cfg.model.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    metrics = process_metrics_path(cfg.output_dir, "sft")
    window: list[float] = []
    start = time.perf_counter()
    for step, batch in zip(range(cfg.steps), batches(examples, cfg.batch_size, cfg.seed)):
        rows = pack(batch, cfg.seq_len)
        targets = sum(int(mask.sum()) for _, mask, _ in rows)
        total = torch.zeros((), device=device)
        for ids, mask, lens in rows:
            with autocast:
                logprobs, _ = packed_logprobs(model, ids, position_ids_for(lens)[0], lens, 1.0, device, False)
            nll = -(logprobs * mask.to(device)).sum() / targets
            nll.backward()
            total += nll.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(float(total))
        if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
            record = {"step": step + 1, "sft/loss": sum(window) / len(window), "sft/lr": optimizer.param_groups[0]["lr"],
                      "sft/time": time.perf_counter() - start}
            _append(metrics, record)
            print(f"[sft] step {step + 1}/{cfg.steps}: loss {record['sft/loss']:.4f}", file=sys.stderr, flush=True)
            final_loss, window = record["sft/loss"], []
    out = save(cfg, model, tokenizer)
    final = {"sft/loss": final_loss, "sft/steps": cfg.steps, "sft/examples": len(examples), "sft/dir": str(out)}
    _append(metrics, final)
    return final


def save(cfg: SFTConfig, model: "torch.nn.Module", tokenizer: "Tokenizer") -> Path:
    """Writes `<output_dir>/sft/` atomically: a temporary directory renamed over any previous result."""
    import torch

    from arbor.models.hf import save_checkpoint_dir

    final = sft_model_dir(cfg.output_dir)
    tmp = final.parent / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = getattr(torch, cfg.model.dtype)
    state = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    save_checkpoint_dir(state, model.args, tmp, tokenizer)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


if __name__ == "__main__":
    sys.exit(main())
