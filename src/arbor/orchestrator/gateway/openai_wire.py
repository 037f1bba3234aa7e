"""OpenAI wire format for the gateway: requests parsed into what the chat template and the backend take, and
completions turned back into OpenAI JSON (plain and as stream chunks).

Pure translation, no I/O: the gateway's routes (arbor.orchestrator.gateway.routes) call it. Every request is first
checked against the request schema (`check_request`, arbor.transport.fields); malformed input is a 400 `HTTPError`
naming the field. Messages, tools and tool calls are read and written by arbor.transport.chat, which
the inference server's chat route shares.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.client import Completion
from arbor.transport import fields
from arbor.transport.chat import assistant_message
from arbor.transport.fields import read_seed, read_stop, read_temperature, read_top_p
from arbor.transport.http import BadRequest, HTTPError

MAX_N = 16
"""Most choices one call may ask for (each is recorded as its own turn); the schema allows more (fields.MAX_N)."""
GATEWAY = "the gateway (it samples with temperature and top_p, and answers text and tool calls only)"
GATEWAY_FIELDS = {e: fields.serves(fields.GATEWAY, e) for e in fields.ENDPOINTS}
"""The schema fields the gateway acts on, per endpoint."""


def check_request(body: dict[str, Any], endpoint: str) -> None:
    """The schema's checks of a request body (arbor.transport.fields: the same as the inference server's and the
    router's), and the refusal of the schema fields the gateway does not act on unless they hold a neutral value:
    a 400 naming the field."""
    fields.validate(body, endpoint)
    fields.refuse_unsupported(body, endpoint, GATEWAY_FIELDS[endpoint], GATEWAY)


# ---- requests ----


def parse_token_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The legacy completions `prompt`: one string (encoded here) or one list of token ids in the vocabulary."""
    raw = body.get("prompt")
    if isinstance(raw, str):
        prompt = tokenizer.encode(raw)
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        prompt = list(raw)
    else:
        raise HTTPError(400, "prompt must be a string or a non-empty list of token ids (one prompt)", "prompt")
    if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
        raise HTTPError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
    return prompt


@dataclasses.dataclass(frozen=True)
class RunSampling:
    """The run's sampling, and how a request's own settings are reconciled with it (`override`: the run's win,
    because the trainer's importance ratios assume the run's distribution)."""

    temperature: float
    top_p: float
    max_tokens: int
    seq_len: int
    override: bool

    def parse(self, body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        """The backend's sampling arguments (`InferenceClient.generate`) for a request with `prompt_len` tokens."""
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")  # checked by `check_request`
        # Checked even where the run's sampling replaces them: a request the backend would refuse is refused here.
        temperature = read_temperature(body, self.temperature)
        top_p = read_top_p(body, self.top_p)
        n = body.get("n") or 1
        if n > MAX_N:
            raise BadRequest(f"n must be in [1, {MAX_N}] (the gateway's most choices per call), got {n}", "n")
        if self.override:
            temperature, top_p = self.temperature, self.top_p
            max_tokens = min(max_tokens or self.max_tokens, self.max_tokens)
        room = self.seq_len - prompt_len
        if room < 1:
            raise HTTPError(
                400,
                f"the prompt has {prompt_len} tokens; the run's seq_len is {self.seq_len}",
                "messages",
                "context_length_exceeded",
            )
        return {
            "n": n,
            "max_tokens": min(max_tokens or room, room),
            "temperature": temperature,
            "top_p": top_p,
            "seed": read_seed(body),
            "stop": list(read_stop(body)) or None,
        }

    def temperature_override(self, body: dict[str, Any]) -> str | None:
        """`"<agent's>-><used>"` when the request asked for a temperature other than the run's and the run's
        was used (the `X-Arbor-Temperature-Override` header); None otherwise. Call after `parse` checked it."""
        asked = body.get("temperature")
        if not self.override or asked is None or float(asked) == self.temperature:
            return None
        return f"{float(asked):g}->{self.temperature:g}"


def trim_at_stop(c: Completion, tokenizer: Tokenizer) -> tuple[Completion, str | None]:
    """A completion cut at a stop string holds the stop string's tokens, which the agent never sees (its text
    ends before the stop string). Returns the completion without them and "trimmed" when they are exactly the
    tokens after the text (the stop string starts at a token boundary): what is trained and extended is then
    what the agent saw. When the stop string starts inside a token no token prefix decodes to the text, so the
    completion is kept whole: "untrimmed". (c, None) when it was not cut at a stop string."""
    ids = c.token_ids
    if c.finish_reason != "stop" or not ids or ids[-1] in tokenizer.stop_token_ids:
        return c, None
    # Decoded as the engine decodes the returned text (special tokens skipped).
    if tokenizer.decode(ids) == c.text:
        return c, None  # ended on a stop token id, nothing was cut from the text
    for k in range(len(ids) - 1, 0, -1):
        text = tokenizer.decode(ids[:k])
        if text == c.text:
            routes = c.routed_experts
            if routes is not None:
                routes = routes[: routes.shape[0] - len(ids) + k]
            return dataclasses.replace(
                c,
                token_ids=ids[:k],
                logprobs=c.logprobs[:k],
                policy_versions=c.policy_versions[:k],
                routed_experts=routes,
            ), "trimmed"
        if len(text) < len(c.text):
            break  # a shorter prefix decodes to no more text
    return c, "untrimmed"


# ---- responses ----


def chat_choices(completions: list[Completion]) -> list[dict[str, Any]]:
    """The `choices` of a chat.completion: one assistant message per completion, tool calls split out."""
    choices = []
    for i, c in enumerate(completions):
        message, finish = assistant_message(c.text, c.finish_reason)
        choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
    return choices


def chat_chunks(
    head: dict[str, Any], choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> list[dict[str, Any]]:
    """Whole chat choices as chat.completion.chunk events: per choice a role chunk, one content (and tool calls)
    chunk, a finish chunk; then a usage chunk when `usage` is given. `head`: id, object, created, model."""
    chunks = []
    for ch in choices:
        m = ch["message"]
        chunks.append(
            {
                **head,
                "choices": [
                    {"index": ch["index"], "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ],
            }
        )
        delta: dict[str, Any] = {"content": m["content"]} if m["content"] else {}
        if m.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(m["tool_calls"])]
        if delta:
            chunks.append({**head, "choices": [{"index": ch["index"], "delta": delta, "finish_reason": None}]})
        chunks.append({**head, "choices": [{"index": ch["index"], "delta": {}, "finish_reason": ch["finish_reason"]}]})
    if usage is not None:
        chunks.append({**head, "choices": [], "usage": usage})
    return chunks


def completion_choices(completions: list[Completion]) -> list[dict[str, Any]]:
    """The `choices` of a legacy text_completion."""
    return [
        {"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
        for i, c in enumerate(completions)
    ]


def token_usage(prompt: list[int], completions: list[Completion]) -> dict[str, int]:
    done = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}
