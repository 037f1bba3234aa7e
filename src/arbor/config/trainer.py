"""`trainer` process config: the RL loop's optimizer, loss, checkpoints and weight publishing."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from arbor.config.base import Config
from arbor.config.model import ModelConfig


class OptimConfig(Config):
    name: Literal["adamw", "muon"] = "adamw"
    """Optimizer: "adamw", or "muon" (torch.optim.Muon on 2-D weight matrices; AdamW on embeddings, the head,
    norms, routers and 3-D expert weights)."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW's; Muon's too unless muon_lr is set)."""
    muon_lr: float | None = Field(None, gt=0)
    """Muon's learning rate; default: lr."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """Muon's momentum."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""


class SchedulerConfig(Config):
    name: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up: constant, linear decay or cosine decay to min_lr_ratio x lr at
    max_steps."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to lr."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate of the decaying schedules, as a fraction of lr."""


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
    """Mesh of the trainer ranks: world = dp_replicate x dp_shard x cp; ep folds into dp_shard x cp."""

    nproc: int = Field(1, ge=1)
    """Trainer ranks on this node (torchrun --nproc-per-node). Parameters are FSDP2-sharded across them."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: auto = nccl with CUDA, gloo on CPU."""
    dp_replicate: int = Field(1, ge=1)
    """HSDP replica groups (parameters replicated across groups, sharded within); 1 = plain FSDP2."""
    dp_shard: int = Field(-1, ge=-1)
    """FSDP2 shard degree; -1 = the ranks left over by dp_replicate and cp."""
    cp: int = Field(1, ge=1)
    """Context parallel degree: each packed row is split over this many ranks (attention heads must divide by
    it for Ulysses)."""
    cp_style: Literal["ulysses", "ring"] = "ulysses"
    """Context parallel attention: "ulysses" (all-to-all from sequence to head sharding) or "ring" (key/value
    chunks passed around the ranks, online-softmax merge; zig-zag load-balanced sharding)."""
    ep: int = Field(1, ge=1)
    """Expert parallel degree for MoE models: experts are split over this many ranks, a divisor of
    dp_shard x cp (and of the number of experts)."""
    ep_backend: Literal["all_to_all", "deepep"] = "all_to_all"
    """Token dispatch: "all_to_all" (torch collectives; gloo and NCCL) or "deepep" (DeepEP kernels; CUDA with
    the optional deep_ep package)."""
    ep_max_tokens_per_rank: int = Field(8192, ge=1)
    """DeepEP buffer size: the most tokens one rank dispatches in a forward."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations."""


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
    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""
    loss: LossConfig = LossConfig()
    """Policy loss."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    parallel: ParallelConfig = ParallelConfig()
    """Parallelism."""
    keep_broadcasts: int = Field(3, ge=1)
    """Published weight directories to retain."""
    rollout_timeout: float = Field(3600.0, gt=0)
    """Seconds to wait for a step's rollouts before failing."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads per rank; default: torch's choice."""
