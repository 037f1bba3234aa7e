"""Chat messages, tools and tool calls on the OpenAI wire, shared by the inference server's chat route
(arbor.inference.server) and the gateway (arbor.orchestrator.gateway.openai_wire), so that an agent gets the same
rendering and the same `tool_calls` from either.

Messages are normalised to what a chat template renders (`template_message`: text content, tool calls with
mapping arguments); a reply's message goes through the same function, so that a reply an agent echoes back
renders as the recorded one (token-exact extension in arbor.orchestrator.trajectory). Tool calls travel as
`<tool_call>{json}</tool_call>` blocks in the text (the Hermes/Qwen convention, arbor.tool_calls) and as
OpenAI `tool_calls` on the wire. Malformed input is a 400 `HTTPError` naming the field.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from arbor.tool_calls import parse_tool_calls
from arbor.transport.http import BadRequest, HTTPError, parse_json

TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


TEXT_ONLY = "this server takes text parts only"
"""Why an image part is refused where images are not rendered (the gateway names the text-only model instead)."""


def parse_messages(body: dict[str, Any], images: str | None = TEXT_ONLY) -> list[dict[str, Any]]:
    """The request's messages in template form (`template_message`); `images`: why image parts are refused, or
    None where they are rendered (a vision-language model behind the gateway)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    return [template_message(m, i, images) for i, m in enumerate(messages)]


def template_message(m: Any, i: int, images: str | None = TEXT_ONLY) -> dict[str, Any]:
    """A chat message in the form the template renders: the same for a request's messages and for the reply the
    gateway gave, so that a reply echoed back renders as the recorded one (arbor.orchestrator.trajectory). Text
    parts are joined into one string; a content with `image_url` parts stays a list of normalised parts
    (`content_parts`) when `images` is None, and is refused naming the part (`images`: why) otherwise."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise HTTPError(400, f"messages[{i}] must be an object with a string role", "messages")
    content = m.get("content")
    if isinstance(content, list):
        content = content_parts(content, f"messages[{i}].content", images)
    elif content is not None and not isinstance(content, str):
        raise HTTPError(400, f"messages[{i}].content must be a string or a list of content parts", "messages")
    calls = m.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list)
        and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls
        )
    ):
        raise HTTPError(
            400, f"messages[{i}].tool_calls must be a list of {{function: {{name, arguments}}}}", "messages"
        )
    clean = {"role": m["role"], "content": content or ""}
    if calls:
        clean["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))},
            }
            for c in calls
        ]
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            clean[key] = m[key]
    return clean


def content_parts(parts: list[Any], where: str, images: str | None = TEXT_ONLY, field: str = "messages") -> Any:
    """A list content: its text parts joined into one string when it has no image; with `image_url` parts (and
    `images` None) the list of `{"type": "text", "text"}` and `{"type": "image_url", "image_url": {"url"}}` parts
    the processor renders (arbor.models.vision). A part of another type, or an image where `images` says why
    not, is a 400 naming it."""
    out: list[dict[str, Any]] = []
    for k, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind == "image_url":
            if images is not None:
                raise HTTPError(400, f"{where}[{k}] is an image_url part: {images}", field)
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise HTTPError(400, f"{where}[{k}].image_url.url must be a data URL or a local path", field)
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise HTTPError(400, f"{where}[{k}] must be a text or image_url part, got type {kind!r}", field)
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _arguments(args: Any) -> Any:
    # Templates want the arguments as a mapping; clients send the JSON string OpenAI returned.
    if isinstance(args, str):
        try:
            return parse_json(args)
        except BadRequest:  # not JSON (or nested too deep): the template gets the string as the agent sent it
            return args
    return args if args is not None else {}


def parse_tools(body: dict[str, Any]) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise HTTPError(400, "tools must be a list of objects", "tools")
    return tools or None


def chat_tools(body: dict[str, Any]) -> tuple[list[dict] | None, bool]:
    """A chat request's `tools` (rendered by the chat template, as vLLM does) and whether the server parses tool
    calls out of the reply (`parses_tool_calls`)."""
    tools, parse = parse_tools(body), parses_tool_calls(body)
    return tools, parse and tools is not None


def parses_tool_calls(body: dict[str, Any]) -> bool:
    """Whether a request's `tool_choice` lets the server parse tool calls out of the reply: "auto" (the default)
    yes, "none" no. Forcing a call ("required", a named function) needs constrained decoding, which arbor's
    servers do not do: refused, naming the field."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    if choice == "required" or isinstance(choice, dict):
        raise BadRequest(
            "tool_choice that forces a call ('required' or a named function) is not supported (arbor's "
            "servers do not constrain decoding): use 'auto' or 'none'",
            "tool_choice",
        )
    raise BadRequest(
        f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}", "tool_choice"
    )


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """OpenAI `tool_calls` from the completion's `<tool_call>` blocks (arbor.tool_calls) and the text
    outside them; with any malformed block the whole text stays content, so the agent sees what was sampled."""
    calls, errors = parse_tool_calls(text)
    if not calls or errors:
        return text, []
    out = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    return TOOL_CALL.sub("", text).strip(), out


def assistant_message(text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A completion as an assistant message, its tool calls split out, and its finish reason (`tool_calls` when
    it stopped on its own after calling tools)."""
    content, calls = split_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls and finish_reason == "stop" else finish_reason
