"""Typed `[orchestrator.environment.args]` of the registered environments, checked with the rest of the config.

Each environment of arbor.registry.ENVIRONMENTS names its arguments model (a subclass of `EnvArgs`) by dotted
path: its fields are the keyword arguments of the environment's factory with the same defaults
(tests/config/test_config.py holds the two together). The built-ins' models are here, so that validating a config
imports no environment code; a new environment may keep its model in its own module. `check_env_args` answers a
misspelt argument with the closest known one, a wrong type or range with the argument's name, and contradictions
(min_len > max_len, a black-box agent given twice) in one line, so none of them reaches a running orchestrator;
an argument unlike any known one is refused by preflight (`strict`). Environments given by dotted path take
whatever arguments their factory takes (checked when preflight calls it).
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, model_validator

from arbor.config.base import Config, Count, Float, Int, Seconds, Seed
from arbor.registry import ENVIRONMENTS


class EnvArgsError(ValueError):
    """A complete one-line message about an environment's arguments (passed through by an enclosing check)."""


class EnvArgs(Config):
    """The arguments of one registered environment (arbor.registry.ENVIRONMENTS names it as the member's `args`)."""


class ReverseTextArgs(EnvArgs):
    num_tasks: Int = Field(20000, ge=1)
    min_len: Int = Field(3, ge=1)
    max_len: Int = Field(8, ge=1)
    alphabet: str = Field("abcdefghijklmnopqrstuvwxyz", min_length=1)
    system_prompt: str | None = None
    instruction: str = "Reverse: "

    @model_validator(mode="after")
    def _lengths(self) -> "ReverseTextArgs":
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) exceeds max_len ({self.max_len})")
        return self


class ShapesArgs(EnvArgs):
    """`shapes`: questions about an image drawn with PIL (vision-language models; arbor.environments.shapes)."""

    num_tasks: Int = Field(10000, ge=1)
    """Tasks generated from the seed."""
    kinds: tuple[Literal["colour", "count", "position"], ...] = Field(("colour",), min_length=1)
    """Questions asked: the square's colour, how many squares (1-4), or its side (left / right)."""
    image_size: Int = Field(32, ge=8, le=1024)
    """Image side in pixels."""


class MathArgs(EnvArgs):
    num_tasks: Int = Field(10000, ge=1)
    kinds: list[Literal["arithmetic", "fraction", "linear", "word", "percent"]] | None = Field(None, min_length=1)
    difficulty: Int = Field(1, ge=1, le=3)
    system_prompt: str | None = "Solve the problem. Put the final answer in \\boxed{}."
    format_weight: Float = 0.0
    dataset: str | None = Field(None, min_length=1)
    split: str = Field("train", min_length=1)
    dataset_config: str | None = Field(None, min_length=1)
    columns: dict[Literal["question", "answer"], str] | None = None
    answer_format: Literal["auto", "gsm8k", "math", "plain"] = "auto"


class ToolUseArgs(EnvArgs):
    num_tasks: Int = Field(5000, ge=1)
    kinds: list[Literal["calc", "lookup", "lookup_calc"]] | None = Field(None, min_length=1)
    num_towns: Count = Field(40, ge=1)
    corpus_seed: Seed = 0
    max_turns: Count = Field(4, ge=1)
    invalid_penalty: Float = 0.1
    process_penalty: Float = 0.0
    search_k: Int = Field(1, ge=1, le=5)
    nudge: str | None = "Call a tool or give the final answer in \\boxed{}."
    system_prompt: str | None = "Use the tools when needed. Put the final answer in \\boxed{}."


class CodeArgs(EnvArgs):
    num_tasks: Int = Field(48, ge=1)
    tests_per_task: Count = Field(6, ge=1)
    partial_credit: bool = True
    system_prompt: str | None = None
    max_concurrency: Count = Field(4, ge=1, le=64)  # the sandbox's slots (arbor.environments.sandbox.MAX_SLOTS)
    cpu_seconds: Int = Field(5, ge=1)
    wall_seconds: Seconds = Field(10.0, gt=0)
    memory_mb: Int = Field(1024, ge=1)
    file_size_mb: Int = Field(16, ge=1)
    max_processes: Count = Field(32, ge=1)
    max_output_bytes: Int = Field(64 * 1024, ge=1)
    dataset: str | None = Field(None, min_length=1)
    split: str = Field("train", min_length=1)
    dataset_config: str | None = Field(None, min_length=1)
    columns: dict[Literal["question", "entry", "tests", "answer"], str] | None = None


class VerifiersArgs(EnvArgs):
    env_id: str = Field(min_length=1)
    config: dict[str, Any] | None = None
    max_tasks: Int | None = Field(None, ge=1)
    name: str | None = None
    max_turns: Count = Field(6, ge=1)
    tool_timeout: Seconds = Field(10.0, gt=0)


class BlackBoxArgs(EnvArgs):
    command: list[str] | str | None = Field(None, min_length=1)
    function: str | None = Field(None, min_length=1)
    remote: bool = False
    tasks: str = "reverse_text"
    task_args: dict[str, Any] | None = None
    task_input: Literal["argv", "stdin", "env"] = "argv"
    timeout: Seconds = Field(60.0, gt=0)
    retries: Count = Field(1, ge=0)
    max_concurrent_agents: Count = Field(64, ge=1)
    extra_env: dict[str, str] | None = None

    @model_validator(mode="after")
    def _one_agent(self, info: ValidationInfo) -> "BlackBoxArgs":
        given = [k for k in ("command", "function") if getattr(self, k) is not None] + ["remote"] * self.remote
        if len(given) != 1:
            got = ", ".join(given) or "none"
            raise ValueError(f"give exactly one of command, function or remote = true (got {got})")
        if self.tasks == "black_box":
            raise ValueError("tasks cannot be 'black_box' itself")
        strict = bool(info.context and info.context.get("strict"))
        check_env_args(self.tasks, self.task_args or {}, "task_args.", strict)
        return self


class SweAgentArgs(EnvArgs):
    tasks: str = Field("examples/swe_agent/tasks.jsonl", min_length=1)
    max_turns: Count = Field(6, ge=1)
    invalid_penalty: Float = 0.05
    wall_seconds: Seconds = Field(10.0, gt=0)
    max_concurrency: Count = Field(4, ge=1, le=64)  # the sandbox's slots, as for `code`
    system_prompt: str | None = "Fix the repository. Tools: list_files, read_file, write_file, run_tests."


def check_env_args(env_id: str, args: dict[str, Any], prefix: str = "", strict: bool = False) -> None:
    """Raises ValueError (one line naming the argument, `prefix` before it) unless `args` suit the registered
    environment `env_id` (its arguments model, arbor.registry.ENVIRONMENTS); arguments of an environment given by
    dotted path pass.

    A misspelt argument (one close to a known name) always fails, with the name meant. One that resembles no
    argument fails only when `strict`: the config loader lets it through (free-form tables load as written) and
    preflight, which is strict, refuses it before any process starts."""
    model: type[EnvArgs] | None = ENVIRONMENTS.load_args(env_id)
    if model is None:
        return
    for key in args:
        if key in model.model_fields:
            continue
        hint = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
        if hint or strict:
            suggestion = f"did you mean {prefix}{hint[0]}?" if hint else f"it takes {', '.join(model.model_fields)}"
            raise EnvArgsError(f"unknown argument '{prefix}{key}' of environment {env_id!r} ({suggestion})")
    try:
        model.model_validate({k: v for k, v in args.items() if k in model.model_fields}, context={"strict": strict})
    except ValidationError as e:
        raise _one_line(e, prefix, env_id) from None


def _one_line(e: ValidationError, prefix: str, env_id: str) -> EnvArgsError:
    err = e.errors()[0]
    inner = (err.get("ctx") or {}).get("error")
    if isinstance(inner, EnvArgsError):  # black_box's task_args, already worded
        return inner
    msg = err["msg"].removeprefix("Value error, ")
    loc = ".".join(str(p) for p in err["loc"])
    if not loc:  # a contradiction between arguments
        return EnvArgsError(
            f"{prefix[:-1]} (environment {env_id!r}): {msg}" if prefix else f"environment {env_id!r}: {msg}"
        )
    return EnvArgsError(f"{prefix}{loc} of environment {env_id!r}: {msg} (got {err['input']!r})")
