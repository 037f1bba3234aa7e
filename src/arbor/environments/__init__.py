"""Environments: the protocol and the built-ins."""

from arbor.environments.base import Environment, Task, load_environment, load_object, total_reward

__all__ = ["Environment", "Task", "load_environment", "load_object", "total_reward"]
