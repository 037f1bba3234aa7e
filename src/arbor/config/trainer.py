"""`trainer` process config: the RL loop's optimizer, loss, checkpoints and weight publishing."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from arbor.config.base import Config
from arbor.config.transport import WeightTransportConfig
from arbor.config.model import ModelConfig


class OptimConfig(Config):
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""


class LossConfig(Config):
    name: str = "ppo_clip"
    """Policy loss: "ppo_clip" (token-level clipped importance ratio), "is_mask" (trust-region mask), or a
    dotted path `module:function` implementing arbor.trainer.loss.LossFn."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """Lower bound of the trust region: ratio >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """Upper bound of the trust region: ratio <= 1 + clip_high (DAPO's clip-higher when above clip_low)."""


class CheckpointConfig(Config):
    interval: int = Field(10, ge=1)
    """Save trainer state every this many steps (and at the last step)."""
    keep: int = Field(2, ge=1)
    """Checkpoints to retain."""


class ParallelConfig(Config):
    nproc: int = Field(1, ge=1)
    """Trainer ranks on this node (torchrun --nproc-per-node). Parameters are FSDP2-sharded across them."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: auto = nccl with CUDA, gloo on CPU."""


class TrainerConfig(Config):
    """Trains the policy on the orchestrator's batches and publishes its weights after every step."""

    model: ModelConfig = ModelConfig()
    """The model to train."""
    output_dir: Path = Path("outputs/run")
    """Run directory shared with the orchestrator."""
    max_steps: int = Field(20, ge=1)
    """Optimizer steps to take."""
    seed: int = 0
    """Seed of anything random in training."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    loss: LossConfig = LossConfig()
    """Policy loss."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    parallel: ParallelConfig = ParallelConfig()
    """Parallelism."""
    weights: WeightTransportConfig = WeightTransportConfig()
    """Weight transfer from the trainer (shared with `inference`/`trainer`; set it at the top level under `rl`)."""
    keep_broadcasts: int = Field(3, ge=1)
    """Published weight directories to retain."""
    rollout_timeout: float = Field(3600.0, gt=0)
    """Seconds to wait for a step's rollouts before failing."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads per rank; default: torch's choice."""
