"""`[orchestrator.environment]`: the environment that turns tasks into prompts and completions into rewards,
with its failure policy and, for multi-turn environments, the episode limits and context management."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from arbor.config.base import Config, Count, Float, Int, Seconds, Tokens
from arbor.config.env_args import check_env_args


class ContextConfig(Config):
    """Context management between the turns of a multi-turn episode (an environment step applied by the driver;
    the trained samples hold exactly the trimmed contexts the agent saw, branching at each edit)."""

    strategy: Literal["none", "truncate", "summarise"] = "none"
    """"truncate" keeps the system prompt, the task's prompt and the last `keep_turns` turns; "summarise" also
    replaces the dropped turns by one user message holding `summariser`'s summary of them."""
    keep_turns: Int = Field(2, ge=1)
    """Most recent turns kept (a turn is an assistant message and the environment messages that follow it)."""
    trigger_tokens: Tokens | None = Field(None, ge=1)
    """Edit only once the next prompt would exceed this many tokens; None edits whenever more than `keep_turns`
    turns have passed."""
    keep_prompt: bool = True
    """Keep the task's own prompt messages (the question) along with the system prompt."""
    summariser: str = "arbor.environments.context:extractive_summary"
    """"summarise": a dotted path to `(list of dropped messages) -> str`; the default is deterministic and
    extractive (the first line of every dropped message, clipped), no model call."""


class EnvironmentConfig(Config):
    id: str = "reverse_text"
    """A built-in environment (arbor.registry.ENVIRONMENTS): reverse_text, math, tool_use, code, verifiers,
    black_box, swe_agent, shapes; or a dotted path `package.module:function` returning an Environment or a
    MultiTurnEnvironment."""
    args: dict[str, Any] = Field({}, validate_default=True)  # validated when absent too: black_box needs an agent
    """Keyword arguments for the environment's constructor (a built-in's are checked against its arguments model,
    arbor.config.env_args)."""
    prompt_format: Literal["chat", "raw"] = "chat"
    """How a task's prompt becomes tokens. "chat": the environment's messages through the tokenizer's chat
    template (preflight refuses a tokenizer without one). "raw": the messages' contents, each followed by a
    blank line (the last one marks where the completion starts), tokenised as they are after the BOS the tokenizer
    itself adds (if any), no template, as base-model RL recipes do (the completion ends at one of the tokenizer's
    stop tokens, its end of text or a chat template's turn end, or at `max_tokens`; a warm-up's targets end with
    the turn end where the tokenizer has a template: docs/models.md, "Tokenizers"); single-turn environments only."""
    reward_weights: dict[str, Float] = {}
    """Weights of named reward components (default 1.0 each); the reward is their weighted sum."""
    timeout: Seconds = Field(60.0, gt=0)
    """Seconds one environment call (scoring, an episode's setup or step) may take before it counts as failed."""
    retries: Count = Field(1, ge=0)
    """Retries of a failed or timed-out environment call, with a short backoff, before `on_failure` applies."""
    threads: Count = Field(64, ge=1)
    """Worker threads for the environment's blocking calls (`asyncio.to_thread`: synchronous tools, verifiers,
    sandbox set-up), created as needed: at most this many run at once. Python's default pool, min(32, cores + 4),
    let 6 such calls run at once on a 2-core orchestrator node. With several environments (`eval`), the largest."""
    on_failure: Literal["score_zero", "skip"] = "score_zero"
    """When an environment call fails for good: "score_zero" keeps the rollout with reward 0 (counted as
    `env/failed`); "skip" drops it (counted as `env/skipped`; its group trains with the rest, or is replaced
    when nothing is left)."""
    max_turns: Count | None = Field(None, ge=1)
    """Multi-turn: most assistant turns per episode; None uses the environment's own `max_turns`."""
    context: ContextConfig = ContextConfig()
    """Multi-turn: context management between turns."""

    @field_validator("args")
    @classmethod
    def _args_fit_environment(cls, args: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "id" in info.data:  # else `id` itself failed, and says so
            check_env_args(info.data["id"], args)
        return args

    @model_validator(mode="after")
    def _context_budget(self) -> "EnvironmentConfig":
        if self.context.strategy == "none" and self.context.trigger_tokens is not None:
            raise ValueError("context.trigger_tokens is set but context.strategy is 'none'")
        return self
