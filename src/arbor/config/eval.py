"""`eval` process config, and `[orchestrator.eval]` (periodic evaluation during `rl`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from arbor.config.base import Config, Count, FilePath, Float, Int, Ranks, Seed, Temperature, Tokens
from arbor.config.environment import EnvironmentConfig
from arbor.config.model import ModelConfig


class EvalSettings(Config):
    environments: list[EnvironmentConfig] = [EnvironmentConfig()]
    """Eval environments; each is scored on its own first `num_tasks` tasks."""
    num_tasks: Count = Field(32, ge=1)
    """Tasks per environment (the first ones of `dataset(seed)`)."""
    k: Count = Field(4, ge=1)
    """Samples per task: avg@k is the mean reward over them, pass@k the fraction of tasks solved at least once."""
    temperature: Temperature = 1.0
    """Sampling temperature."""
    max_tokens: Tokens = Field(64, ge=1)
    """Most tokens per completion."""
    top_p: Float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    solve_threshold: Float = 1.0
    """A sample with at least this reward solves its task (pass@k)."""
    seed: Seed = 0
    """Seed of the task datasets and of the samples."""


class OrchestratorEvalConfig(EvalSettings):
    interval: Int = Field(0, ge=0)
    """Evaluate the served policy every this many steps during `rl` (0: never); figures go to metrics.jsonl as
    `eval/<environment>/avg@k` and `eval/<environment>/pass@k`."""


class EvalConfig(EvalSettings):
    """Evaluates a model (a preset or a Hugging Face checkpoint directory) on eval environments: avg@k, pass@k."""

    model: ModelConfig = ModelConfig()
    """The model to evaluate: `model.name` may be a checkpoint directory such as `<run>/broadcasts/step_N`."""
    output_dir: FilePath = Path("outputs/eval")
    """Results are appended to `<output_dir>/eval.jsonl`, one JSON object per run."""
    base_url: str | None = None
    """Evaluate through a running inference server; default: arbor's local engine in this process."""
    seq_len: Tokens = Field(512, ge=8)
    """Longest prompt + completion (the local engine's KV cache length)."""
    max_batch_size: Count = Field(64, ge=1)
    """Local engine: sequences decoded at once."""
    num_threads: Ranks | None = Field(None, ge=1)
    """torch intra-op threads for the local engine."""
