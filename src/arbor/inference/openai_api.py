"""The OpenAI/vLLM wire format of the local `inference` server (arbor.inference.server): reading a completion or
chat request's prompt, sampling fields and client request id (every field checked against the request schema,
arbor.transport.fields, a bad one a `BadRequest` naming it, and the schema's fields this engine does not implement
refused unless neutral; messages, tools and tool calls are read and written as the gateway does, by
arbor.transport.chat), and writing a choice's logprobs and prompt logprobs the way vLLM's OpenAI server does
(token strings, or `token_id:N` with `return_tokens_as_token_ids`)."""

from __future__ import annotations

from typing import Any

import torch
from aiohttp import web

from arbor.inference.engine.params import PromptLogprobs, SamplingParams
from arbor.models.tokenizer import Tokenizer
from arbor.transport import fields
from arbor.transport.fields import read_seed, read_stop, read_temperature, read_top_p
from arbor.transport.http import BadRequest
from arbor.transport.images import decode_images

STREAM_UNSUPPORTED = "stream is not supported by the local backend"
LOCAL_UNSERVED = frozenset(f.name for f in fields.FIELDS if f.meaning in (fields.VLLM_SAMPLING, fields.VLLM_STRUCTURED))
"""The schema's vLLM fields the local engine does not implement (it samples with temperature and top-p only, and
does not constrain decoding): only their neutral values are taken, since a silently ignored field would return
samples (and logprobs) of another distribution than the one asked for."""
LOCAL_FIELDS = {
    fields.COMPLETIONS: fields.serves(fields.INFERENCE, fields.COMPLETIONS) - LOCAL_UNSERVED - {"echo", "suffix"},
    fields.CHAT: fields.serves(fields.INFERENCE, fields.CHAT) - LOCAL_UNSERVED - {"prompt_logprobs"},
}
"""The schema fields the local server acts on, per endpoint (arbor.transport.fields)."""
LOCAL_BACKEND = "the local backend (serve with the vLLM backend for it)"


def check_request(body: dict[str, Any], endpoint: str) -> None:
    """The schema's checks of a completions or chat body (arbor.transport.fields), and the refusal of the fields
    the local engine does not implement: a 400 naming the field."""
    fields.validate(body, endpoint)
    fields.refuse_unsupported(body, endpoint, LOCAL_FIELDS[endpoint], LOCAL_BACKEND)


# ---- request parsing ----


def prompt_images(body: dict[str, Any], prompts: list[list[int]]) -> dict[str, torch.Tensor] | None:
    """The engine's image inputs of a completions body's `images` (arbor.transport.images), for one prompt."""
    if body.get("images") is None:
        return None
    if len(prompts) != 1:
        raise BadRequest("images go with exactly one token prompt", "images")
    try:
        pixel_values, grid = decode_images(body["images"])
    except ValueError as e:
        raise BadRequest(str(e), "images") from None
    return {"pixel_values": torch.from_numpy(pixel_values.copy()), "image_grid_thw": torch.from_numpy(grid)}


def sampling_params(body: dict[str, Any], max_tokens: int, top_logprobs: int, max_batch_size: int) -> SamplingParams:
    """The engine's sampling of a body that `check_request` passed."""
    n = body.get("n") or 1
    if n > max_batch_size:
        raise BadRequest(f"n must be in [1, {max_batch_size}] (the server's max_batch_size), got {n}", "n")
    if body.get("stream"):
        raise BadRequest(STREAM_UNSUPPORTED, "stream")
    if body.get("best_of") not in (None, n):
        raise BadRequest(
            f"best_of is not supported by the local backend: leave it unset or equal to n ({n})", "best_of"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=read_temperature(body, 1.0),
        top_p=read_top_p(body, 1.0),
        n=n,
        stop=read_stop(body),
        stop_token_ids=tuple(body.get("stop_token_ids") or ()),
        seed=read_seed(body),
        top_logprobs=top_logprobs,
        skip_special_tokens=body.get("skip_special_tokens", True) is not False,
    )


def prompts(body: dict[str, Any], tokenizer: Tokenizer) -> list[list[int]]:
    """`prompt` as a string, a list of token ids, or a list of either (several prompts)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")


def request_id(request: web.Request, body: dict[str, Any]) -> str | None:
    """The client-chosen request id: vLLM's body field `request_id`, else the `X-Request-Id` header."""
    rid = body.get("request_id")  # checked by the schema
    return rid if rid is not None else request.headers.get("X-Request-Id")


def abort_ids(body: dict[str, Any]) -> list[str] | None:
    """`{"request_ids": [...]}` -> those ids; `{"request_ids": "all"}` -> None (every request)."""
    ids = body.get("request_ids")
    if ids == "all":
        return None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise BadRequest('request_ids must be a list of request id strings or "all"', "request_ids")
    return ids


# ---- response building ----


def token_str(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, c: Any, as_ids: bool) -> dict[str, Any]:
    tokens = [token_str(tokenizer, t, as_ids) for t in c.token_ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    top = []
    for t, tok, alts in zip(c.token_ids, c.logprobs, c.top_logprobs or [[]] * len(c.token_ids)):
        entry = {token_str(tokenizer, i, as_ids): lp for i, lp in alts}
        entry.setdefault(token_str(tokenizer, t, as_ids), tok)  # vLLM always lists the chosen token
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs(tokenizer: Tokenizer, entries: PromptLogprobs) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token None (the first) or {token id: Logprob}."""

    def logprob(token_id: int, lp: float, rank: int) -> dict[str, Any]:
        return {"logprob": lp, "rank": rank, "decoded_token": token_str(tokenizer, token_id, False)}

    return [None if e is None else {str(i): logprob(i, *v) for i, v in e.items()} for e in entries]


def token_bytes(tokenizer: Tokenizer, token_id: int) -> list[int]:
    # The byte tokenizer's ids below 256 are raw bytes: a lone UTF-8 continuation byte has no text of its own.
    if getattr(tokenizer, "name", None) == "byte" and token_id < 256:
        return [token_id]
    return list(tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))


def chat_logprobs(tokenizer: Tokenizer, c: Any, as_ids: bool) -> dict[str, Any]:
    def item(token_id: int, lp: float) -> dict[str, Any]:
        s = token_str(tokenizer, token_id, as_ids)
        return {"token": s, "logprob": lp, "bytes": token_bytes(tokenizer, token_id)}

    alts = c.top_logprobs or [[]] * len(c.token_ids)
    return {
        "content": [
            {**item(t, lp), "top_logprobs": [item(i, a) for i, a in alt]}
            for t, lp, alt in zip(c.token_ids, c.logprobs, alts)
        ]
    }
