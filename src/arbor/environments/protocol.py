"""The Environment protocols: tasks in, prompts out, completions (or whole episodes) scored into named reward
components.

An environment is built from `[orchestrator.environment]`: `id` names a built-in (one of
arbor.registry.ENVIRONMENTS, which gives its factory and its arguments model) or a dotted path
`package.module:factory`; `args` are the factory's keyword arguments. Every call is async so that verifiers,
tools and sandboxes never block the orchestrator's event loop.

Two shapes:
- `Environment` (single turn): `prompt(task)` is completed once and `score(task, completion)` rewards it.
- `MultiTurnEnvironment`: an episode. The driver (arbor.orchestrator.episode) asks `setup(task)` for a fresh
  per-episode state (any object; it lives in the driver coroutine, so it survives across turns and across
  partial rollouts, which only suspend that coroutine), sends `prompt(task)` with the schemas of `tools(task)`
  (plain Python functions: name, docstring and type hints make the schema, see arbor.environments.tools), then
  after each assistant turn calls `step(task, state, messages)`: the environment answers with the messages to
  append (tool results, a user turn) and whether the episode is done; finally `score_episode(task, state,
  messages)` gives the reward components. `arbor.environments.multiturn.ToolEnv` implements tool calling
  (Qwen3/Hermes `<tool_call>` markup) and is the usual base class.

Failures: each environment call runs under `[orchestrator.environment] timeout` and is retried `retries` times;
a call that still fails makes the rollout score 0 (`score_failed`, counted) or, with `on_failure = "skip"`,
drops it (counted). No failure hangs the run or disappears silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from arbor.config.base import ConfigError
from arbor.config.environment import EnvironmentConfig
from arbor.environments.tools import tool_schema
from arbor.models.image_parts import ImageRefused, image_parts, refuse_images_for_text_model
from arbor.models.tokenizer import Tokenizer
from arbor.registry import ENVIRONMENTS

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


@dataclasses.dataclass
class StepResult:
    """The environment's answer to one assistant turn."""

    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Messages appended to the conversation (tool results as role "tool", user turns)."""
    done: bool = False
    """The episode is over (the agent answered, gave up, or broke a rule)."""
    reward: float | None = None
    """An optional process reward for this turn; when any turn has one, the rollout carries per-turn rewards
    and advantages are reward-to-go (arbor.orchestrator.advantages)."""


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    name: str
    max_turns: int
    """Most assistant turns of an episode (`[orchestrator.environment] max_turns` overrides it)."""

    def dataset(self, seed: int) -> list[Task]: ...

    def prompt(self, task: Task) -> list[dict[str, Any]]:
        """The episode's first messages."""
        ...

    def reference(self, task: Task) -> str | None: ...

    def tools(self, task: Task) -> list[Callable[..., Any]]:
        """The functions the model may call in this task (their schemas go into the chat template)."""
        ...

    async def setup(self, task: Task) -> Any:
        """A fresh per-episode state."""
        ...

    async def step(self, task: Task, state: Any, messages: list[dict[str, Any]]) -> StepResult:
        """React to the assistant's latest turn (the last message of `messages`). A failed or timed-out step is
        retried with the same arguments, so change `state` only once the step cannot fail any more."""
        ...

    async def score_episode(self, task: Task, state: Any, messages: list[dict[str, Any]]) -> dict[str, float]:
        """Reward components of the finished episode (`messages` is the full, untrimmed conversation)."""
        ...


def is_multi_turn(env: Any) -> bool:
    return isinstance(env, MultiTurnEnvironment)


RAW_SEPARATOR = "\n\n"
"""What follows each message of a raw prompt, the last one included: the completion starts a paragraph of its own."""


def raw_prompt(messages: list[dict[str, Any]]) -> str:
    """A prompt without a chat template (`prompt_format = "raw"`): the messages' contents, each followed by a blank
    line. The last one marks where the completion starts, as a chat template's generation prompt does: glued to
    the task's text, an answer cannot be told from it (reverse_text's "Reverse: ab" + "ba" reads as the task "abb"
    answered with "a" as well): docs/models.md's tiny Llama ended reverse_text at 0.49 that way, 0.78 this way."""
    return "".join(m["content"] + RAW_SEPARATOR for m in messages if m.get("content"))


def env_prompt_ids(env: Any, task: Task, tokenizer: Tokenizer, prompt_format: str = "chat") -> list[int]:
    """The first prompt's token ids: through the chat template, with the task's tool schemas for a multi-turn
    environment, or (`prompt_format = "raw"`) the raw prompt's text tokenised as it is, after the ids the
    tokenizer puts before any text (a base model's BOS)."""
    return env_prompt(env, task, tokenizer, prompt_format)[0]


def env_prompt(
    env: Any, task: Task, tokenizer: Tokenizer, prompt_format: str = "chat"
) -> tuple[list[int], dict[str, Any] | None]:
    """`env_prompt_ids` and the prompt's image inputs (`pixel_values`, `image_grid_thw`; None without images):
    image content parts are rendered by a vision-language model's tokenizer (arbor.models.vision), with a
    multi-turn environment's tool schemas, and refused in one line for any other tokenizer. (Later turns of an
    episode add their images through arbor.orchestrator.trajectory, which renders the whole conversation.)"""
    messages = env.prompt(task)
    if image_parts(messages):
        if not hasattr(tokenizer, "render_images"):
            refuse_images_for_text_model(messages, tokenizer.name)
        if prompt_format == "raw":
            raise ImageRefused(
                f"environment {env.name!r}: prompts with images need the chat template (prompt_format = 'chat')"
            )
        tools = ([tool_schema(fn) for fn in env.tools(task)] or None) if is_multi_turn(env) else None
        prompt = tokenizer.render_images(messages, add_generation_prompt=True, tools=tools)
        if not prompt.num_images:
            return prompt.ids, None
        return prompt.ids, {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
    return _text_prompt_ids(env, task, messages, tokenizer, prompt_format), None


def _text_prompt_ids(
    env: Any, task: Task, messages: list[dict[str, Any]], tokenizer: Tokenizer, prompt_format: str
) -> list[int]:
    if prompt_format == "raw":
        if is_multi_turn(env):
            raise ValueError(
                f"environment {env.name!r} is multi-turn: prompt_format = 'raw' suits single-turn "
                "environments only (turns need the chat template)"
            )
        return [*tokenizer.prompt_prefix, *tokenizer.encode(raw_prompt(messages))]
    tools = None
    if is_multi_turn(env):
        tools = [tool_schema(fn) for fn in env.tools(task)] or None
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)


class NoTaskFits(ConfigError):
    """No task of the dataset leaves room for a completion: the run could only skip tasks forever."""


def check_some_task_fits(
    env: Any, tasks: list[Task], tokenizer: Tokenizer, seq_len: int, max_tokens: int, prompt_format: str = "chat"
) -> None:
    """Raises NoTaskFits unless some task's first prompt plus `max_tokens` fits in `seq_len` (stops at the first
    that does; when none does, the message names the shortest prompt). The orchestrator skips (and counts) the
    tasks that cannot fit; preflight and the task source call this so that a dataset of them all fails at once."""
    if not tasks:
        raise NoTaskFits(f"environment {env.name!r} has no tasks")
    shortest, failed = None, None
    for task in tasks:
        try:
            n = len(env_prompt_ids(env, task, tokenizer, prompt_format))
        except Exception as e:  # noqa: BLE001 - a task whose prompt cannot be built is skipped in the run, too
            failed = failed or f"task {task.get('id', '?')}: {e!r}"
            continue
        if n + max_tokens <= seq_len:
            return
        shortest = n if shortest is None else min(shortest, n)
    if shortest is None:
        raise NoTaskFits(f"no prompt of environment {env.name!r} could be built ({failed})")
    raise NoTaskFits(
        f"no task of environment {env.name!r} fits: its shortest prompt is {shortest} tokens, which with "
        f"sampling.max_tokens = {max_tokens} exceeds seq_len = {seq_len}; raise seq_len or lower max_tokens"
    )


def load_environment(cfg: EnvironmentConfig) -> Environment | MultiTurnEnvironment:
    """Builds `cfg.id` (a built-in of arbor.registry.ENVIRONMENTS, or a factory by dotted path) with `cfg.args`."""
    factory = ENVIRONMENTS.load(cfg.id)
    env = factory(**cfg.args)
    if not isinstance(env, (Environment, MultiTurnEnvironment)):
        raise TypeError(
            f"environment {cfg.id!r} implements neither arbor.environments.Environment nor MultiTurnEnvironment"
        )
    return env


def total_reward(components: dict[str, float], weights: dict[str, float]) -> float:
    return float(sum(weights.get(k, 1.0) * v for k, v in components.items()))
