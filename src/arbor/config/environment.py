"""`[orchestrator.environment]`: the environment that turns tasks into prompts and completions into rewards."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from arbor.config.base import Config


class EnvironmentConfig(Config):
    id: str = "reverse_text"
    """A built-in environment name or a dotted path `package.module:function` returning an Environment."""
    args: dict[str, Any] = {}
    """Keyword arguments for the environment's constructor."""
    reward_weights: dict[str, float] = {}
    """Weights of named reward components (default 1.0 each); the reward is their weighted sum."""
    timeout: float = Field(60.0, gt=0)
    """Seconds a single scoring call may take before the rollout is scored as failed (reward 0)."""
