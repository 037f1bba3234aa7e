"""Token-exact multi-turn trajectories against the byte template and a real HF chat template; branching; the
tree of turns (choices, parallel calls, raw-token calls)."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_chat_tokenizer

from arbor.environments.tools import tool_schema
from arbor.models.tokenizer import ByteTokenizer, HFTokenizer
from arbor.orchestrator.client import Completion
from arbor.orchestrator.trajectory import Trajectory
from arbor.tool_calls import parse_tool_calls


def _hf(tmp_path, **kw) -> HFTokenizer:
    return HFTokenizer(tiny_chat_tokenizer.build(tmp_path / "tok", **kw))


def _tokenizer(kind: str, tmp_path, request):
    """The byte tokenizer, the tiny trained BPE, or Qwen's 151k BPE vocabulary (the session's `qwen_bpe`)."""
    if kind == "qwen_bpe":
        return request.getfixturevalue("qwen_bpe")
    return ByteTokenizer() if kind == "byte" else _hf(tmp_path)


def _sampled(tok, text: str, eos: bool = True, version: int = 3, per_char: bool = False) -> Completion:
    """A completion as the engine returns it; `per_char` samples one token per character, a non-canonical
    tokenisation that re-tokenising the text would silently change."""
    ids = [i for ch in text for i in tok.encode(ch)] if per_char else tok.encode(text)
    if eos:
        ids.append(tok.eos_token_id)
    return Completion(ids, [-0.25] * len(ids), [version] * len(ids), text, "stop" if eos else "length")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: the expression, e.g. "1 + 2"
    """
    return expression


def _tools():
    return [tool_schema(calculator)]


@pytest.mark.parametrize("kind", ["byte", "hf", pytest.param("qwen_bpe", marks=pytest.mark.slow)])
def test_each_turn_extends_the_previous_tokens_exactly(kind, tmp_path, request):
    tok = _tokenizer(kind, tmp_path, request)
    traj = Trajectory(tok, tools=_tools())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 12 + 30?"}]
    p1 = traj.prompt_ids(messages)
    assert p1 == tok.apply_chat_template(messages, tools=_tools())
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>'
    c1 = _sampled(tok, call, per_char=True, version=3)
    traj.add_completion(c1)
    messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": "42"}]
    p2 = traj.prompt_ids(messages)
    assert p2[: len(p1) + len(c1.token_ids)] == p1 + c1.token_ids  # the sampled tokens kept as sampled
    # the inserted suffix is exactly the template's rendering beyond what the model saw
    assert tok.decode(p2, skip_special_tokens=False) == tok.render_chat(messages, tools=_tools())
    c2 = _sampled(tok, "the answer is 42", version=4)
    traj.add_completion(c2)
    messages += [{"role": "assistant", "content": "the answer is 42"}, {"role": "user", "content": "thanks"}]
    p3 = traj.prompt_ids(messages)
    assert p3[: len(p2) + len(c2.token_ids)] == p2 + c2.token_ids
    c3 = _sampled(tok, "bye", version=5)
    traj.add_completion(c3)

    (s,) = traj.samples()
    assert traj.num_branches == 1
    assert s.prompt_ids == p1
    assert p1 + s.completion_ids == p3 + c3.token_ids
    assert len(s.completion_ids) == len(s.completion_mask) == len(s.logprobs) == len(s.policy_versions)
    inserted2 = len(p2) - len(p1) - len(c1.token_ids)
    inserted3 = len(p3) - len(p2) - len(c2.token_ids)
    n1, n2, n3 = len(c1.token_ids), len(c2.token_ids), len(c3.token_ids)
    assert s.completion_mask == [1] * n1 + [0] * inserted2 + [1] * n2 + [0] * inserted3 + [1] * n3
    assert s.policy_versions == [3] * n1 + [-1] * inserted2 + [4] * n2 + [-1] * inserted3 + [5] * n3
    assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(s.logprobs, s.completion_mask))
    assert s.turns == [
        (0, n1),
        (n1 + inserted2, n1 + inserted2 + n2),
        (len(s.completion_ids) - n3, len(s.completion_ids)),
    ]
    assert s.turn_ends[-1] == len(s.completion_ids)


def test_per_char_tokens_differ_from_a_retokenisation(tmp_path):
    """The point of the record: BPE of the whole text would merge what the model sampled one char at a time."""
    tok = _hf(tmp_path)
    traj = Trajectory(tok)
    messages = [{"role": "user", "content": "hello world"}]
    traj.prompt_ids(messages)
    traj.add_completion(_sampled(tok, "hello world", per_char=True))
    messages += [{"role": "assistant", "content": "hello world"}, {"role": "user", "content": "again"}]
    exact = traj.prompt_ids(messages)
    assert exact != tok.apply_chat_template(messages)  # re-tokenising would drift...
    assert tok.decode(exact, skip_special_tokens=False) == tok.render_chat(messages)  # ...from the same text


@pytest.mark.parametrize("kind", ["byte", "hf", pytest.param("qwen_bpe", marks=pytest.mark.slow)])
def test_truncated_history_branches_with_exact_tokens(kind, tmp_path, request):
    tok = _tokenizer(kind, tmp_path, request)
    traj = Trajectory(tok)
    system = {"role": "system", "content": "be brief"}
    messages = [system, {"role": "user", "content": "hello world"}]
    first = traj.prompt_ids(messages)
    c1 = _sampled(tok, "the quick fox")
    traj.add_completion(c1)
    messages += [{"role": "assistant", "content": "the quick fox"}, {"role": "user", "content": "the lazy dog"}]
    second = traj.prompt_ids(messages)
    c2 = _sampled(tok, "jumps over", per_char=True)
    traj.add_completion(c2)
    # a context manager keeps the system prompt and the last turn only: history rewritten -> a new branch
    trimmed = [
        system,
        messages[-1],
        {"role": "assistant", "content": "jumps over"},
        {"role": "user", "content": "paris"},
    ]
    third = traj.prompt_ids(trimmed)
    assert third == tok.apply_chat_template(trimmed)  # a fresh rendering of exactly what the agent sees
    c3 = _sampled(tok, "france")
    traj.add_completion(c3)
    a, b = traj.samples()
    assert traj.num_branches == 2
    assert a.prompt_ids == first and a.prompt_ids + a.completion_ids == second + c2.token_ids
    assert b.prompt_ids == third and b.completion_ids == c3.token_ids and b.completion_mask == [1] * len(c3.token_ids)
    assert sum(a.completion_mask) == len(c1.token_ids) + len(c2.token_ids)


def test_template_that_rewrites_past_turns_branches(tmp_path):
    tok = _hf(tmp_path, strip_think=True)
    traj = Trajectory(tok)
    messages = [{"role": "user", "content": "hello"}]
    traj.prompt_ids(messages)
    text = "<think>hmm</think>world"
    traj.add_completion(_sampled(tok, text))
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    traj.prompt_ids(messages)
    traj.add_completion(_sampled(tok, "ok"))
    assert traj.num_branches == 2 and len(traj.samples()) == 2


def test_length_cut_turn_gets_its_end_of_turn_inserted(tmp_path):
    tok = _hf(tmp_path)
    traj = Trajectory(tok)
    messages = [{"role": "user", "content": "hello"}]
    p1 = traj.prompt_ids(messages)
    c1 = _sampled(tok, "the quick", eos=False)
    traj.add_completion(c1)
    messages += [{"role": "assistant", "content": "the quick"}, {"role": "user", "content": "go on"}]
    p2 = traj.prompt_ids(messages)
    inserted = p2[len(p1) + len(c1.token_ids) :]
    assert inserted[0] == tok.eos_token_id  # the template's <|im_end|>, not sampled: mask 0
    traj.add_completion(_sampled(tok, "brown fox"))
    (s,) = traj.samples()
    assert s.completion_mask[len(c1.token_ids)] == 0 and s.policy_versions[len(c1.token_ids)] == -1


def test_routed_experts_cover_the_branch():
    tok = ByteTokenizer()
    traj = Trajectory(tok)
    p = traj.prompt_ids([{"role": "user", "content": "hi"}])
    ids = tok.encode("yo") + [tok.eos_token_id]
    routes = np.zeros((len(p) + len(ids), 2, 1), np.uint8)
    traj.add_completion(Completion(ids, [0.0] * 3, [0] * 3, "yo", "stop", routes))
    assert traj.samples()[0].routed_experts is routes
    traj.prompt_ids(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    )
    with pytest.raises(ValueError, match="routed_experts covers"):
        traj.add_completion(Completion(ids, [0.0] * 3, [0] * 3, "yo", "stop", routes))


def test_no_sample_before_a_completion_and_add_completion_needs_a_prompt():
    traj = Trajectory(ByteTokenizer())
    with pytest.raises(RuntimeError, match="before prompt_ids"):
        traj.add_completion(Completion([1], [0.0], [0], "a", "stop"))
    traj.prompt_ids([{"role": "user", "content": "a"}])
    traj.prompt_ids([{"role": "user", "content": "b"}])  # never sampled: replaced, not a branch of its own
    assert traj.samples() == [] and traj.num_branches == 1


def test_choices_and_parallel_calls_are_siblings_each_its_own_sample():
    tok = ByteTokenizer()
    traj = Trajectory(tok)
    messages = [{"role": "user", "content": "pick"}]
    p = traj.chat_prompt(messages)
    a = traj.record(p, _sampled(tok, "left"), {"role": "assistant", "content": "left"})  # n = 2: two choices
    b = traj.record(p, _sampled(tok, "right"), {"role": "assistant", "content": "right"})
    assert a.parent is None and b.parent is None and traj.num_branches == 2
    # the agent goes on from the second choice, twice at once (parallel calls from one point)
    nxt = messages + [{"role": "assistant", "content": "right"}, {"role": "user", "content": "why"}]
    q1, q2 = traj.chat_prompt(nxt), traj.chat_prompt(nxt)
    assert q1.ids == q2.ids and q1.parent == 1 and q1.ids[: len(b.ids)] == b.ids
    traj.record(q1, _sampled(tok, "because"), {"role": "assistant", "content": "because"})
    traj.record(q2, _sampled(tok, "dunno"), {"role": "assistant", "content": "dunno"})
    first, second, third = traj.samples()
    assert first.prompt_ids == second.prompt_ids == third.prompt_ids == p.ids
    assert first.completion_ids == a.completion_ids
    assert second.completion_ids[: len(b.completion_ids)] == b.completion_ids
    assert sum(second.completion_mask) == len(b.completion_ids) + len(tok.encode("because")) + 1
    assert traj.num_branches == 3


def test_a_turn_cut_at_a_stop_string_extends_with_its_sampled_tokens():
    """The engine's tokens hold the stop string, its text does not: the sampled tokens stay, the template's end of
    turn is inserted, and the episode stays one sample."""
    tok = ByteTokenizer()
    traj = Trajectory(tok)
    messages = [{"role": "user", "content": "count"}]
    p1 = traj.prompt_ids(messages)
    ids = tok.encode("1 2 STOP")
    traj.add_completion(Completion(ids, [-0.1] * len(ids), [1] * len(ids), "1 2 ", "stop"))
    messages += [{"role": "assistant", "content": "1 2 "}, {"role": "user", "content": "more"}]
    p2 = traj.prompt_ids(messages)
    assert p2[: len(p1) + len(ids)] == p1 + ids and p2[len(p1) + len(ids)] == tok.eos_token_id
    traj.add_completion(_sampled(tok, "3"))
    (s,) = traj.samples()
    assert s.completion_mask[len(ids)] == 0 and traj.num_branches == 1


def test_raw_token_prompts_attach_to_the_longest_turn_they_extend():
    tok = ByteTokenizer()
    traj = Trajectory(tok)
    root = traj.record(traj.token_prompt([1, 2]), _sampled(tok, "a"))
    child = traj.record(traj.token_prompt(root.ids + [5]), _sampled(tok, "b"))
    assert child.parent == 0 and traj.token_prompt(child.ids + [6]).parent == 1
    assert traj.token_prompt(root.ids).parent is None  # a turn's own tokens do not extend it: a sibling
    with pytest.raises(ValueError, match="differ in length"):
        traj.record(traj.token_prompt([3]), Completion([1, 2], [0.0], [0, 0], "x", "stop"))
    (s,) = traj.samples()
    assert s.completion_mask == [1, 1, 0, 1, 1] and s.policy_versions == [3, 3, -1, 3, 3]


def test_tool_schema_from_type_hints_and_docstring():
    async def search(query: str, k: int = 3, exact: bool | None = None) -> list[str]:
        """Searches the corpus.

        Args:
            query: words to look for
            k: how many results
        """
        return []

    fn = tool_schema(search)["function"]
    assert fn["name"] == "search" and fn["description"] == "Searches the corpus."
    assert fn["parameters"]["required"] == ["query"]
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "words to look for"}
    assert props["k"] == {"type": "integer", "description": "how many results"}
    assert props["exact"] == {"type": "boolean"}


def test_tool_call_parsing_valid_and_malformed():
    text = (
        'thinking <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"paris\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "y"'
    )
    calls, errors = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("calculator", {"expression": "1+2"}),
        ("search", {"query": "paris"}),
    ]
    reasons = [e.reason for e in errors]
    assert len(errors) == 4
    assert reasons[0].startswith("invalid JSON") and "name" in reasons[1] and "object" in reasons[2]
    assert reasons[3] == "unterminated <tool_call>"
    assert parse_tool_calls("no calls here") == ([], [])


def test_byte_template_renders_tools_and_tool_results():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"}]
    text = tok.render_chat(msgs, tools=_tools())
    assert text.startswith("<|im_start|>system\n# Tools\ncalculator(expression: string) - Evaluates an arithmetic")
    assert "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>" in text
    assert tok.encode_rendered(text) == tok.apply_chat_template(msgs, tools=_tools())
    assert tok.apply_chat_template(msgs[:1]) == [
        tok.im_start,
        *b"user\nq",
        tok.eos_token_id,
        10,
        tok.im_start,
        *b"assistant\n",
    ]
