"""`orchestrator` process config: rollouts, rewards, advantages, batching and the off-policy bound."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from arbor.config.base import Config
from arbor.config.environment import EnvironmentConfig
from arbor.config.model import ModelConfig
from arbor.config.monitor import WandbConfig


class SamplingConfig(Config):
    max_tokens: int = Field(64, ge=1)
    """Most tokens generated per completion."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 the trainer's logprobs no longer describe the sampler exactly."""


class ClientConfig(Config):
    base_urls: list[str] = ["http://127.0.0.1:8000"]
    """Inference servers (or one router). `rl` fills this in."""
    admin_urls: list[str] = []
    """Where weight updates, pause and resume go when not to `base_urls` (e.g. every backend behind a router
    without admin fan-out, such as vllm-router); empty means `base_urls`. `rl` fills this in."""
    timeout: float = Field(600.0, gt=0)
    """Seconds one generation request may take."""
    max_retries: int = Field(3, ge=0)
    """Retries of a failed request (connection errors and 5xx) before the run fails."""


class AdvantageConfig(Config):
    name: str = "grpo"
    """Advantage function: "grpo" (reward minus group mean) or a dotted path `module:function`."""
    std_normalize: bool = False
    """Divide by the group's reward standard deviation (GRPO); off is Dr. GRPO's unbiased choice."""


class BatchingConfig(Config):
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch row; a longer sample gets a row of its own."""
    trainer_ranks: int = Field(1, ge=1)
    """Trainer data-parallel ranks to write a file for; `rl` sets it from the trainer's world size."""


class OrchestratorConfig(Config):
    """Samples tasks, generates rollouts through the inference API, scores them and writes training batches."""

    model: ModelConfig = ModelConfig()
    """The model (the orchestrator only loads its tokenizer)."""
    output_dir: Path = Path("outputs/run")
    """Run directory shared with the trainer."""
    max_steps: int = Field(20, ge=1)
    """Training steps to produce batches for."""
    seq_len: int = Field(512, ge=8)
    """Longest sample (prompt + completion); longer prompts are skipped and counted."""
    seed: int = 0
    """Seed of task sampling and of per-request sampling seeds."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; the trainer scales its logits by the same value."""
    batch_size: int = Field(64, ge=1)
    """Rollouts per training step (a multiple of group_size)."""
    group_size: int = Field(8, ge=1)
    """Rollouts per task; advantages are relative to the group."""
    async_lag: int = Field(1, ge=0)
    """How many steps generation may run ahead of training: 0 = synchronous on-policy, 1 = one-step overlap."""
    max_off_policy_steps: int = Field(2, ge=0)
    """Drop (and count) rollouts with a token sampled more than this many policy versions before the step."""
    max_concurrent_groups: int | None = Field(None, ge=1)
    """Groups in flight at once; default: one step's worth of groups."""
    resume: bool = False
    """Continue from the latest trainer checkpoint in output_dir."""
    weight_update_timeout: float = Field(1800.0, gt=0)
    """Seconds to wait for the trainer to publish the weights a step needs before failing."""
    sampling: SamplingConfig = SamplingConfig()
    """Generation settings."""
    client: ClientConfig = ClientConfig()
    """How to reach the inference servers."""
    environment: EnvironmentConfig = EnvironmentConfig()
    """The environment."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimation."""
    batching: BatchingConfig = BatchingConfig()
    """Packing into micro-batches."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases when present."""
    log_level: Literal["debug", "info", "warning"] = "info"
    """Log verbosity."""

    @model_validator(mode="after")
    def _batch_is_whole_groups(self) -> "OrchestratorConfig":
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
        if self.sampling.max_tokens >= self.seq_len:
            raise ValueError(f"sampling.max_tokens ({self.sampling.max_tokens}) must be below seq_len ({self.seq_len})")
        return self
