"""Environments: the protocols and the built-ins."""

from arbor.environments.base import (
    Environment,
    MultiTurnEnvironment,
    StepResult,
    Task,
    env_prompt_ids,
    is_multi_turn,
    load_environment,
    load_object,
    total_reward,
)

__all__ = [
    "Environment", "MultiTurnEnvironment", "StepResult", "Task", "env_prompt_ids", "is_multi_turn",
    "load_environment", "load_object", "total_reward",
]
