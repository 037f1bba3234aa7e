"""Tools as plain Python functions: their JSON schemas, and running a parsed call.

A tool is any sync or async function with type hints and a docstring: `tool_schema(fn)` gives the OpenAI-style
schema that chat templates expose (`{"type": "function", "function": {"name", "description", "parameters"}}`),
the description being the docstring's first paragraph and each parameter's description taken from a
`name: text` line of the docstring's Args section when there is one. `call_tool` runs one call parsed from the
assistant's text by arbor.tool_calls (the Qwen3 / Hermes `<tool_call>` format, shared with the OpenAI wire).
A tool answers a string, any JSON value, or images for a vision-language model: a PIL image, or a list of
content parts (`text`, `image`, `image_url`), which the tool message carries as they are (`tool_content`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from arbor.models.image_parts import IMAGE_PART_TYPES
from arbor.tool_calls import ToolCall

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {"anyOf": [_json_type(a) for a in options]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    return {}  # unannotated or exotic: any JSON value


def _arg_docs(doc: str) -> dict[str, str]:
    out, in_args = {}, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if in_args:
            m = re.match(r"(\w+)\s*(\([^)]*\))?\s*:\s*(.+)", stripped)
            if m:
                out[m.group(1)] = m.group(3)
            elif not stripped or stripped.endswith(":"):  # a blank line or the next section ends Args
                in_args = False
    return out


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a function: name, docstring summary, parameters from its type hints."""
    doc = inspect.getdoc(fn) or ""
    hints = typing.get_type_hints(fn)
    arg_docs = _arg_docs(doc)
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(name, Any))
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        props[name] = prop
        if p.default is p.empty:
            required.append(name)
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": summary,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


class ToolError(Exception):
    """A tool call that cannot run (unknown tool, bad arguments, the tool raised): its message goes back to the
    model as the tool's result and the call counts as invalid."""


def tool_content(result: Any) -> str | list[dict[str, Any]]:
    """A tool's result as a tool message's content: a string as it is, a PIL image as one image part, a list of
    content parts as it is (when any is an image part), anything else as JSON."""
    if isinstance(result, str):
        return result
    if type(result).__module__.startswith("PIL."):
        return [{"type": "image", "image": result}]
    if (
        isinstance(result, list)
        and result
        and all(isinstance(p, dict) and p.get("type") in ("text", *IMAGE_PART_TYPES) for p in result)
        and any(p["type"] in IMAGE_PART_TYPES for p in result)
    ):
        return result
    return json.dumps(result)


async def call_tool(tools: dict[str, Callable[..., Any]], call: ToolCall) -> str | list[dict[str, Any]]:
    """Runs one call; sync tools run in a thread so a slow tool does not block the event loop."""
    fn = tools.get(call.name)
    if fn is None:
        raise ToolError(f"unknown tool {call.name!r}; available: {', '.join(sorted(tools))}")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        raise ToolError(f"bad arguments for {call.name}: {e}") from None
    try:
        if inspect.iscoroutinefunction(fn):
            result = await fn(**call.arguments)
        else:
            result = await asyncio.to_thread(fn, **call.arguments)
    except ToolError:
        raise
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's feedback, not the run's
        raise ToolError(f"{call.name} failed: {type(e).__name__}: {e}") from None
    return tool_content(result)
