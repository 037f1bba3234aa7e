"""`sft` process config: supervised fine-tuning on prompt/completion pairs (also `rl`'s optional warm-up)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from arbor.config.base import Config, Count, FilePath, Float, Int, Ranks, Seed, Tokens
from arbor.config.environment import EnvironmentConfig
from arbor.config.model import ModelConfig
from arbor.config.trainer import DraftConfig


class SFTConfig(Config):
    """Cross-entropy on completion tokens; writes a Hugging Face checkpoint directory to `<output_dir>/sft`."""

    model: ModelConfig = ModelConfig()
    """The model to fine-tune."""
    output_dir: FilePath = Path("outputs/run")
    """Run directory; the result goes to `<output_dir>/sft/`."""
    seq_len: Tokens = Field(512, ge=8)
    """Longest example; longer ones are skipped."""
    seed: Seed = 0
    """Seed of example order."""
    steps: Int = Field(0, ge=0)
    """Optimizer steps; 0 disables the warm-up in `rl`."""
    batch_size: Count = Field(32, ge=1)
    """Examples per step."""
    row_tokens: Tokens = Field(512, ge=8)
    """A step's examples are packed in order into rows of up to the larger of this and `seq_len` tokens, each row
    one forward and backward under a block-diagonal mask (the loss is the same however they are packed). Rows of
    one short example each cost the per-row overhead many times over: the reverse_text warm-up (~40-token
    examples, `seq_len` 64) trains 2.5x faster on one CPU thread in 512-token rows than in 64-token ones, with
    the same loss; longer rows cost dense attention over the whole row on CPU (1024: slower again)."""
    lr: Float = Field(1e-3, gt=0)
    """AdamW learning rate (linear warm-up over the first 10% of steps, then constant)."""
    max_norm: Float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""
    data: str | None = None
    """A JSONL or parquet file of {"prompt": ..., "completion": ...} or {"messages": [...]} rows (every assistant
    turn of a messages row is trained on, the rest masked); default: the environment's reference answers."""
    environment: EnvironmentConfig = EnvironmentConfig()
    """Environment whose tasks and reference answers form the data when `data` is not set."""
    num_threads: Ranks | None = Field(None, ge=1)
    """torch intra-op threads; default: torch's choice."""
    adapter: bool = True
    """With `[model.lora]`: train an adapter (written merged into `sft/`, and as `sft/adapter/`); false trains
    the full weights, the base `rl` then trains its adapter on (for a model that is not pretrained, as the
    presets are: an adapter on frozen random embeddings learns little)."""
    draft: DraftConfig = DraftConfig()
    """The model's MTP draft modules (`model.mtp_depth` > 0) are fitted to the fine-tuned policy as it trains (the
    same top-K KL as `[trainer.draft]`, on the SFT rows), so RL starts with drafts that match its starting policy;
    `enabled = false` keeps them as loaded. Independent of `trainer.draft`, which governs the RL steps only."""
