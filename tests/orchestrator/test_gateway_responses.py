"""The gateway's Responses API (POST /v1/responses) with the openai client: items and function calls that extend
the session token-exactly, `previous_response_id`, streamed events, incomplete replies, and one-line 400s for
what it does not take, fuzzed."""

from __future__ import annotations

import json
import random

import pytest
from test_gateway import FakeClient, Served, _openai, _post

from arbor.config.orchestrator import GatewayConfig
from arbor.orchestrator.client import Completion
from arbor.orchestrator.gateway.responses import input_messages, output_items
from arbor.transport.chat import template_message

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "adds two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    }
]


def test_function_calls_and_previous_response_id_extend_the_session_token_exactly(chat_tokenizer) -> None:
    tok = chat_tokenizer
    replies = iter([f"let me add{CALL}", "3", "you are welcome"])
    with Served(FakeClient(lambda p: next(replies), tok=tok), max_tokens=200, tokenizer=tok) as srv:
        s = srv.open()
        oa = _openai(srv.gw.base_url(s.id))
        r = oa.responses.create(model="arbor", input="1+2?", instructions="be brief", tools=TOOLS)
        assert r.status == "completed" and r.output_text == "let me add"
        (msg, fc) = r.output
        assert msg.type == "message" and fc.type == "function_call" and fc.name == "add"
        assert json.loads(fc.arguments) == {"a": 1, "b": 2}
        assert r.usage.input_tokens == len(s.turns[0].prompt_ids)
        assert r.usage.output_tokens == len(s.turns[0].completion_ids)
        # the chat template saw the instructions as a system message and the flat tool in chat's form
        first = tok.decode(s.turns[0].prompt_ids)
        assert "be brief" in first and "adds two integers" in first
        # the agent sends the reply's items back with the tool's output: the same recorded turn, extended
        history = [
            {"role": "user", "content": "1+2?"},
            *[o.model_dump(exclude_none=True) for o in r.output],
            {"type": "function_call_output", "call_id": fc.call_id, "output": "3"},
        ]
        r2 = oa.responses.create(model="arbor", input=history, instructions="be brief", tools=TOOLS)
        assert r2.output_text == "3" and s.turns[1].parent == 0
        # continued by id: the stored conversation, the new input after it
        r3 = oa.responses.create(
            model="arbor", input="thanks", previous_response_id=r2.id, instructions="be brief", tools=TOOLS
        )
        assert r3.output_text == "you are welcome" and r3.previous_response_id == r2.id
        assert [t.parent for t in s.turns] == [None, 0, 1]
        (sample,) = s.rollouts()
    ids = sample.prompt_ids + sample.completion_ids
    assert ids == s.turns[2].ids
    for t in s.turns:  # every call's exact prompt and completion, never re-tokenised
        assert ids[: len(t.ids)] == t.ids
    assert sum(sample.completion_mask) == sum(len(t.completion_ids) for t in s.turns)


@pytest.mark.slow
def test_streamed_events_build_the_same_response_and_a_cut_reply_is_incomplete() -> None:
    replies = iter([f"adding{CALL}", "y" * 50])
    with Served(FakeClient(lambda p: next(replies)), max_tokens=200) as srv:
        s = srv.open()
        oa = _openai(srv.gw.base_url(s.id))
        with oa.responses.stream(model="arbor", input="1+2?", tools=TOOLS) as st:
            events = list(st)
            final = st.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.done" in kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text == "adding"
        assert [o.type for o in final.output] == ["message", "function_call"] and final.usage.output_tokens > 0
        raw = list(oa.responses.create(model="arbor", input="again", max_output_tokens=10, stream=True))
        assert raw[-1].type == "response.incomplete"
        cut = raw[-1].response
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
        assert cut.output_text == "y" * 10 and len(s.turns) == 2


def test_stateless_agents_and_what_the_gateway_does_not_take_are_400s_naming_the_field() -> None:
    cfg = GatewayConfig(api_key="k")
    with Served(FakeClient(lambda p: "ok"), cfg) as srv:
        srv.open("s")
        url, key = f"{srv.gw.url}/v1/sessions/s/v1/responses", {"Authorization": "Bearer k"}
        status, body = _post(url, {"input": "hi", "store": False}, key)
        assert status == 200
        gone = json.loads(body)["id"]  # store: false keeps nothing to continue from

        def error(body: dict) -> tuple[int, str | None, str]:
            status, raw = _post(url, body, key)
            err = json.loads(raw)["error"]
            return status, err.get("param"), err["message"]

        image = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
        cases = [
            ({"input": "hi", "previous_response_id": gone}, "previous_response_id"),
            ({}, "input"),
            ({"input": []}, "input"),
            ({"input": [image]}, "input"),
            ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
            ({"input": [{"role": "critic", "content": "x"}]}, "input"),
            ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, "input"),
            ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
            ({"input": "hi", "instructions": 3}, "instructions"),
            ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
            ({"input": "hi", "max_output_tokens": "9"}, "max_output_tokens"),
            ({"input": "hi", "temperature": -1}, "temperature"),
        ]
        for body, param in cases:
            status, got, message = error(body)
            assert status == 400 and got == param and "\n" not in message, (body, status, got, message)

        rng = random.Random(0)
        values = [
            None,
            0,
            -1,
            1.5,
            True,
            "x",
            [],
            {},
            [1],
            {"type": 3},
            [{"type": "message"}],
            [{"role": "user"}],
            [{"type": "function_call", "call_id": 1}],
            [{"role": "assistant", "content": [{"type": "x"}]}],
        ]
        fields = [
            "input",
            "instructions",
            "tools",
            "previous_response_id",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "store",
            "tool_choice",
            "text",
            "reasoning",
        ]
        statuses = [
            _post(url, {f: rng.choice(values) for f in rng.sample(fields, rng.randrange(1, 5))}, key)[0]
            for _ in range(200)
        ]
        assert set(statuses) <= {200, 400}, sorted(set(statuses))
        assert _post(url, {"input": "still serving"}, key)[0] == 200


def test_reply_items_map_back_to_the_recorded_message() -> None:
    """A reply with text and two calls, sent back as items, is the assistant message the session recorded."""
    text = f"two calls{CALL}{CALL}"
    items, recorded = output_items(Completion([1, 2], [-0.1, -0.2], [0, 0], text, "stop"))
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    (echoed,) = input_messages(items)
    assert template_message(echoed, 0) == recorded
    calls_only, recorded = output_items(Completion([1], [-0.1], [0], CALL, "stop"))
    assert [i["type"] for i in calls_only] == ["function_call"]
    assert template_message(input_messages(calls_only)[0], 0) == recorded
