"""`[cost]`: what a GPU-hour costs, for the dollars-per-million-tokens figure of `arbor-report`."""

from __future__ import annotations

from pydantic import Field

from arbor.config.base import Config, Float, Ranks


class CostConfig(Config):
    """Cost = gpu_hour_usd x (inference_gpus x inference wall-clock hours + trainer_gpus x trainer wall-clock hours)."""

    gpu_hour_usd: Float = Field(0.0, ge=0)
    """Price of one GPU-hour in US dollars (on CPU runs: of whatever one "GPU" stands for); 0 = no cost figure."""
    inference_gpus: Ranks | None = Field(None, ge=0)
    """GPUs of the inference pool; default: 1 (one server), or slurm.inference_nodes x slurm.gpus_per_node."""
    trainer_gpus: Ranks | None = Field(None, ge=0)
    """GPUs of the trainer pool; default: trainer.parallel.nproc (x slurm.trainer_nodes in the multi-node layout)."""
