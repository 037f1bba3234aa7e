"""The request schema (arbor.transport.fields) is the contract of the gateway and the inference server: every
schema field, sent malformed, is a 400 naming it in the one JSON error shape; sent valid, a 200 (or a 400 naming
it where that server does not act on the field and the value is not neutral); never a 5xx. The two servers
accept the same values of the fields they share (table-driven), and a seeded fuzz of every route (chat,
completions, responses; streamed or not) agrees with the schema. Loopback only, a few hundred requests."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from fuzz_requests import BAD_VALUES, encode, send
from test_inference import TOK, make_model, running_engine

from arbor.config.orchestrator import GatewayConfig
from arbor.inference import openai_api
from arbor.inference.server import BackgroundServer
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.gateway.openai_wire import MAX_N as GATEWAY_MAX_N
from arbor.orchestrator.gateway.service import Gateway
from arbor.transport import fields
from arbor.transport.fields import ANY, CHAT, COMPLETIONS, GATEWAY, INFERENCE, RESPONSES, SCHEMA, Field
from arbor.transport.http import BadRequest, check_json

MAX_BATCH = 8
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BASE = {
    COMPLETIONS: {"prompt": "hi", "max_tokens": 1},
    CHAT: {"messages": MSGS, "max_tokens": 1},
    RESPONSES: {"input": "hi", "max_output_tokens": 1},
}
PATHS = {COMPLETIONS: "/completions", CHAT: "/chat/completions", RESPONSES: "/responses"}
PAYLOAD = {"prompt", "messages", "input", "tools", "tool_choice"}
"""Fields whose deep structure their parsers check: fuzzed with their table's values only."""

VALID: dict[str, list[Any]] = {
    "model": ["arbor"],
    "user": ["u1"],
    "prompt": ["hello", [1, 2, 3]],
    "messages": [[{"role": "system", "content": "be brief"}, *MSGS]],
    "tools": [[TOOL]],
    "tool_choice": ["auto", "none"],
    "parallel_tool_calls": [True, False],
    "stream": [False, True],
    "stream_options": [{"include_usage": True}],
    "max_tokens": [1, 2],
    "max_completion_tokens": [2],
    "temperature": [0, 0.5, 1],
    "top_p": [0.5, 1],
    "n": [1, 2],
    "seed": [0, 7, fields.MAX_SEED],
    "stop": ["x", ["a", "b"]],
    "best_of": [1, 2],
    "top_k": [-1, 5],
    "min_p": [0, 0.1],
    "presence_penalty": [0, 0.5],
    "frequency_penalty": [0.0, -0.5],
    "repetition_penalty": [1, 1.1],
    "logit_bias": [{}, {"1": 5}],
    "min_tokens": [0, 1],
    "ignore_eos": [False, True],
    "bad_words": [[], ["x"]],
    "allowed_token_ids": [[1, 2]],
    "stop_token_ids": [[], [3]],
    "use_beam_search": [False, True],
    "logits_processors": [[]],
    "response_format": [{"type": "text"}, {"type": "json_object"}],
    "guided_json": [{"type": "object"}],
    "guided_regex": ["a+"],
    "guided_choice": [["a", "b"]],
    "guided_grammar": ["root ::= 'a'"],
    "structured_outputs": [{"regex": "a"}],
    "logprobs": [],  # per endpoint, below
    "top_logprobs": [0, 3],
    "prompt_logprobs": [0, 2],
    "echo": [False, True],
    "suffix": ["", "x"],
    "images": [],  # a token prompt's pixel inputs: the fuzz's text-only engine refuses any (test_engine_vision.py)
    "return_token_ids": [False, True],
    "return_tokens_as_token_ids": [False, True],
    "skip_special_tokens": [True, False],
    "request_id": ["r1"],
    "cache_salt": ["salt"],
    "input": ["hello", [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]],
    "instructions": ["be brief"],
    "max_output_tokens": [1, 2],
    "previous_response_id": [],  # none is stored: any id is refused, naming it
    "store": [True, False],
    "metadata": [{"k": "v"}],
    "text": [{"format": {"type": "text"}}],
    "reasoning": [{"effort": "low"}],
    "truncation": ["disabled", "auto"],
    "include": [[]],
    "background": [False, True],
}
VALID_BY_ENDPOINT = {
    (COMPLETIONS, "logprobs"): [0, 2],
    (CHAT, "logprobs"): [False, True],
    (RESPONSES, "tools"): [[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]],
}
MALFORMED: dict[str, list[Any]] = {
    "temperature": [1e-6, float("nan")],
    "stop": ["", ["x"] * 33, ["a" * 1025], [1]],
    "tool_choice": ["maybe"],
    "truncation": ["sometimes"],
    "text": [{"format": {"type": "json_schema"}}],
    "stream_options": [{"include_usage": "yes"}],
    "logit_bias": [{"a": 1}, {"1": 101}, {"1": True}],
    "guided_choice": [[1]],
    "allowed_token_ids": [[-1]],
    "stop_token_ids": [[-1], ["x"], [True]],
    "bad_words": [[1]],
    "include": [[1]],
    "messages": [[], [{"role": 3}]],
    "prompt": [[], [[1], "x"]],
    "input": [[], [{"type": "image"}]],
    "tools": [[1]],
    "user": ["\udcff"],
}
"""Malformed values beyond those the schema's types and bounds give (`derived_malformed`)."""
ISSUE_CASES = [  # found by the first fuzz of the gateway: each was a 200
    (CHAT, "logprobs", -1),
    (CHAT, "logprobs", "true"),
    (COMPLETIONS, "logprobs", True),
    (CHAT, "max_tokens", 10**19),
    (CHAT, "max_tokens", 1e19),
    (CHAT, "top_logprobs", 21),
    (CHAT, "request_id", 5),
    (COMPLETIONS, "return_token_ids", "yes"),
    (CHAT, "skip_special_tokens", 1),
    (COMPLETIONS, "echo", "no"),
    (CHAT, "presence_penalty", 9),
    (CHAT, "top_k", "5"),
    (CHAT, "cache_salt", []),
    (CHAT, "stream_options", {"include_usage": "yes"}),
    (COMPLETIONS, "suffix", 5),
    (COMPLETIONS, "best_of", 0),
    (CHAT, "response_format", "json"),
    (CHAT, "prompt_logprobs", -2),
    (RESPONSES, "max_output_tokens", -1),
    (RESPONSES, "store", "yes"),
    (RESPONSES, "metadata", []),
    (RESPONSES, "instructions", 5),
]


def valid_values(endpoint: str, name: str) -> list[Any]:
    return VALID_BY_ENDPOINT.get((endpoint, name), VALID[name])


def derived_malformed(f: Field) -> list[Any]:
    """Values of the wrong type, just out of bounds, or too long for `f`, and the field's own MALFORMED ones."""
    samples: list[Any] = [True, 3, 0.5, "x", {}, []]
    kinds = fields._TYPES[f.kind]
    out = [v for v in samples if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds)]
    if f.lo is not None:
        out.append(f.lo if f.lo_open else f.lo - 1)
    if f.hi is not None:
        out.append(int(f.hi) + 1)
    if f.max_len is not None and f.max_len <= 1024:
        out.append("x" * (f.max_len + 1) if f.kind == "string" else {str(i): "v" for i in range(f.max_len + 1)})
    return out + MALFORMED.get(f.name, [])


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def expected(server: str, endpoint: str, name: str, value: Any, body: dict[str, Any] | None = None) -> str | None:
    """None: the server answers 200; else the field its 400 names. The schema's verdict (and the parsers' of the
    MALFORMED payloads), then each server's own limits (n, streaming, best_of) and its refusal of a field it
    does not act on, unless the value is neutral."""
    f = SCHEMA[endpoint][name]
    try:
        check_json({name: value})
        f.validate(value)
    except BadRequest:
        return name
    if any(_same(value, m) for m in MALFORMED.get(name, [])) or name == "previous_response_id":
        return name
    if name == "n" and value > (MAX_BATCH if server == INFERENCE else GATEWAY_MAX_N):
        return name
    n = (body or {}).get("n") or 1
    if server == INFERENCE and ((name == "stream" and value) or (name == "best_of" and value != n)):
        return name
    acted_on = fields.serves(GATEWAY, endpoint) if server == GATEWAY else openai_api.LOCAL_FIELDS[endpoint]
    if name in acted_on or f.neutral == ANY or any(_same(value, v) for v in f.neutral):
        return None
    return name


def check(status: int, data: Any, want: str | set[str] | None, context: Any) -> None:
    """200 when `want` is None; else a 400 in the one error shape naming `want` (or one of them)."""
    if want is None:
        assert status == 200, (context, status, data)
        return
    assert status == 400, (context, status, data)
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param"}, (context, data)
    assert data["error"]["type"] == "invalid_request_error" and isinstance(data["error"]["message"], str), data
    assert data["error"]["param"] in ({want} if isinstance(want, str) else want), (context, data)


Send = Callable[[str, str, dict[str, Any]], Awaitable[tuple[int, Any]]]


def with_servers(go: Callable[[Send], Awaitable[None]]) -> None:
    """Runs `go(send)` against a gateway (agent sampling forwarded) in front of an inference server on one CPU
    engine; `send(server, endpoint, body)`; the engine must outlive it with nothing running."""
    with running_engine(make_model(), max_batch_size=MAX_BATCH) as engine, BackgroundServer(engine, TOK) as backend:

        async def main() -> None:
            async with InferenceClient([backend.url], 60, 0) as client:
                cfg = GatewayConfig(override_sampling=False)
                async with Gateway(client, TOK, cfg, temperature=1.0, top_p=1.0, max_tokens=2, seq_len=128) as gw:
                    gw.open("fuzz")
                    async with aiohttp.ClientSession() as s:

                        async def send_to(server: str, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
                            root = gw.base_url("fuzz") if server == GATEWAY else backend.url + "/v1"
                            return await send(s, root + PATHS[endpoint], encode(body), {})

                        await go(send_to)

        asyncio.run(main())
        assert engine.alive and engine.stats().running == 0


def test_the_malformed_values_the_first_fuzz_found_are_400s_naming_the_field_on_both_servers() -> None:
    async def go(send_to: Send) -> None:
        for endpoint, name, value in ISSUE_CASES:
            for server in (GATEWAY, INFERENCE) if endpoint != RESPONSES else (GATEWAY,):
                status, data = await send_to(server, endpoint, {**BASE[endpoint], name: value})
                check(status, data, name, (server, endpoint, name, value))

    with_servers(go)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT, RESPONSES])
def test_every_schema_field_valid_or_malformed_gets_the_schemas_answer(endpoint: str) -> None:
    servers = (GATEWAY,) if endpoint == RESPONSES else (GATEWAY, INFERENCE)

    async def go(send_to: Send) -> None:
        for name, f in SCHEMA[endpoint].items():
            for value in valid_values(endpoint, name) + derived_malformed(f):
                for server in servers:
                    status, data = await send_to(server, endpoint, {**BASE[endpoint], name: value})
                    want = expected(server, endpoint, name, value)
                    check(status, data, want, (server, endpoint, name, value))

    with_servers(go)


def test_the_gateway_and_the_server_accept_the_same_values_of_their_shared_fields() -> None:
    """Table-driven: for every field of completions and chat that both act on (or neither does), each value of
    the table and each malformed one gets the same answer from both (streaming aside: the local engine does not
    stream)."""
    rows = []
    for endpoint in (COMPLETIONS, CHAT):
        both = fields.serves(GATEWAY, endpoint) & openai_api.LOCAL_FIELDS[endpoint]
        neither = set(SCHEMA[endpoint]) - fields.serves(GATEWAY, endpoint) - openai_api.LOCAL_FIELDS[endpoint]
        for name in sorted((both | neither) - {"stream"}):
            f = SCHEMA[endpoint][name]
            rows += [(endpoint, name, v) for v in valid_values(endpoint, name) + derived_malformed(f)]
    assert {"max_tokens", "temperature", "top_p", "seed", "stop", "n", "top_k", "echo"} <= {r[1] for r in rows}

    async def go(send_to: Send) -> None:
        for endpoint, name, value in rows:
            body = {**BASE[endpoint], name: value}
            (gs, gd), (ss, sd) = await send_to(GATEWAY, endpoint, body), await send_to(INFERENCE, endpoint, body)
            assert gs == ss, (endpoint, name, value, gd, sd)
            if gs != 200:
                assert gd["error"]["param"] == sd["error"]["param"] == name, (endpoint, name, value, gd, sd)

    with_servers(go)


def test_a_seeded_fuzz_of_every_route_agrees_with_the_schema_and_never_gets_a_5xx() -> None:
    rng = random.Random(5)
    routes = [(GATEWAY, e) for e in (COMPLETIONS, CHAT, RESPONSES)] + [(INFERENCE, e) for e in (COMPLETIONS, CHAT)]
    cases = []
    for _ in range(240):
        server, endpoint = rng.choice(routes)
        names = rng.sample(sorted(SCHEMA[endpoint]), rng.randrange(1, 4))
        body = dict(BASE[endpoint])
        if server == GATEWAY and rng.random() < 0.3:
            body["stream"] = True
        for name in names:  # a valid value more often than not, so that some requests are served
            valid, bad = valid_values(endpoint, name), derived_malformed(SCHEMA[endpoint][name])
            body[name] = rng.choice(valid if valid and rng.random() < 0.6 else bad + BAD_VALUES * (name not in PAYLOAD))
        cases.append((server, endpoint, body))

    async def go(send_to: Send) -> None:
        answered = []
        for server, endpoint, body in cases:
            status, data = await send_to(server, endpoint, body)
            assert status < 500, (server, endpoint, body, data)
            bad = {n for n, v in body.items() if v is not None and expected(server, endpoint, n, v, body) is not None}
            check(status, data, bad or None, (server, endpoint, body))
            answered.append(status)
        assert answered.count(200) >= 30 and answered.count(400) >= 100, answered

    with_servers(go)
