"""SFT data: tokenised examples with their loss masks, and the batches the `sft` process trains on.

Examples come from a JSONL or parquet file (`{"prompt", "completion"}` rows, the prompt sent as one user
message, or `{"messages": [...]}` chat rows in which EVERY assistant turn is a target and everything else, system
and user turns and the template's markup, is masked out of the loss) or, by default, from the environment's
reference answers (a multi-turn environment with a `demonstration(task)` method gives whole correct episodes,
trained like chat rows with its tool schemas in the template). A chat row's targets are found by templating its
prefixes: the tokens of assistant turn j are
those after `apply_chat_template(messages[:j], add_generation_prompt=True)` up to and including the end-of-turn
token; a tokenizer whose template does not extend its prefixes that way is reported, not guessed at. Each step packs
`batch_size` examples into rows of at most `seq_len` tokens (block-diagonal
attention, as the RL trainer does) and minimises cross-entropy on the target tokens only, averaged over the
step's target tokens. The result is a Hugging Face checkpoint directory `<output_dir>/sft/`, written under a
temporary name and renamed into place, which `model.name` can point at. Single process: the warm-up is small.

No torch here: a bad data file fails before the training (arbor.trainer.sft_train) loads it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from arbor.config.sft import SFTConfig
from arbor.environments import env_prompt, load_environment
from arbor.environments.tools import tool_schema
from arbor.models.tokenizer import Tokenizer

Example = tuple[list[int], list[bool]] | tuple[list[int], list[bool], dict[str, Any]]
"""(token ids, loss mask), the mask True on target tokens (each target ends with the end-of-turn token); a
vision-language prompt's example adds its pixel inputs (`pixel_values`, `image_grid_thw`) as a third item."""


def _single(prompt: list[int], target: list[int]) -> Example:
    return prompt + target, [False] * len(prompt) + [True] * len(target)


def load_examples(cfg: SFTConfig, tokenizer: Tokenizer) -> list[Example]:
    """Tokenised examples from `cfg.data` or the environment; those longer than `seq_len` are dropped."""
    examples = _file_examples(Path(cfg.data), tokenizer) if cfg.data else _environment_examples(cfg, tokenizer)
    kept = [e for e in examples if len(e[0]) <= cfg.seq_len]
    if not kept:
        raise ValueError(f"no SFT example fits in seq_len {cfg.seq_len} tokens (of {len(examples)} examples)")
    return kept


def _environment_examples(cfg: SFTConfig, tokenizer: Tokenizer) -> list[Example]:
    env = load_environment(cfg.environment)
    out = []
    demonstrate = getattr(env, "demonstration", None)
    for task in env.dataset(cfg.seed):
        if callable(demonstrate):  # a multi-turn environment's full correct episode, tool results included
            tools = [tool_schema(fn) for fn in env.tools(task)] or None
            out.append(chat_example(demonstrate(task), tokenizer, f"task {task.get('id')}", tools=tools))
            continue
        reference = env.reference(task)
        if reference is None:
            continue
        prompt, images = env_prompt(env, task, tokenizer, cfg.environment.prompt_format)
        example = _single(prompt, tokenizer.encode(reference) + [tokenizer.eos_token_id])
        out.append(example if images is None else (*example, images))
    if not out:
        raise ValueError(f"environment {cfg.environment.id!r} has no reference answers to fine-tune on")
    return out


def _rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(location, row) pairs from a JSONL or parquet file."""
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file {path} does not exist")
    if path.suffix == ".parquet":
        try:  # optional: the `parquet` extra, needed for parquet data only
            import pyarrow.parquet as pq  # optional extra, see above
        except ImportError:
            raise ValueError(f"reading {path} needs pyarrow: install arbor with the `parquet` extra") from None

        return [(f"{path}:row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    return [
        (f"{path}:{n}", json.loads(line)) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()
    ]


def chat_example(
    messages: list[dict[str, str]], tokenizer: Tokenizer, where: str = "row", tools: list[dict] | None = None
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
        if full[:end] != prefix + target:
            raise ValueError(
                f"{where}: the tokenizer's chat template does not extend its prefixes at assistant turn {j}, so "
                "its target tokens cannot be located; use prompt/completion rows"
            )
        mask[len(prefix) : end] = [True] * len(target)
    return full, mask


def _file_examples(path: Path, tokenizer: Tokenizer) -> list[Example]:
    out = []
    for where, row in _rows(path):
        if "messages" in row:
            out.append(chat_example(list(row["messages"]), tokenizer, where))
        elif "prompt" in row and "completion" in row:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True
            )
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
