"""How much reward can RL add to a reverse_text checkpoint by sharpening alone? Issue 34's raw-prompt Llama run.

RL at the example's temperature 1.0 scores sampled completions; as it lowers the policy's entropy, the sampled
reward approaches the greedy one. This reads one or more Hugging Face checkpoint directories (`<run>/sft`, the
warm-up's, and `<run>/broadcasts/step_N`, what RL made of it) and, on `--tasks` held-out reverse_text tasks of the
example's shape (2 to 5 letters of "abcdefgh", dataset seed 123, which neither the warm-up nor RL drew from),
reports per directory: the greedy and the sampled (temperature 1.0) mean reward, their exact-reversal rates, the
mean completion length in tokens with its end-of-sequence token (a right answer averages 4.5) and the greedy
reward per input length; `--samples N` prints the first N greedy completions. Decoding is plain transformers
(`AutoModelForCausalLM`, float32, one thread), the prompts arbor's (`env_prompt_ids`, `--prompt-format`).

    uv run python benchmarks/reverse_text_ceiling.py OUT/sft OUT/broadcasts/step_60 --samples 8

`--smoke` (no directories) measures a tiny random Llama written to a temporary directory on 4 tasks. The last
line is JSON: `value` is the first directory's greedy reward minus its sampled reward (the headroom that
sharpening alone can turn into a rise), `target` issue 34's rise of 0.1, and `dirs` every directory's figures.
Figures measured are kept in docs/models.md, not here.
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import tempfile
from pathlib import Path

import torch
import transformers
from smoke import parse_args

from arbor.config.environment import EnvironmentConfig
from arbor.config.model import ModelConfig
from arbor.environments import env_prompt_ids, load_environment
from arbor.models import build_tokenizer
from arbor.models.presets import PRESETS
from arbor.models.tokenizer import ByteTokenizer

TARGET = 0.1
ENV_ARGS = {"min_len": 2, "max_len": 5, "alphabet": "abcdefgh"}


def complete(model, prompt: list[int], eos: int, greedy: bool, max_tokens: int = 16) -> list[int]:
    """One completion's token ids, up to and including `eos` (the engine's `max_tokens` cut otherwise)."""
    ids, out = torch.tensor([prompt]), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        token = int(logits.argmax()) if greedy else int(torch.multinomial(torch.softmax(logits, -1), 1))
        out.append(token)
        if token == eos:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


def measure(path: Path, tasks: list[dict], prompt_format: str, samples: int, seed: int) -> dict:
    """Greedy and sampled figures of one checkpoint directory over `tasks`."""
    tokenizer = build_tokenizer(ModelConfig(name=str(path)))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    env = load_environment(EnvironmentConfig(id="reverse_text", prompt_format=prompt_format, args=ENV_ARGS))
    torch.manual_seed(seed)
    figures: dict = {"dir": str(path)}
    for mode in ("greedy", "sampled"):
        rewards, exact, lengths, by_len = [], 0, [], {}
        for i, task in enumerate(tasks):
            prompt = env_prompt_ids(env, task, tokenizer, prompt_format)
            ids = complete(model, prompt, tokenizer.eos_token_id, greedy=mode == "greedy")
            text = tokenizer.decode([t for t in ids if t != tokenizer.eos_token_id]).strip()
            reward = difflib.SequenceMatcher(None, text, task["answer"]).ratio()
            rewards.append(reward)
            exact += text == task["answer"]
            lengths.append(len(ids))
            by_len.setdefault(len(task["text"]), []).append(reward)
            if mode == "greedy" and i < samples:
                print(f"{path.name}: {tokenizer.decode(prompt)!r} -> {text!r} (want {task['answer']!r}, {reward:.2f})")
        figures[mode] = round(statistics.mean(rewards), 4)
        figures[f"{mode}_exact"] = round(exact / len(tasks), 4)
        figures[f"{mode}_len"] = round(statistics.mean(lengths), 3)
        if mode == "greedy":
            figures["greedy_by_len"] = {k: round(statistics.mean(v), 3) for k, v in sorted(by_len.items())}
    return figures


def tiny_llama(path: Path, preset: str | None = None, seed: int = 0) -> Path:
    """A random `LlamaForCausalLM` with the byte tokenizer: ~20k parameters (the smoke run's checkpoint), or of arbor
    preset `preset`'s shape as a user brings one (transformers' own initialisation from `seed`, untied head, no q/k
    norm: issue 34's Llama, as tests/hf_tiny.py writes it)."""
    byte = ByteTokenizer()
    shape = dict(vocab_size=byte.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    shape.update(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    if preset is not None:
        p = PRESETS[preset]
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        names += ("num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings")
        shape = {k: getattr(p, k) for k in names}
    config = transformers.LlamaConfig(pad_token_id=byte.pad_token_id, eos_token_id=byte.eos_token_id, **shape)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    byte.save(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="Hugging Face checkpoint directories")
    parser.add_argument("--prompt-format", default="raw", choices=["raw", "chat"])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--samples", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="the sampled completions' torch seed")
    args = parse_args(parser, tasks=4)
    if not args.dirs and not args.smoke:
        parser.error("dirs: give at least one checkpoint directory (or --smoke)")
    if not args.dirs:
        scratch = tempfile.TemporaryDirectory(prefix="reverse_text_ceiling_")  # removed at exit
        args.dirs = [tiny_llama(Path(scratch.name) / "tiny")]
    for path in args.dirs:
        if not (path / "config.json").is_file():
            parser.error(f"dirs: {path} is not a Hugging Face checkpoint directory (no config.json)")
    if args.tasks < 1:
        parser.error(f"--tasks: need at least 1, got {args.tasks}")
    torch.set_num_threads(1)
    env = load_environment(EnvironmentConfig(id="reverse_text", args=ENV_ARGS))
    tasks = env.dataset(123)[: args.tasks]
    results = []
    for path in args.dirs:
        results.append(measure(path, tasks, args.prompt_format, args.samples, args.seed))
        print(json.dumps(results[-1]))
    headroom = results[0]["greedy"] - results[0]["sampled"]
    summary = {"benchmark": "reverse_text_ceiling", "value": round(headroom, 4), "target": TARGET}
    print(json.dumps({**summary, "ok": headroom >= TARGET, "dirs": results}))


if __name__ == "__main__":
    main()
