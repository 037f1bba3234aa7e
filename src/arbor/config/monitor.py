"""`[wandb]`: Weights & Biases logging (the local metrics.jsonl is always written)."""

from __future__ import annotations

from arbor.config.base import Config


class WandbConfig(Config):
    project: str = "arbor"
    """W&B project."""
    name: str | None = None
    """Run name; default: the output directory's name."""
    entity: str | None = None
    """W&B entity (team or user)."""
    offline: bool | None = None
    """Log offline; default: offline when no WANDB_API_KEY is set."""
    tags: list[str] = []
    """Run tags."""
