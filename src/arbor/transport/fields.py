"""The request schema: every OpenAI-compatible request field arbor's servers take (completions, chat completions,
and the Responses API the gateway serves), each with its JSON type, bounds and meaning, in one table (`SCHEMA`).

It is the contract between arbor's three HTTP front doors. The inference server (arbor.inference.server), the
agents' gateway (arbor.orchestrator.gateway) and the router (arbor.inference.router.app) all call `validate` on a
generation request's body: a value of the wrong type, out of bounds, non-finite or too long is a 400 naming the
field, in the one error shape of arbor.transport.http (`{"error": {"message", "type", "param"}}`). So whatever one
of them accepts, the others accept too, and the router answers garbage itself instead of forwarding it.

Validity is not support. `Field.servers` says who acts on a field: "inference" (vLLM's and arbor's extensions,
e.g. `return_token_ids`, `request_id`, `prompt_logprobs`), "gateway" (the Responses API), or both. A server that
does not act on a field calls `refuse_unsupported`: a value other than the field's `neutral` ones (those that
leave the answer as if the field were absent) is a 400 naming it, because an ignored field would answer another
question than the one asked; fields whose `neutral` is `ANY` (ids, cache salts, metadata) are checked and then
passed over. Fields the schema does not list are ignored, as OpenAI's and vLLM's servers ignore them. Deep
structure (messages, tools, input items, the prompt's token ids) is the job of their parsers
(arbor.transport.chat, the gateway's responses module); the schema checks their top-level type.

The `read_*` helpers read a checked field with its default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from arbor.config.base import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, MIN_TEMPERATURE  # one bound for configs and requests
from arbor.transport.errors import BadRequest

MAX_SEED = 2**63 - 1
"""Largest request seed: torch's generators take seeds below 2**64, and sample i of a request is seeded with
seed + i."""
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_TOKENS = 2**31 - 1
"""Largest `max_tokens` (and kin) a request may name: no context is longer; each server then bounds it by its own
context (the inference server refuses more than the prompt leaves, the gateway answers with what is left)."""
MAX_N = 4096
"""Largest `n`: a server may take fewer at once (the engine's max_batch_size, the gateway's MAX_N)."""
MAX_ID_CHARS = 256
"""Longest id-like string (`request_id`, `user`, `model`, `previous_response_id`, `cache_salt`)."""
MAX_LOGIT_BIAS = 100.0

COMPLETIONS, CHAT, RESPONSES = "completions", "chat", "responses"
ENDPOINTS = (COMPLETIONS, CHAT, RESPONSES)
INFERENCE, GATEWAY = "inference", "gateway"

ANY = "any"
"""`Field.neutral` of a field that a server not acting on it passes over whatever its (valid) value."""

_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "number": (int, float),
    "string": (str,),
    "object": (dict,),
    "list": (list,),
    "string or list": (str, list),
    "string or object": (str, dict),
}


@dataclasses.dataclass(frozen=True)
class Field:
    """One request field: its JSON type (a key of `_TYPES`), bounds, meaning, and who acts on it."""

    name: str
    kind: str
    meaning: str
    endpoints: tuple[str, ...] = (COMPLETIONS, CHAT)
    servers: tuple[str, ...] = (INFERENCE, GATEWAY)
    """The servers that act on the field; elsewhere only its `neutral` values are taken."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    """`lo` itself is out of bounds (top_p > 0)."""
    max_len: int | None = None
    """Longest string, or most list items / object keys."""
    neutral: tuple[Any, ...] | str = ()
    """Values that leave the answer as if the field were absent (ANY: every valid value, the field is passed
    over); null is always neutral."""
    check: Callable[[Any], str | None] | None = None
    """A further rule: the complaint about a value (completing "{name} ..."), or None when it holds."""

    def validate(self, value: Any) -> None:
        """Raises a 400 naming the field unless `value` (not None) has the field's type and bounds."""
        kinds = _TYPES[self.kind]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            self._refuse(f"must be {self._describe()}, got {type(value).__name__}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                self._refuse(f"must be finite, got {value}")
            below = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
            if below or (self.hi is not None and value > self.hi):
                self._refuse(f"must be {self._describe()}, got {_short(value)}")
        if self.max_len is not None and isinstance(value, (str, list, dict)) and len(value) > self.max_len:
            self._refuse(
                f"must be {self._describe()}, got {len(value)} {'characters' if isinstance(value, str) else 'items'}"
            )
        complaint = self.check(value) if self.check else None
        if complaint:
            self._refuse(complaint)

    def read(self, body: Mapping[str, Any], default: Any) -> Any:
        """The checked value of the field in `body`, or `default` when absent or null."""
        value = body.get(self.name)
        if value is None:
            return default
        self.validate(value)
        return float(value) if self.kind == "number" else value

    def _describe(self) -> str:
        kind = {"bool": "a boolean", "int": "an integer", "number": "a number", "object": "an object"}.get(
            self.kind, "a " + self.kind
        )
        if self.lo is not None or self.hi is not None:
            left = "(" if self.lo_open else "["
            lo = "-inf" if self.lo is None else _short(self.lo)
            hi = "inf" if self.hi is None else _short(self.hi)
            kind += f" in {left}{lo}, {hi}]"
        if self.max_len is not None:
            kind += f" of at most {self.max_len} {'characters' if self.kind == 'string' else 'items'}"
        return kind

    def _refuse(self, complaint: str) -> None:
        raise BadRequest(f"{self.name} {complaint}", self.name)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 24 else f"an integer of {len(text)} digits" if isinstance(v, int) else text[:24]


# ---- further rules ----


def _temperature(t: float) -> str | None:
    return f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {t}" if 0 < t < MIN_TEMPERATURE else None


def _stop(stop: str | list) -> str | None:
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > MAX_STOP_STRINGS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items):
        return (
            f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_CHARS} characters"
        )
    return None


def _stream_options(opts: dict) -> str | None:
    bad = [k for k, v in opts.items() if k in ("include_usage", "continuous_usage_stats") and not isinstance(v, bool)]
    return f"{bad[0]} must be a boolean" if bad else None


def _logit_bias(bias: dict) -> str | None:
    for k, v in bias.items():
        if not k.lstrip("-").isdigit() or isinstance(v, bool) or not isinstance(v, (int, float)):
            return "must map token ids to numbers"
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            return f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {_short(v)}"
    return None


def _tool_choice(choice: str | dict) -> str | None:
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return f"must be 'auto', 'none', 'required' or a named function, got {choice[:40]!r}"
    return None


def _strings(items: list) -> str | None:
    return None if all(isinstance(s, str) for s in items) else "must be a list of strings"


def _token_ids(items: list) -> str | None:
    ok = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in items)
    return None if ok else "must be a list of token ids"


def _text_format(text: dict) -> str | None:
    fmt = text.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "format must be {type: text}: the gateway does not constrain decoding to a schema"
    return None


def _truncation(value: str) -> str | None:
    return None if value in ("auto", "disabled") else f"must be 'auto' or 'disabled', got {value[:40]!r}"


# ---- the schema ----

_BOTH = (COMPLETIONS, CHAT)
VLLM_SAMPLING = "a vLLM sampling field: the local engine and the gateway sample with temperature and top_p only"
VLLM_STRUCTURED = "vLLM structured output: decoding constrained to a format"


def _shared(name: str, kind: str, meaning: str, endpoints: tuple[str, ...] = _BOTH, **kw: Any) -> Field:
    """A field both servers act on."""
    return Field(name, kind, meaning, endpoints, (INFERENCE, GATEWAY), **kw)


def _vllm(name: str, kind: str, meaning: str, endpoints: tuple[str, ...] = _BOTH, **kw: Any) -> Field:
    """A vLLM field: the inference server's (as far as its backend implements it), not the gateway's."""
    return Field(name, kind, meaning, endpoints, (INFERENCE,), **kw)


def _responses(name: str, kind: str, meaning: str, **kw: Any) -> Field:
    """A field of the Responses API, which the gateway alone serves."""
    return Field(name, kind, "Responses: " + meaning, (RESPONSES,), (GATEWAY,), **kw)


FIELDS: tuple[Field, ...] = (
    # -- what is asked --
    _shared("model", "string", "the served model or a loaded LoRA adapter", ENDPOINTS, max_len=MAX_ID_CHARS),
    _shared("user", "string", "the end user's id (OpenAI); passed over", ENDPOINTS, max_len=MAX_ID_CHARS),
    _shared("prompt", "string or list", "completions: text, token ids, or a list of either", (COMPLETIONS,)),
    _shared("messages", "list", "chat: the conversation (arbor.transport.chat)", (CHAT,)),
    _shared("tools", "list", "function tools, rendered by the chat template", (CHAT, RESPONSES)),
    _shared(
        "tool_choice",
        "string or object",
        "auto or none (forcing a call is refused)",
        (CHAT, RESPONSES),
        check=_tool_choice,
    ),
    _shared("parallel_tool_calls", "bool", "accepted; every call of the reply is returned", (CHAT, RESPONSES)),
    _shared("stream", "bool", "answer as server-sent events (the local engine refuses it)", ENDPOINTS),
    _shared("stream_options", "object", "include_usage: a usage chunk last", check=_stream_options),
    # -- length and sampling --
    _shared("max_tokens", "int", "tokens to generate at most", lo=1, hi=MAX_TOKENS),
    _shared("max_completion_tokens", "int", "chat: max_tokens' newer name (wins)", (CHAT,), lo=1, hi=MAX_TOKENS),
    _shared(
        "temperature",
        "number",
        "0 (greedy) or a sampling temperature",
        ENDPOINTS,
        lo=0,
        hi=MAX_TEMPERATURE,
        check=_temperature,
    ),
    _shared("top_p", "number", "nucleus sampling mass", ENDPOINTS, lo=0, hi=1, lo_open=True),
    _shared("n", "int", "choices per prompt (each its own turn on the gateway)", lo=1, hi=MAX_N),
    _shared("seed", "int", "the request's sampling seed", lo=0, hi=MAX_SEED),
    _shared("stop", "string or list", "strings that end a completion (not returned)", check=_stop),
    _vllm(
        "stop_token_ids",
        "list",
        "token ids that end a completion (returned)",
        max_len=MAX_STOP_STRINGS,
        check=_token_ids,
    ),
    _vllm("best_of", "int", "vLLM: candidates per choice (the local engine: only n)", lo=1, hi=MAX_N, neutral=(1,)),
    _vllm("top_k", "int", VLLM_SAMPLING, lo=-1, hi=MAX_TOKENS, neutral=(-1, 0)),
    _vllm("min_p", "number", VLLM_SAMPLING, lo=0, hi=1, neutral=(0, 0.0)),
    _vllm("presence_penalty", "number", VLLM_SAMPLING, lo=-2, hi=2, neutral=(0, 0.0)),
    _vllm("frequency_penalty", "number", VLLM_SAMPLING, lo=-2, hi=2, neutral=(0, 0.0)),
    _vllm("repetition_penalty", "number", VLLM_SAMPLING, lo=0, hi=100, lo_open=True, neutral=(1, 1.0)),
    _vllm("logit_bias", "object", VLLM_SAMPLING, max_len=2**16, neutral=({},), check=_logit_bias),
    _vllm("min_tokens", "int", VLLM_SAMPLING, lo=0, hi=MAX_TOKENS, neutral=(0,)),
    _vllm("ignore_eos", "bool", VLLM_SAMPLING, neutral=(False,)),
    _vllm("bad_words", "list", VLLM_SAMPLING, neutral=([],), check=_strings),
    _vllm("allowed_token_ids", "list", VLLM_SAMPLING, check=_token_ids),
    _vllm("use_beam_search", "bool", VLLM_SAMPLING, neutral=(False,)),
    _vllm("logits_processors", "list", VLLM_SAMPLING, neutral=([],)),
    _vllm("response_format", "object", VLLM_STRUCTURED, neutral=({"type": "text"},)),
    _vllm("guided_json", "string or object", VLLM_STRUCTURED),
    _vllm("guided_regex", "string", VLLM_STRUCTURED),
    _vllm("guided_choice", "list", VLLM_STRUCTURED, check=_strings),
    _vllm("guided_grammar", "string", VLLM_STRUCTURED),
    _vllm("structured_outputs", "object", VLLM_STRUCTURED),
    # -- what comes back --
    _vllm(
        "logprobs",
        "int",
        "completions: each token's logprob and this many alternatives",
        (COMPLETIONS,),
        lo=0,
        hi=MAX_TOP_LOGPROBS,
    ),
    _vllm("logprobs", "bool", "chat: each token's logprob", (CHAT,), neutral=(False,)),
    _vllm("top_logprobs", "int", "alternatives per token", (CHAT, RESPONSES), lo=0, hi=MAX_TOP_LOGPROBS, neutral=(0,)),
    _vllm(
        "prompt_logprobs", "int", "each prompt token's logprob and this many alternatives", lo=0, hi=MAX_TOP_LOGPROBS
    ),
    _vllm("echo", "bool", "completions: the prompt before the completion", (COMPLETIONS,), neutral=(False,)),
    _vllm("suffix", "string", "completions: text after the completion", (COMPLETIONS,), neutral=("",)),
    _vllm(
        "images",
        "object",
        "arbor: a token prompt's pixel inputs (arbor.transport.images; both backends)",
        (COMPLETIONS,),
        max_len=2,
    ),
    _vllm("return_token_ids", "bool", "the prompt's and the completion's token ids", neutral=(False,)),
    _vllm("return_tokens_as_token_ids", "bool", "logprob tokens as token_id:N", neutral=(False,)),
    _vllm("skip_special_tokens", "bool", "special tokens left out of the text", neutral=(True,)),
    _vllm("request_id", "string", "the client's id, which /abort_requests names", max_len=MAX_ID_CHARS, neutral=ANY),
    _vllm(
        "cache_salt",
        "string",
        "prefix-cache isolation (the local engine has no cache)",
        max_len=MAX_ID_CHARS,
        neutral=ANY,
    ),
    # -- the Responses API's own --
    _responses("input", "string or list", "text or input items"),
    _responses("instructions", "string", "a system message first"),
    _responses("max_output_tokens", "int", "max_tokens", lo=1, hi=MAX_TOKENS),
    _responses("previous_response_id", "string", "continue a stored response", max_len=MAX_ID_CHARS),
    _responses("store", "bool", "keep the response for previous_response_id"),
    _responses("metadata", "object", "echoed back", max_len=16),
    _responses("text", "object", "the output format (text only)", check=_text_format),
    _responses("reasoning", "object", "reasoning settings (no reasoning items are produced)"),
    _responses("truncation", "string", "auto or disabled (the prompt is never truncated)", check=_truncation),
    _responses("include", "list", "extra output data (none is produced)", check=_strings),
    Field("background", "bool", "Responses: run in the background (not served)", (RESPONSES,), (), neutral=(False,)),
)

SCHEMA: dict[str, dict[str, Field]] = {e: {f.name: f for f in FIELDS if e in f.endpoints} for e in ENDPOINTS}
"""The fields of each endpoint by name."""


def validate(body: Mapping[str, Any], endpoint: str) -> None:
    """Checks every schema field of `endpoint` present in `body` (type, bounds, length; null is absent): a 400
    naming the first bad one. Cheap: one dict lookup per present field."""
    fields = SCHEMA[endpoint]
    for name, value in body.items():
        f = fields.get(name)
        if f is not None and value is not None:
            f.validate(value)


def refuse_unsupported(body: Mapping[str, Any], endpoint: str, supported: frozenset[str], server: str) -> None:
    """A 400 naming the first schema field of `endpoint` that `server` does not act on (not in `supported`) and
    that holds a value other than its neutral ones. Call after `validate`."""
    for name, value in body.items():
        f = SCHEMA[endpoint].get(name)
        if f is None or value is None or name in supported or f.neutral == ANY:
            continue
        if not any(type(value) is type(v) and value == v for v in f.neutral):  # noqa: E721 - 0 is not False
            shown = " or ".join(repr(v) for v in f.neutral)
            raise BadRequest(
                f"{name} is not supported by {server} ({f.meaning}): leave it unset{' or ' + shown if shown else ''}",
                name,
            )


def serves(server: str, endpoint: str) -> frozenset[str]:
    """The fields of `endpoint` that the schema lists as acted on by `server`."""
    return frozenset(n for n, f in SCHEMA[endpoint].items() if server in f.servers)


# ---- readers of checked fields ----


def read_temperature(body: Mapping[str, Any], default: float) -> float:
    """`temperature`: 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    return SCHEMA[CHAT]["temperature"].read(body, float(default))


def read_top_p(body: Mapping[str, Any], default: float) -> float:
    """`top_p` in (0, 1]."""
    return SCHEMA[CHAT]["top_p"].read(body, float(default))


def read_seed(body: Mapping[str, Any]) -> int | None:
    """`seed` in [0, MAX_SEED], or None."""
    return SCHEMA[CHAT]["seed"].read(body, None)


def read_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    """`stop`: one non-empty string or a list of at most MAX_STOP_STRINGS, each at most MAX_STOP_CHARS long."""
    stop = SCHEMA[CHAT]["stop"].read(body, ())
    return (stop,) if isinstance(stop, str) else tuple(stop)
