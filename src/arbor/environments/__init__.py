"""Environments: the protocols and the built-ins."""

from arbor.environments.protocol import (
    Environment,
    MultiTurnEnvironment,
    NoTaskFits,
    StepResult,
    Task,
    check_some_task_fits,
    env_prompt,
    env_prompt_ids,
    is_multi_turn,
    load_environment,
    total_reward,
)

__all__ = [
    "Environment",
    "MultiTurnEnvironment",
    "NoTaskFits",
    "StepResult",
    "Task",
    "check_some_task_fits",
    "env_prompt",
    "env_prompt_ids",
    "is_multi_turn",
    "load_environment",
    "total_reward",
]
