"""The OpenAI/vLLM wire format of the local `inference` server (arbor.inference.server): reading a completion or
chat request's prompt, sampling fields and client request id (every field checked, a bad one a `BadRequest`
naming it; messages, tools and tool calls are read and written as the gateway does, by arbor.transport.chat),
and writing a choice's logprobs and prompt logprobs the way vLLM's OpenAI server does (token strings, or
`token_id:N` with `return_tokens_as_token_ids`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from arbor.inference.engine.params import PromptLogprobs, SamplingParams
from arbor.transport.fields import read_seed, read_stop, read_temperature, read_top_p
from arbor.transport.http import BadRequest, get_field

STREAM_UNSUPPORTED = "stream is not supported by the local backend"
MAX_REQUEST_ID_CHARS = 256
NEUTRAL_SAMPLING = {
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "use_beam_search": (False,),
    "logits_processors": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "response_format": ({"type": "text"},),
}
"""vLLM sampling fields the local engine does not implement (it samples with temperature and top-p only), with
the values that leave sampling unchanged. Any other value is refused, naming the field: a silently ignored
field would return samples (and logprobs) of another distribution than the one asked for."""


# ---- request parsing ----


def sampling_params(body: dict[str, Any], max_tokens: int, top_logprobs: int, max_batch_size: int) -> SamplingParams:
    n = get_field(body, "n", (int,), 1)
    if not 1 <= n <= max_batch_size:
        raise BadRequest(f"n must be in [1, {max_batch_size}] (the server's max_batch_size), got {n}", "n")
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if get_field(body, "stream", (bool,), False):
        raise BadRequest(STREAM_UNSUPPORTED, "stream")
    if get_field(body, "best_of", (int,), n) != n:
        raise BadRequest(
            f"best_of is not supported by the local backend: leave it unset or equal to n ({n})", "best_of"
        )
    for name, neutral in NEUTRAL_SAMPLING.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise BadRequest(
                f"{name} is not supported by the local backend (it samples with temperature and top_p "
                f"only): leave it unset{' or ' + repr(neutral[0]) if neutral else ''}, or serve with "
                "the vLLM backend",
                name,
            )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=read_temperature(body, 1.0),
        top_p=read_top_p(body, 1.0),
        n=n,
        stop=read_stop(body),
        seed=read_seed(body),
        top_logprobs=top_logprobs,
        skip_special_tokens=get_field(body, "skip_special_tokens", (bool,), True),
    )


def prompts(body: dict[str, Any], tokenizer: Any) -> list[list[int]]:
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


def completion_fields(body: dict[str, Any]) -> None:
    """Refuses the legacy completions fields that change the response and that the local backend does not
    implement (`echo`, `suffix`), naming the field, rather than answering without them."""
    if get_field(body, "echo", (bool,), False):
        raise BadRequest(
            "echo is not supported by the local backend: leave it unset or false, or serve with the vLLM backend",
            "echo",
        )
    if get_field(body, "suffix", (str,), None):
        raise BadRequest("suffix is not supported by the local backend: leave it unset", "suffix")


def request_id(request: web.Request, body: dict[str, Any]) -> str | None:
    """The client-chosen request id: vLLM's body field `request_id`, else the `X-Request-Id` header."""
    rid = get_field(body, "request_id", (str,), None)
    if rid is not None and len(rid) > MAX_REQUEST_ID_CHARS:
        raise BadRequest(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}", "request_id")
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


def token_str(tokenizer: Any, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Any, c: Any, as_ids: bool) -> dict[str, Any]:
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


def prompt_logprobs(tokenizer: Any, entries: PromptLogprobs) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token None (the first) or {token id: Logprob}."""

    def logprob(token_id: int, lp: float, rank: int) -> dict[str, Any]:
        return {"logprob": lp, "rank": rank, "decoded_token": token_str(tokenizer, token_id, False)}

    return [None if e is None else {str(i): logprob(i, *v) for i, v in e.items()} for e in entries]


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    # The byte tokenizer's ids below 256 are raw bytes: a lone UTF-8 continuation byte has no text of its own.
    if getattr(tokenizer, "name", None) == "byte" and token_id < 256:
        return [token_id]
    return list(tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))


def chat_logprobs(tokenizer: Any, c: Any, as_ids: bool) -> dict[str, Any]:
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
