"""The Environment protocol: tasks in, prompts out, completions scored into named reward components.

An environment is built from `[orchestrator.environment]`: `id` names a built-in (`reverse_text`) or a dotted
path `package.module:factory`; `args` are the factory's keyword arguments. Scoring is async so that verifiers
can call sandboxes or judges without blocking the orchestrator's event loop.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from arbor.config.environment import EnvironmentConfig

Task = dict[str, Any]
"""One dataset row. Built-ins keep the chat prompt under "prompt" and a reference answer under "answer"."""


@runtime_checkable
class Environment(Protocol):
    name: str

    def dataset(self, seed: int) -> list[Task]:
        """All tasks of the training split, in a fixed order for `seed` (the orchestrator shuffles per epoch)."""
        ...

    def prompt(self, task: Task) -> list[dict[str, str]]:
        """The chat messages the model completes."""
        ...

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        """Reward components of one completion (each usually in [0, 1])."""
        ...

    def reference(self, task: Task) -> str | None:
        """A correct completion for supervised warm-up, or None when the task has none."""
        ...


BUILTINS = {
    "reverse_text": "arbor.environments.reverse_text:ReverseTextEnv",
    "black_box": "arbor.environments.black_box:BlackBoxEnv",
}


def load_object(path: str) -> Any:
    """Imports `package.module:attr` (or `package.module.attr`)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"{path!r} is not a dotted path 'package.module:name'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from None


def load_environment(cfg: EnvironmentConfig) -> Environment:
    factory = load_object(BUILTINS.get(cfg.id, cfg.id))
    env = factory(**cfg.args)
    if not isinstance(env, Environment):
        raise TypeError(f"environment {cfg.id!r} does not implement arbor.environments.Environment")
    return env


def total_reward(components: dict[str, float], weights: dict[str, float]) -> float:
    return float(sum(weights.get(k, 1.0) * v for k, v in components.items()))
