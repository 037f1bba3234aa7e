"""Tool calls in assistant text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen3 / Hermes).

A wire concern shared by the OpenAI chat routes (arbor.transport.chat: the inference server and the gateway give
an agent the same `tool_calls`) and by tool-calling environments (arbor.environments.multiturn), so it sits at
the bottom of the package, importing nothing of arbor.

Blocks may appear anywhere in the text (`arguments` may also be a JSON-encoded string, as some templates emit).
A block that is not valid JSON, lacks a string `name` or has non-object arguments, or a `<tool_call>` never
closed, becomes a `ToolCallError` rather than being dropped, so environments can penalise invalid calls. Unlike
Hermes' reference parser, text outside the blocks is kept as the message content.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass
class ToolCallError:
    raw: str
    """The text of the malformed block."""
    reason: str


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[ToolCallError]]:
    """Every `<tool_call>` block of `text`, in order: the valid calls and the malformed ones."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            errors.append(ToolCallError(text[start:], "unterminated <tool_call>"))
            break
        raw = text[start + len(OPEN) : end]
        pos = end + len(CLOSE)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(ToolCallError(raw, f"invalid JSON: {e.msg}"))
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(ToolCallError(raw, "a tool call needs a string 'name'"))
        elif not isinstance(args, dict):
            errors.append(ToolCallError(raw, "'arguments' must be a JSON object"))
        else:
            calls.append(ToolCall(obj["name"], args))
    return calls, errors
