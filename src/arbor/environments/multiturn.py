"""`ToolEnv`: the base class of multi-turn tool-calling environments (implements MultiTurnEnvironment).

After each assistant turn, `step` parses the Qwen3/Hermes `<tool_call>` blocks of its text
(arbor.tool_calls.parse_tool_calls), runs each valid call (a tool gets `tool_timeout` seconds; sync tools
run in a thread) and answers with one `tool` message per call, in order. A malformed block, an unknown tool, bad
arguments, a tool that raises or times out all answer with an error message the model can read, and count in
the episode state as invalid calls (`state.invalid_calls`), which subclasses turn into a process penalty. A
turn without any tool call ends the episode: the assistant has answered. With `process_penalty > 0` every turn
with invalid calls also gets a per-turn reward of `-process_penalty * invalid` (reward-to-go advantages).

A tool may answer images (a PIL image or content parts, arbor.environments.tools.tool_content): with a
vision-language model they join the episode's images in order after the prompt's own (arbor.orchestrator.
trajectory); with a text model the episode fails (counted, one line).

Subclasses give `dataset`, `prompt`, `tools` and `score_episode`; `score(task, completion)` is a single-turn
fallback (the completion as the only assistant turn, no tool executed) so that `eval` and SFT warm-up work.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from arbor.environments.protocol import StepResult, Task
from arbor.environments.tools import ToolError, call_tool
from arbor.tool_calls import ToolCall, parse_tool_calls


@dataclasses.dataclass
class ToolState:
    tool_calls: int = 0
    invalid_calls: int = 0
    turns: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Room for a subclass's own per-episode state."""


class ToolEnv(abc.ABC):
    name = "tool_env"
    max_turns = 6
    tool_timeout = 10.0
    max_calls_per_turn = 4
    process_penalty = 0.0

    def tools(self, task: Task) -> list[Callable[..., Any]]:
        return []

    def episode_tools(self, task: Task, state: ToolState) -> list[Callable[..., Any]]:
        """The tools one episode calls: `tools(task)` unless they act on the episode's own state."""
        return self.tools(task)

    def reference(self, task: Task) -> str | None:
        return None

    async def setup(self, task: Task) -> ToolState:
        return ToolState()

    async def step(self, task: Task, state: ToolState, messages: list[dict[str, Any]]) -> StepResult:
        calls, errors = parse_tool_calls(messages[-1].get("content") or "")
        if not calls and not errors:
            state.turns += 1
            return StepResult(done=True)
        by_name = {fn.__name__: fn for fn in self.episode_tools(task, state)}
        replies: list[dict[str, Any]] = []
        invalid = len(errors)
        for e in errors:
            replies.append({"role": "tool", "content": f"error: malformed tool call ({e.reason})"})
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                invalid += 1
                replies.append({"role": "tool", "content": f"error: at most {self.max_calls_per_turn} calls per turn"})
                continue
            try:
                replies.append({"role": "tool", "content": await self._run(by_name, call)})
            except ToolError as e:
                invalid += 1
                replies.append({"role": "tool", "content": f"error: {e}"})
        # state changes last: a step retried after a timeout must not count its calls twice
        state.turns += 1
        state.tool_calls += len(calls) + len(errors)
        state.invalid_calls += invalid
        reward = -self.process_penalty * invalid if self.process_penalty > 0 else None
        return StepResult(replies, done=False, reward=reward)

    async def _run(self, tools: dict[str, Callable[..., Any]], call: ToolCall) -> str | list[dict[str, Any]]:
        try:
            return await asyncio.wait_for(call_tool(tools, call), self.tool_timeout)
        except TimeoutError:
            raise ToolError(f"{call.name} timed out after {self.tool_timeout:g}s") from None

    @abc.abstractmethod
    async def score_episode(self, task: Task, state: ToolState, messages: list[dict[str, Any]]) -> dict[str, float]:
        """Reward components of the finished episode."""

    async def score(self, task: Task, completion: str) -> dict[str, float]:
        """Single-turn fallback: the completion is the episode's only assistant turn; no tool runs."""
        messages = self.prompt(task) + [{"role": "assistant", "content": completion}]
        state = await self.setup(task)
        return await self.score_episode(task, state, messages)

    @abc.abstractmethod
    def prompt(self, task: Task) -> list[dict[str, Any]]:
        """The episode's first messages."""

    @abc.abstractmethod
    def dataset(self, seed: int) -> list[Task]:
        """All tasks, in a fixed order for `seed`."""
