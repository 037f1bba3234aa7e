"""What both arms of vs_trl.py share: the matched task's settings, the random checkpoint both load, the reward
(reverse_text's own `similarity`), the held-out greedy evaluation and the reward curve's summary. A helper of
benchmarks/vs_trl.py, not a benchmark."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
import transformers

from arbor.environments.reverse_text import ReverseTextEnv
from arbor.models.presets import BYTE_VOCAB
from arbor.models.tokenizer import ByteTokenizer

ENV_ARGS = {"min_len": 2, "max_len": 5, "alphabet": "abcdefgh"}
PROMPTS, GROUP, MAX_TOKENS = 8, 8, 12
HELD_OUT, HELD_OUT_SEED = 64, 12345


def build_checkpoint(path: Path, seed: int) -> Path:
    """A random ~0.58M-parameter Qwen3 with arbor's byte tokenizer, in the Hugging Face layout both arms load."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=BYTE_VOCAB,
        hidden_size=96,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    ByteTokenizer().save(path)
    return path


@torch.no_grad()
def held_out_reward(model_dir: Path) -> float:
    """Mean greedy reward of the weights in `model_dir` on HELD_OUT tasks of another seed than training's."""
    env, tok = ReverseTextEnv(**ENV_ARGS), ByteTokenizer()
    tasks = env.dataset(HELD_OUT_SEED)[:HELD_OUT]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template(env.prompt(t)) for t in tasks]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    texts = []
    for row in out[:, width:].tolist():
        row = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
        texts.append(tok.decode(row))
    scores = asyncio.run(score(env, tasks, texts))
    return sum(scores) / len(scores)


async def score(env: ReverseTextEnv, tasks: list[dict], texts: list[str]) -> list[float]:
    return [(await env.score(t, x))["similarity"] for t, x in zip(tasks, texts)]


def reward_curve_summary(curve: list[tuple[float, float]], gain: float, window: int) -> dict[str, float | None]:
    """Steps and seconds until the trailing-window mean reward is `gain` above the first window's mean.
    `curve` holds (seconds since the first generation, the step's mean reward), one entry per step."""
    if len(curve) < window:
        return {"steps_to_gain": None, "seconds_to_gain": None, "first_window": None, "last_window": None}
    rewards = [r for _, r in curve]
    base = sum(rewards[:window]) / window
    hit = None
    for i in range(window, len(curve) + 1):
        if sum(rewards[i - window : i]) / window - base >= gain:
            hit = i
            break
    return {
        "steps_to_gain": hit,
        "seconds_to_gain": None if hit is None else round(curve[hit - 1][0], 2),
        "first_window": round(base, 4),
        "last_window": round(sum(rewards[-window:]) / window, 4),
    }
