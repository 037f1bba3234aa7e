"""The local inference engine and its HTTP server, checked against plain full forwards of the same model.

The tiny "qwen3-test" model is re-initialised with a larger std so greedy continuations vary from token to token
(at the preset's std=0.02 they repeat one byte, which would make token-for-token comparisons vacuous).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import InvalidRequest, SamplingParams, WeightUpdateError
from arbor.inference.engine.requests import Completion, RequestOutput
from arbor.inference.server import BackgroundServer, main
from arbor.models import build_model, build_tokenizer
from arbor.models.hf import save_checkpoint_dir
from arbor.transport import chat

CFG = ModelConfig(name="qwen3-test")
TOK = build_tokenizer(CFG)
SEQ_LEN = 128


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The engine thread and the tests' reference forwards run torch at the same time: two OpenMP teams
    spinning against each other on a small machine make these tests several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(seed: int = 0) -> torch.nn.Module:
    model = build_model(CFG)
    model.init_weights(seed, std=0.3)
    return model.eval()


def slow_down(model: torch.nn.Module, seconds: float) -> None:
    """Makes every forward take a little longer so a test can act while a request is still decoding."""
    forward = model.forward

    def slow(*args: Any, **kwargs: Any) -> torch.Tensor:
        time.sleep(seconds)
        return forward(*args, **kwargs)

    model.forward = slow


@contextlib.contextmanager
def running_engine(model: torch.nn.Module, max_batch_size: int = 8, seq_len: int = SEQ_LEN) -> Iterator[Engine]:
    engine = Engine(model, TOK, seq_len=seq_len, max_batch_size=max_batch_size, seed=0).start()
    try:
        yield engine
    finally:
        engine.stop()


def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with a full forward over the whole sequence at every step (no KV cache), over the
    tokenizer's ids: the preset's padding rows (259..263) are never chosen."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        tok = int(model(torch.tensor([ids]))[0, -1, : TOK.vocab_size].argmax())
        out.append(tok)
        ids.append(tok)
        if tok == TOK.eos_token_id:
            break
    return out


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: list[int], gen: list[int], temperature: float = 0.0):
    """Full-forward `log_softmax(logits / T)` over the tokenizer's ids (the preset's padding rows 259..263 are
    not in the policy) at the positions predicting `gen`: (all rows, chosen tokens)."""
    logits = model(torch.tensor([prompt + gen]))[0, len(prompt) - 1 : len(prompt) - 1 + len(gen), : TOK.vocab_size]
    logits = logits.float()
    lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return lp, lp[torch.arange(len(gen)), torch.tensor(gen)]


# ---- engine ----


def test_greedy_batch_matches_full_forward() -> None:
    model, ref = make_model(), make_model()
    prompts = [TOK.encode(p) for p in ("hello world", "a", "reverse this text", "0123456789")]
    with running_engine(model) as engine:
        engine.pause().result()  # queue all four so they are admitted together and decoded as one batch
        futures = [engine.submit(p, SamplingParams(max_tokens=12 + i, temperature=0)) for i, p in enumerate(prompts)]
        engine.resume().result()
        outputs = [f.result(timeout=60) for f in futures]
        assert engine.stats().max_decode_batch == 4
    for i, (p, out) in enumerate(zip(prompts, outputs)):
        (c,) = out.completions
        assert out.prompt_token_ids == p
        assert c.token_ids == greedy_reference(ref, p, 12 + i)
        assert len(set(c.token_ids)) > 3, "the test model should not repeat one token"
        _, lp = reference_logprobs(ref, p, c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=1e-5, rtol=0)
        assert c.policy_versions == [0] * len(c.token_ids)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == TOK.eos_token_id else "length")


def test_request_joins_running_batch() -> None:
    model = make_model()
    long_p, short_p = TOK.encode("a long request"), TOK.encode("short")
    greedy = SamplingParams(max_tokens=60, temperature=0)
    with running_engine(model) as engine:
        solo_long = engine.submit(long_p, greedy).result(timeout=60)
        solo_short = engine.submit(short_p, SamplingParams(max_tokens=10, temperature=0)).result(timeout=60)
        assert engine.stats().max_decode_batch == 1
        slow_down(model, 0.003)
        before = engine.stats().generated_tokens
        long_f = engine.submit(long_p, greedy)
        wait_until(lambda: engine.stats().generated_tokens >= before + 5)
        assert not long_f.done()
        short_f = engine.submit(short_p, SamplingParams(max_tokens=10, temperature=0))
        short_out, long_out = short_f.result(timeout=60), long_f.result(timeout=60)
        assert engine.stats().max_decode_batch == 2  # the short request was decoded alongside the long one
    assert long_out.completions[0].token_ids == solo_long.completions[0].token_ids
    assert short_out.completions[0].token_ids == solo_short.completions[0].token_ids


def test_seeded_sampling_and_scaled_logprobs() -> None:
    model, ref = make_model(), make_model()
    prompt = TOK.encode("sample me")

    def run(seed: int, top_p: float = 1.0):
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=top_p, n=4, seed=seed, top_logprobs=3)
        return engine.submit(prompt, params).result(timeout=60)

    with running_engine(model) as engine:
        a, b, c = run(123), run(123), run(124)
        nucleus = run(7, top_p=0.5)
    tokens = lambda out: [x.token_ids for x in out.completions]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)
    assert len({tuple(t) for t in tokens(a)}) > 1, "the n samples use different seeds (seed + i)"
    for comp in a.completions + nucleus.completions:
        all_lp, lp = reference_logprobs(ref, prompt, comp.token_ids, temperature=0.8)
        torch.testing.assert_close(torch.tensor(comp.logprobs), lp, atol=1e-5, rtol=0)
        for row, top in zip(all_lp, comp.top_logprobs):  # top_logprobs: the 3 best of the same distribution
            vals, ids = row.topk(3)
            assert [i for i, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), vals, atol=1e-5, rtol=0)
    for comp in nucleus.completions:  # top_p=0.5: every drawn token lies in the 0.5 nucleus
        all_lp, _ = reference_logprobs(ref, prompt, comp.token_ids, temperature=0.8)
        for row, tok in zip(all_lp.exp(), comp.token_ids):
            assert float(row[row > row[tok]].sum()) < 0.5


@pytest.mark.slow
def test_weight_update_mid_generation(tmp_path: Path) -> None:
    model, old = make_model(), make_model()
    new = copy.deepcopy(old)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    save_checkpoint_dir(new.state_dict(), new.args, tmp_path / "step_1")
    prompt = TOK.encode("update me")
    slow_down(model, 0.003)
    with running_engine(model) as engine:
        bad = engine.update_weights(tmp_path / "missing", 5)
        with pytest.raises(WeightUpdateError):
            bad.result(timeout=60)
        fut = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0))
        wait_until(lambda: engine.stats().generated_tokens >= 5)
        assert engine.update_weights(tmp_path / "step_1", 1).result(timeout=60) == 1
        (c,) = fut.result(timeout=60).completions
        assert engine.version == 1
    v = c.policy_versions
    k = v.index(1)
    assert 0 < k < 40 and v == [0] * k + [1] * (40 - k)
    assert c.token_ids[:k] == greedy_reference(old, prompt, 40)[:k]
    assert c.token_ids != greedy_reference(old, prompt, 40), "the new weights must change the continuation"
    with torch.no_grad():
        logits = new(torch.tensor([prompt + c.token_ids]))[0].float()
    for j in range(k, 40):  # each new-version token is the new model's argmax given everything before it
        assert c.token_ids[j] == int(logits[len(prompt) - 1 + j, : TOK.vocab_size].argmax())
    _, lp = reference_logprobs(new, prompt, c.token_ids)
    torch.testing.assert_close(torch.tensor(c.logprobs[k:]), lp[k:], atol=1e-5, rtol=0)


def test_engine_rejects_impossible_requests() -> None:
    with running_engine(make_model(), max_batch_size=2) as engine:
        for prompt, params, param in [
            ([1] * SEQ_LEN, SamplingParams(max_tokens=1), "prompt"),
            ([1] * 100, SamplingParams(max_tokens=29), "max_tokens"),
            ([1], SamplingParams(n=3), "n"),
            ([1, 10_000], SamplingParams(), "prompt"),
            ([], SamplingParams(), "prompt"),
            ([1], SamplingParams(temperature=-1), "temperature"),
        ]:
            with pytest.raises(InvalidRequest) as e:
                engine.submit(prompt, params)
            assert e.value.param == param
        cancelled = engine.submit([1, 2], SamplingParams(max_tokens=100, temperature=0, n=2))
        cancelled.cancel()  # an abandoned request gives its slots back
        out = engine.submit([1, 2], SamplingParams(max_tokens=3, temperature=0, n=2)).result(timeout=60)
        assert [len(c.token_ids) for c in out.completions] == [3, 3]
    with pytest.raises(RuntimeError, match="stopped"):
        engine.submit([1], SamplingParams())


# ---- HTTP ----

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route loopback via a proxy


def http(url: str, body: Any = None, raw: bytes | None = None, method: str | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url,
        data=data,
        method=method or ("POST" if data is not None else "GET"),
        headers={"Content-Type": "application/json"},
    )
    try:
        with _OPENER.open(req, timeout=60) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers.get_content_type()
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers.get_content_type()
    return status, (json.loads(text) if ctype == "application/json" else text)


@contextlib.contextmanager
def server(
    model: torch.nn.Module | None = None, max_batch_size: int = 4, seq_len: int = SEQ_LEN
) -> Iterator[tuple[str, Engine]]:
    with (
        running_engine(model or make_model(), max_batch_size, seq_len) as engine,
        BackgroundServer(engine, TOK, model_name="qwen3-test") as srv,
    ):
        yield srv.url, engine


def test_http_completions_and_chat() -> None:
    ref = make_model()
    with server() as (url, _):
        status, r = http(
            url + "/v1/completions",
            {
                "prompt": ["hello", "world!"],
                "max_tokens": 8,
                "temperature": 0,
                "n": 2,
                "logprobs": 2,
                "return_token_ids": True,
            },
        )
        assert status == 200, r
        assert r["object"] == "text_completion" and [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        for i, c in enumerate(r["choices"]):
            prompt = TOK.encode(["hello", "world!"][i // 2])
            assert c["prompt_token_ids"] == prompt
            assert c["token_ids"] == greedy_reference(ref, prompt, 8)
            assert len(c["token_ids"]) == len(c["policy_versions"]) == len(c["logprobs"]["token_logprobs"])
            assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["top_logprobs"]) == len(c["token_ids"])
            assert c["text"] == TOK.decode(c["token_ids"]) and c["policy_versions"] == [0] * len(c["token_ids"])
            _, lp = reference_logprobs(ref, prompt, c["token_ids"])
            torch.testing.assert_close(torch.tensor(c["logprobs"]["token_logprobs"]), lp, atol=1e-5, rtol=0)
        assert r["usage"] == {"prompt_tokens": 11, "completion_tokens": 32, "total_tokens": 43}

        status, r = http(url + "/v1/completions", {"prompt": [104, 105], "max_tokens": 4, "temperature": 0})
        assert status == 200 and "token_ids" not in r["choices"][0] and r["choices"][0]["logprobs"] is None
        assert len(r["choices"][0]["policy_versions"]) == r["usage"]["completion_tokens"]

        messages = [{"role": "user", "content": "hi there"}]
        status, r = http(
            url + "/v1/chat/completions",
            {
                "messages": messages,
                "max_tokens": 6,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
                "return_token_ids": True,
            },
        )
        assert status == 200, r
        prompt = TOK.apply_chat_template(messages, add_generation_prompt=True)
        (c,) = r["choices"]
        assert r["object"] == "chat.completion" and r["prompt_token_ids"] == prompt
        assert c["token_ids"] == greedy_reference(ref, prompt, 6)
        assert c["message"] == {"role": "assistant", "content": TOK.decode(c["token_ids"])}
        content = c["logprobs"]["content"]
        assert len(content) == len(c["token_ids"]) == len(c["policy_versions"])
        assert all(len(t["top_logprobs"]) == 2 for t in content)
        raw = b"".join(bytes(t["bytes"]) for t, i in zip(content, c["token_ids"]) if i < 256)
        assert raw.decode("utf-8", errors="replace") == c["message"]["content"]
        _, lp = reference_logprobs(ref, prompt, c["token_ids"])
        torch.testing.assert_close(torch.tensor([t["logprob"] for t in content]), lp, atol=1e-5, rtol=0)


TOOLS = [{"type": "function", "function": {"name": "add"}}]


def test_http_chat_renders_tools_and_answers_tool_calls_as_the_gateway_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tools` reach the chat template (an earlier call and its result in the history too), a reply's
    `<tool_call>` block comes back as OpenAI `tool_calls` (tool_choice "auto") or as text ("none"); a forced call
    and the completions fields `echo` and `suffix` are refused, naming the field."""
    messages = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    with server(seq_len=512) as (url, engine):  # the byte tokenizer's tool preamble alone is ~100 tokens
        status, r = http(url + "/v1/chat/completions", body)
        assert status == 200, r
        rendered = TOK.apply_chat_template(chat.parse_messages(body), add_generation_prompt=True, tools=TOOLS)
        assert r["prompt_token_ids"] == rendered != TOK.apply_chat_template(chat.parse_messages(body))
        call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
        reply = concurrent.futures.Future()
        reply.set_result(RequestOutput(rendered, [Completion(0, [1], [-0.5], [], [0], "stop", None, call)]))
        monkeypatch.setattr(engine, "submit", lambda *args, **kwargs: reply)
        status, r = http(url + "/v1/chat/completions", body)
        (c,) = r["choices"]
        assert status == 200 and c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        assert [t["function"] for t in c["message"]["tool_calls"]] == [{"name": "add", "arguments": '{"a": 2}'}]
        status, r = http(url + "/v1/chat/completions", {**body, "tool_choice": "none"})
        assert r["choices"][0]["message"] == {"role": "assistant", "content": call}
        for bad, param in [({"tool_choice": "required"}, "tool_choice"), ({"tools": "add"}, "tools")]:
            status, r = http(url + "/v1/chat/completions", {**body, **bad})
            assert status == 400 and r["error"]["param"] == param, r
        for bad in ({"echo": True}, {"suffix": "!"}):
            status, r = http(url + "/v1/completions", {"prompt": [104], "max_tokens": 2, **bad})
            assert status == 400 and r["error"]["param"] == next(iter(bad)), r


def test_http_stop_strings() -> None:
    with server() as (url, _):
        body = {"prompt": "stop somewhere", "max_tokens": 30, "temperature": 0, "return_token_ids": True}
        _, full = http(url + "/v1/completions", body)
        ids, text = full["choices"][0]["token_ids"], full["choices"][0]["text"]
        stop = next(chr(t) for t in ids[2:] if 33 <= t < 127)  # a printable character the model will emit
        _, r = http(url + "/v1/completions", {**body, "stop": ["\x00never", stop]})
        (c,) = r["choices"]
        assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
        assert c["text"] == text[: text.index(stop)]
        assert c["token_ids"] == ids[: len(c["token_ids"])] and len(c["token_ids"]) < 30


def test_http_health_metrics_pause_and_errors(tmp_path: Path) -> None:
    with server() as (url, engine):
        assert http(url + "/health") == (200, {"status": "ok", "policy_version": 0, "sleeping": 0})
        status, models = http(url + "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "qwen3-test"
        body = {"prompt": "x", "max_tokens": 5, "temperature": 0}
        assert http(url + "/v1/completions", body)[0] == 200
        status, text = http(url + "/metrics")
        assert status == 200 and "# TYPE arbor_generated_tokens_total counter" in text
        assert "arbor_generated_tokens_total 5" in text and "arbor_requests_total 1" in text

        assert http(url + "/pause", {}) == (200, {"paused": True})
        result: list[tuple[int, Any]] = []
        waiter = threading.Thread(target=lambda: result.append(http(url + "/v1/completions", body)))
        waiter.start()
        wait_until(lambda: engine.stats().waiting == 1)
        time.sleep(0.2)
        assert waiter.is_alive() and not result
        assert http(url + "/resume", {}) == (200, {"paused": False})
        waiter.join(60)
        assert result[0][0] == 200

        status, err = http(url + "/v1/completions", raw=b"{not json")
        assert status == 400 and "malformed JSON" in err["error"]["message"]
        for route, bad, param in [
            ("/v1/completions", {"prompt": "x" * SEQ_LEN}, "prompt"),
            ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 100}, "max_tokens"),
            ("/v1/completions", {"prompt": [1, 999_999]}, "prompt"),
            ("/v1/completions", {"prompt": "x", "n": 5}, "n"),
            ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
            ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
            ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
            ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
            ("/v1/chat/completions", {"messages": "hello"}, "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * SEQ_LEN}]}, "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
            # sampling fields the local engine does not implement: refused unless neutral, never silently ignored
            ("/v1/completions", {"prompt": "x", "top_k": 20}, "top_k"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_p": 0.05}, "min_p"),
            ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"),
            ("/v1/completions", {"prompt": "x", "ignore_eos": True}, "ignore_eos"),
            ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
            ("/update_weights", {"path": str(tmp_path / "nope"), "version": 3}, "path"),
            ("/update_weights", {"path": str(tmp_path)}, "version"),
        ]:
            status, err = http(url + route, bad)
            assert status == 400, (bad, err)
            assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error", (bad, err)
        neutral = {
            "top_k": -1,
            "min_p": 0.0,
            "presence_penalty": 0,
            "repetition_penalty": 1.0,
            "logit_bias": {},
            "best_of": 1,
            "response_format": {"type": "text"},
        }
        assert http(url + "/v1/completions", {"prompt": "x", "max_tokens": 2, **neutral})[0] == 200
        assert (
            http(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})[1][
                "error"
            ]["message"]
            == "stream is not supported by the local backend"
        )
        status, err = http(url + "/no/such/route")
        assert status == 404 and "error" in err

        new = make_model(seed=1)
        broken = {**new.state_dict(), "model.norm.weight": torch.ones(5)}  # new values, but one bad shape
        save_checkpoint_dir(broken, new.args, tmp_path / "broken")
        status, err = http(url + "/update_weights", {"path": str(tmp_path / "broken"), "version": 1})
        assert status == 400 and "shape" in err["error"]["message"] and err["error"]["param"] == "path"
        # Nothing was copied: the old weights still produce the same text, still as version 0.
        _, again = http(url + "/v1/completions", body)
        assert again["choices"][0]["text"] == result[0][1]["choices"][0]["text"]
        assert again["choices"][0]["policy_versions"] == [0] * 5

        save_checkpoint_dir(new.state_dict(), new.args, tmp_path / "step_1")
        assert http(url + "/update_weights", {"path": str(tmp_path / "step_1"), "version": 1}) == (
            200,
            {"policy_version": 1},
        )
        _, r = http(url + "/v1/completions", {**body, "return_token_ids": True})
        assert r["choices"][0]["policy_versions"] == [1] * 5
        assert r["choices"][0]["token_ids"] == greedy_reference(new, TOK.encode("x"), 5)
        assert http(url + "/health")[1]["policy_version"] == 1


def test_http_engine_errors_and_disconnects() -> None:
    model = make_model()
    forward, fail = model.forward, threading.Event()

    def flaky(*args: Any, **kwargs: Any) -> torch.Tensor:
        if fail.is_set() and args[0].shape[1] == 1:  # a decode step, not a prefill
            fail.clear()
            raise RuntimeError("injected decode failure")
        time.sleep(0.01)
        return forward(*args, **kwargs)

    model.forward = flaky
    with server(model) as (url, engine):
        fail.set()
        status, err = http(url + "/v1/completions", {"prompt": "x", "max_tokens": 5})
        assert status == 500 and "injected decode failure" in err["error"]["message"]
        assert engine.stats().running == 0  # its slot was given back
        assert http(url + "/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200

        req = urllib.request.Request(
            url + "/v1/completions", method="POST", data=json.dumps({"prompt": "x", "max_tokens": 100}).encode()
        )
        with pytest.raises(OSError):  # the client gives up long before 100 slow tokens are done
            _OPENER.open(req, timeout=0.3)
        wait_until(lambda: engine.stats().running == 0, timeout=5)  # the hang-up aborted the request
        assert engine.stats().generated_tokens < 60


# ---- process ----


def test_bad_config_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--port", "-1"]) == 2
    assert "port" in capsys.readouterr().err


@pytest.mark.slow
def test_server_process_ready_file_and_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arbor.inference.server",
            "--model.name",
            "qwen3-test",
            "--port",
            "0",
            "--seq-len",
            "64",
            "--max-batch-size",
            "2",
            "--num-threads",
            "1",
            "--ready-file",
            str(ready),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, proc.stderr.read()
        url = ready.read_text().strip()
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert http(url + "/health") == (200, {"status": "ok", "policy_version": 0, "sleeping": 0})
        status, r = http(url + "/v1/completions", {"prompt": "hi", "max_tokens": 3, "return_token_ids": True})
        assert status == 200 and len(r["choices"][0]["token_ids"]) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert f"inference ready at {url}" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
