"""Request translation for the vLLM proxy (arbor.inference.vllm.proxy): what it forwards and what it answers.

Every completion goes to vLLM streamed, so that each token can be tagged with the policy version current when it
arrived; `read_stream` feeds the stream into a `Reassembler`, which answers it as one non-streaming OpenAI
response with arbor's fields (`token_ids`, `policy_versions`, `adapter`, routed experts). Apart from the HTTP app
so that the translation reads (and is tested) on its own, with no server or session."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Callable
from typing import Any

from arbor.transport.chat import assistant_message

ROUTED_EXPERTS = "routed_experts"
"""The per-choice field vLLM returns routed experts in (with `--enable-return-routed-experts`)."""


def render_request(body: dict[str, Any], chat: bool, cache_salt: str | None, router_replay: bool) -> dict[str, Any]:
    """The request forwarded to vLLM: streamed (for per-token versions), token ids on, the salt kept."""
    out = dict(body)
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    out["return_token_ids"] = True
    if cache_salt is not None and "cache_salt" not in out:
        out["cache_salt"] = cache_salt
    if router_replay:
        out["return_routed_experts"] = True
    if not chat and out.get("logprobs") is None:
        out["logprobs"] = 0  # token logprobs are cheap and RL always wants them; dropped again below if unasked
    return out


class Reassembler:
    """Builds a non-streaming response from vLLM stream chunks, tagging each new token with a version."""

    def __init__(
        self, chat: bool, want_logprobs: bool, adapter: str | None = None, parse_tool_calls: bool = False
    ) -> None:
        self.chat, self.want_logprobs, self.adapter = chat, want_logprobs, adapter
        self.parse_tool_calls = parse_tool_calls
        """A chat reply's `<tool_call>` blocks become `tool_calls` (arbor.transport.chat), as the local server's."""
        self.choices: dict[int, dict[str, Any]] = {}
        self.head: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any], version: int) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None:
            self.head["prompt_token_ids"] = chunk["prompt_token_ids"]
        for c in chunk.get("choices") or []:
            acc = self.choices.setdefault(
                c["index"],
                {
                    "index": c["index"],
                    "text": "",
                    "token_ids": [],
                    "policy_versions": [],
                    "finish_reason": None,
                    "stop_reason": None,
                    "lp_tokens": [],
                    "lp_values": [],
                    "lp_top": [],
                    "lp_content": [],
                },
            )
            if c.get("prompt_token_ids") is not None:
                acc["prompt_token_ids"] = c["prompt_token_ids"]
            ids = c.get("token_ids") or []
            acc["token_ids"] += ids
            acc["policy_versions"] += [version] * len(ids)
            if self.chat:
                acc["text"] += (c.get("delta") or {}).get("content") or ""
            else:
                acc["text"] += c.get("text") or ""
            lp = c.get("logprobs") or {}
            if self.chat:
                acc["lp_content"] += lp.get("content") or []
            else:
                acc["lp_tokens"] += lp.get("tokens") or []
                acc["lp_values"] += lp.get("token_logprobs") or []
                acc["lp_top"] += lp.get("top_logprobs") or []
            if c.get(ROUTED_EXPERTS) is not None:
                acc.setdefault(ROUTED_EXPERTS, []).extend(c[ROUTED_EXPERTS])
            if c.get("finish_reason") is not None:
                acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c.get("stop_reason")

    def abort(self, n: int) -> None:
        """Marks every unfinished choice (and any of the first `n` that never started) as aborted."""
        for i in range(n):
            if i not in self.choices:
                self.add({"choices": [{"index": i}]}, 0)
        for a in self.choices.values():
            if a["finish_reason"] is None:
                a["finish_reason"] = "abort"

    def response(self) -> dict[str, Any]:
        choices = []
        for i in sorted(self.choices):
            a = self.choices[i]
            choice: dict[str, Any] = {
                "index": i,
                "finish_reason": a["finish_reason"],
                "stop_reason": a["stop_reason"],
                "token_ids": a["token_ids"],
                "policy_versions": a["policy_versions"],
            }
            if self.chat:
                if self.parse_tool_calls:
                    choice["message"], choice["finish_reason"] = assistant_message(a["text"], a["finish_reason"])
                else:
                    choice["message"] = {"role": "assistant", "content": a["text"]}
                choice["logprobs"] = {"content": a["lp_content"]} if self.want_logprobs else None
            else:
                choice["text"] = a["text"]
                offsets, at = [], 0
                for t in a["lp_tokens"]:
                    offsets.append(at)
                    at += len(t)
                choice["logprobs"] = (
                    {
                        "tokens": a["lp_tokens"],
                        "token_logprobs": a["lp_values"],
                        "top_logprobs": a["lp_top"],
                        "text_offset": offsets,
                    }
                    if self.want_logprobs
                    else None
                )
                if "prompt_token_ids" in a:
                    choice["prompt_token_ids"] = a["prompt_token_ids"]
            if ROUTED_EXPERTS in a:
                choice[ROUTED_EXPERTS] = a[ROUTED_EXPERTS]
            choice["adapter"] = self.adapter
            choices.append(choice)
        out = {
            **{k: v for k, v in self.head.items() if v is not None},
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": choices,
        }
        if self.usage is not None:
            out["usage"] = self.usage
        return out


async def read_stream(
    content: AsyncIterable[bytes], acc: Reassembler, version: Callable[[], int], convert: Callable | None = None
) -> Any:
    """Feeds vLLM's stream (its server-sent lines) into `acc`, each new token tagged with `version()` as the chunk
    arrives (each chunk through `convert` first, when given); returns the error object vLLM streamed, if any."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if convert is not None:
            chunk = convert(chunk)
        if chunk.get("error"):
            return chunk["error"]
        acc.add(chunk, version())
    return None


def stream_status(error: Any) -> int:
    """The status of an error vLLM streamed: a client error (a token id out of the vocabulary) carries its 4xx
    `code`; anything else is a 5xx, which routers retry on another backend."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 500 else 500
