"""What both arms of vs_trl.py share: the matched task's settings, the random checkpoint both load, the reward
(reverse_text's own `similarity`), the held-out greedy evaluation and the reward curve's summary; and the GRPO
settings TRL's arm takes (`GRPOSettings`, `trl_grpo_config`, also warm_start_vs_trl.py's). A helper of the
benchmarks, not a benchmark."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
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


def newest_published(run: Path) -> Path | None:
    """The newest weights an `rl` run published in full (`<run>/broadcasts/step_N` with its STABLE marker)."""
    done = [p for p in (run / "broadcasts").glob("step_*") if (p / "STABLE").exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


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


@dataclass(frozen=True)
class GRPOSettings:
    """A GRPO run's settings as TRL's `GRPOConfig` takes them; the defaults are vs_trl.py's matched ones. In arbor's
    terms: `prompts * group` = orchestrator.batch_size, one optimizer step per batch (trainer.mini_batches = 1,
    epochs = 1), the clipped ratio normalised by the step's loss tokens (TRL `loss_type = "dapo"`), a constant lr
    without warm-up."""

    prompts: int = PROMPTS
    group: int = GROUP
    max_tokens: int = MAX_TOKENS
    lr: float = 3e-4
    temperature: float = 1.0
    top_p: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    std_normalize: bool = False
    kl_coef: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_norm: float = 1.0
    steps: int = 1_000_000
    """Optimizer steps (vs_trl.py stops on its clock instead)."""
    shuffle: bool = False
    """Draw the tasks shuffled (arbor's orchestrator draws them in order)."""


def trl_grpo_config(out: Path, seed: int, s: GRPOSettings):
    """TRL's `GRPOConfig` for `s` on CPU in float32, logging every step, saving nothing (trl is imported here:
    the benchmarks run without it, skipping its arm)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        seed=seed,
        per_device_train_batch_size=s.prompts * s.group,
        num_generations=s.group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0,
        beta=s.kl_coef,
        epsilon=s.clip_low,
        epsilon_high=s.clip_high,
        loss_type="dapo",
        scale_rewards="group" if s.std_normalize else "none",
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=s.weight_decay,
        adam_beta1=s.betas[0],
        adam_beta2=s.betas[1],
        adam_epsilon=s.eps,
        max_grad_norm=s.max_norm,
        optim="adamw_torch",
        max_steps=s.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=s.shuffle,
    )
