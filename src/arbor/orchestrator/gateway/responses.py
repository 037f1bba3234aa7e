"""OpenAI's Responses API for the gateway (POST /v1/responses): requests turned into chat messages, completions
into response objects and their stream events.

Agents built on the Responses API (the OpenAI Agents SDK's default model, Codex-style CLIs) call it instead of
chat completions. The gateway serves both from one path: a request's `instructions` and `input` items become the
chat messages the template renders (`instructions` a system message first; `message` items by role, `developer`
as `system`; `function_call` items the assistant's `tool_calls`; `function_call_output` items `tool` messages),
flat function tools become chat tools, and the reply is split exactly as a chat reply is
(arbor.transport.chat.split_tool_calls) into a `message` item and `function_call` items. An agent
that sends those items back gets the same assistant message the session recorded, so its history extends the
recorded turn token-exactly, as with chat.

`previous_response_id` continues a response of the same session: the gateway keeps each response's conversation
(its input after the referenced one's, and its reply) and prepends it, as OpenAI's stored responses do; as there,
the earlier request's `instructions` and `tools` are not carried over. Pure translation, no I/O; malformed input
is a 400 `HTTPError` naming the field.

Images: `input_image` parts (`image_url` a data URL or a local path) become chat `image_url` parts, which a
vision-language model's processor renders (arbor.orchestrator.gateway.routes); a text model refuses them in one
line. Departures from OpenAI: images by `file_id` and over http(s), file and audio parts, and images in tool
outputs are refused, as are built-in tools such as web search; no reasoning items are produced and any sent are
skipped; `n`, `stop` and `seed` do not exist in this
API, and sampling follows the run as for chat (arbor.orchestrator.gateway.openai_wire.RunSampling). Streaming sends
the whole reply's events at once, for the same reason as chat's: the backend returns token ids only for whole
completions.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from arbor.orchestrator.client import Completion
from arbor.orchestrator.gateway.openai_wire import chat_choices
from arbor.transport.chat import TEXT_ONLY, content_parts, parses_tool_calls, template_message
from arbor.transport.http import HTTPError, get_field

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
IMAGE_PARTS = ("input_image", "image_url")
SKIPPED_ITEMS = ("reasoning",)


# ---- requests ----


def _text(content: Any, where: str, images: str | None = TEXT_ONLY) -> Any:
    """A message's or tool output's content: one string (a string, or a list of text parts), or with image
    parts (`images` None: the model renders them) the list of chat parts (arbor.transport.chat.content_parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HTTPError(400, f"{where} must be a string or a list of content parts", "input")
    parts: list[dict[str, Any]] = []
    for k, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in TEXT_PARTS and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "refusal" and isinstance(p.get("refusal"), str):
            parts.append({"type": "text", "text": p["refusal"]})
        elif kind in IMAGE_PARTS:
            url = p.get("image_url")
            if images is None and url is None and p.get("file_id") is not None:
                raise HTTPError(400, f"{where}[{k}]: images by file_id are not served, send image_url", "input")
            parts.append({"type": "image_url", "image_url": url})
        else:
            raise HTTPError(
                400,
                f"{where}[{k}] must be a text part (input_text or output_text) or an input_image part, "
                f"got type {kind!r}",
                "input",
            )
    return content_parts(parts, where, images, "input")


def _call(item: dict[str, Any], i: int) -> dict[str, Any]:
    """A `function_call` item as a chat tool call (its `call_id` is the call's id)."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise HTTPError(400, f"input[{i}].{key} must be a string (a function_call item)", "input")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def input_messages(raw: Any, images: str | None = TEXT_ONLY) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`: a string (one user message) or a list of items; `images`:
    why image parts are refused, None where the model renders them (messages only, never tool outputs)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise HTTPError(400, "input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise HTTPError(400, f"input[{i}] must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise HTTPError(400, f"input[{i}].role must be one of {sorted(ROLES)}", "input")
            messages.append({"role": role, "content": _text(item.get("content", ""), f"input[{i}].content", images)})
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # calls after the reply's text join its message
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(_call(item, i))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise HTTPError(400, f"input[{i}].call_id must be a string (a function_call_output item)", "input")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"input[{i}].output", "tool outputs take text only"),
                }
            )
        elif kind not in SKIPPED_ITEMS:
            raise HTTPError(
                400,
                f"input[{i}].type {kind!r} is not supported: the gateway takes message, "
                "function_call and function_call_output items",
                "input",
            )
    return messages


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Flat function tools (`{type: "function", name, description, parameters}`) in chat's nested form; a
    `tool_choice` that forces a call is refused, as on chat (arbor.transport.chat.parses_tool_calls)."""
    parses_tool_calls(body)
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise HTTPError(400, "tools must be a list of function tools", "tools")
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise HTTPError(
                400,
                f"tools[{k}] must be a function tool with a name (built-in tools such as {kind!r} "
                "are not served by the gateway)",
                "tools",
            )
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def sampling_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling fields (checked by the schema) under the chat names that RunSampling.parse reads."""
    out = {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def instructions(body: dict[str, Any]) -> list[dict[str, Any]]:
    text = get_field(body, "instructions", (str,), None)
    return [{"role": "system", "content": text}] if text else []


# ---- responses ----


def output_items(completion: Completion) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The reply's output items (a `message` with its text, then one `function_call` per tool call) and the
    assistant message that the session records and that those items map back to (`input_messages`)."""
    choice = chat_choices([completion])[0]
    message = choice["message"]
    items: list[dict[str, Any]] = []
    if message["content"] or not message.get("tool_calls"):
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": message["content"] or "", "annotations": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items, template_message(message, 0)


def response_object(
    body: dict[str, Any], model: str, items: list[dict[str, Any]], completion: Completion, prompt_len: int
) -> dict[str, Any]:
    """The `response` object of one finished generation."""
    done = len(completion.token_ids)
    cut = completion.finish_reason == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if cut else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "output": items,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": {
            "input_tokens": prompt_len,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": done,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_len + done,
        },
    }


def _item_events(i: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """One output item's events, from `output_item.added` to `output_item.done`."""
    at = {"item_id": item["id"], "output_index": i}
    if item["type"] == "message":
        part = item["content"][0]
        return [
            {
                "type": "response.output_item.added",
                "output_index": i,
                "item": {**item, "status": "in_progress", "content": []},
            },
            {"type": "response.content_part.added", **at, "content_index": 0, "part": {**part, "text": ""}},
            {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"], "logprobs": []},
            {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
            {"type": "response.output_item.done", "output_index": i, "item": item},
        ]
    return [
        {
            "type": "response.output_item.added",
            "output_index": i,
            "item": {**item, "arguments": "", "status": "in_progress"},
        },
        {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
        {"type": "response.function_call_arguments.done", **at, "name": item["name"], "arguments": item["arguments"]},
        {"type": "response.output_item.done", "output_index": i, "item": item},
    ]


def stream_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole response as the Responses API's server-sent events, numbered: created, in_progress, each output
    item's events, then `response.completed` (or `response.incomplete` when it hit max_output_tokens)."""
    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events = [{"type": "response.created", "response": started}, {"type": "response.in_progress", "response": started}]
    for i, item in enumerate(response["output"]):
        events += _item_events(i, item)
    events.append({"type": f"response.{response['status']}", "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]
