"""The gateway: OpenAI wire format (plain and streamed, with the openai client), errors and fuzzing, token-exact
multi-turn sessions with branching, concurrency against the real CPU engine, and the black_box environment."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from arbor.config.orchestrator import GatewayConfig
from arbor.models.tokenizer import ByteTokenizer
from arbor.orchestrator.client import Completion
from arbor.orchestrator.gateway.service import Gateway
from arbor.transport.chat import split_tool_calls

TOK = ByteTokenizer()
AGENT = Path(__file__).resolve().parents[2] / "examples" / "black_box_agent" / "agent.py"


class FakeClient:
    """A scripted backend: `reply(prompt_ids) -> text`; token ids are the text's bytes plus <|im_end|>."""

    def __init__(self, reply: Callable[[list[int]], str] = lambda p: "ok", delay: float = 0.0, tok: Any = TOK) -> None:
        self.reply, self.delay, self.requests, self.tok = reply, delay, [], tok

    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, stop=None):
        self.requests.append({"prompt": list(prompt_ids), "n": n, "max_tokens": max_tokens, "temperature": temperature})
        await asyncio.sleep(self.delay)
        out = []
        for k in range(n):
            text = self.reply(prompt_ids)
            # one token per character: not how the tokenizer would encode the text, as a sampled model may do
            ids = ([t for ch in text for t in self.tok.encode(ch)] + [self.tok.eos_token_id])[:max_tokens]
            finish = "stop" if ids[-1] == self.tok.eos_token_id else "length"
            out.append(Completion(ids, [-0.25 - k] * len(ids), [7] * len(ids), self.tok.decode(ids), finish))
        return out


class Served:
    """A gateway on an event loop in a thread, so blocking clients (openai, urllib) can call it."""

    def __init__(
        self,
        client: Any,
        cfg: GatewayConfig | None = None,
        max_tokens: int = 32,
        seq_len: int = 512,
        tokenizer: Any = TOK,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gw = Gateway(
            client,
            tokenizer,
            cfg or GatewayConfig(),
            temperature=1.0,
            top_p=1.0,
            max_tokens=max_tokens,
            seq_len=seq_len,
        )
        self.call(self.gw.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def open(self, sid: str | None = None):
        async def go():
            return self.gw.open(sid)

        return self.call(go())

    def close(self) -> None:
        self.call(self.gw.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def __enter__(self) -> "Served":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_render(tokenizer: Any) -> Callable[[list[dict], list[dict] | None, bool], list[int]]:
    """The chat template as the gateway applies it: (messages, tools, add_generation_prompt) -> token ids."""
    return lambda messages, tools, generation: tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tools=tools
    )


def _post(url: str, body: bytes | dict, headers: dict[str, str] | None = None, method: str = "POST"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _openai(base_url: str, key: str = "none"):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def test_config_requires_a_key_beyond_loopback() -> None:
    with pytest.raises(ValueError, match="api_key is required"):
        GatewayConfig(host="0.0.0.0")
    assert GatewayConfig(host="0.0.0.0", api_key="k").api_key == "k"
    GatewayConfig(host="::1")


def test_chat_and_completions_with_the_openai_client_plain_and_streamed() -> None:
    with Served(FakeClient(lambda p: "cba")) as srv:
        s = srv.open()
        oa = _openai(srv.gw.base_url(s.id))
        assert [m.id for m in oa.models.list()] == ["arbor"]
        r = oa.chat.completions.create(
            model="arbor", messages=[{"role": "user", "content": "Reverse: abc"}], temperature=0.1, max_tokens=100
        )
        assert r.choices[0].message.content == "cba" and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == len(s.turns[0].prompt_ids)
        # override_sampling: the run's temperature and at most its max_tokens, whatever the agent asks
        assert srv.gw.client.requests[0]["temperature"] == 1.0 and srv.gw.client.requests[0]["max_tokens"] == 32
        stream = oa.chat.completions.create(
            model="arbor",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "cba"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == 4
        text = oa.completions.create(model="arbor", prompt="hello", max_tokens=5)
        assert text.choices[0].text == "cba"
        streamed = list(oa.completions.create(model="arbor", prompt=[104, 105], max_tokens=5, stream=True))
        assert streamed[0].choices[0].text == "cba"
        # the header form of the session id
        hdr = _openai(srv.gw.url + "/v1").with_options(default_headers={"X-Session-Id": s.id})
        hdr.chat.completions.create(model="arbor", messages=[{"role": "user", "content": "y"}])
        assert len(s.turns) == 5
        assert s.turns[3].prompt_ids == [104, 105] and s.turns[1].completion_ids == TOK.encode("cba") + [
            TOK.eos_token_id
        ]


def test_tool_calls_are_parsed_and_their_echo_extends_the_session(chat_tokenizer) -> None:
    tok = chat_tokenizer
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    replies = iter([f"let me add{call}", "3"])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with Served(FakeClient(lambda p: next(replies), tok=tok), max_tokens=128, tokenizer=tok) as srv:
        s = srv.open()
        oa = _openai(srv.gw.base_url(s.id))
        msgs = [{"role": "user", "content": "1+2?"}]
        r = oa.chat.completions.create(model="arbor", messages=msgs, tools=tools)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.content == "let me add"
        assert m.tool_calls[0].function.name == "add" and json.loads(m.tool_calls[0].function.arguments) == {
            "a": 1,
            "b": 2,
        }
        msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3"}]
        oa.chat.completions.create(model="arbor", messages=msgs, tools=tools)
        assert s.turns[1].parent == 0  # the echoed tool call matched the recorded reply: one sample
        (sample,) = s.rollouts()
        assert (sample.prompt_ids + sample.completion_ids)[: len(s.turns[0].ids)] == s.turns[0].ids
        if isinstance(tok, ByteTokenizer):
            assert b"# Tools" in bytes(t for t in s.turns[0].prompt_ids if t < 256)
        assert "# Tools" in tok.decode(s.turns[0].prompt_ids)
    assert split_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    '{% for c in m.get(\'tool_calls\') or [] %}\n<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}'
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_hf_template_with_tools_keeps_the_models_own_tokenization(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from arbor.models.tokenizer import HFTokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(
        ['<tool_call> {"name": "add", "arguments": {"a": 1}} </tool_call> the sum is'] * 30, trainer
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.chat_template = TOOLS_TEMPLATE
    fast.save_pretrained(str(tmp_path))
    tok = HFTokenizer(tmp_path)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    replies = iter([call, "the sum is 3"])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with Served(FakeClient(lambda p: next(replies), tok=tok), max_tokens=200, tokenizer=tok) as srv:
        s = srv.open()
        oa = _openai(srv.gw.base_url(s.id))
        msgs = [{"role": "user", "content": "add 1 and 2"}]
        m = oa.chat.completions.create(model="arbor", messages=msgs, tools=tools).choices[0].message
        assert m.tool_calls[0].function.name == "add" and m.content is None
        msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3"}]
        oa.chat.completions.create(model="arbor", messages=msgs, tools=tools)
        (sample,) = s.rollouts()
    t0, t1 = s.turns
    assert t1.parent == 0 and t0.prompt_ids == tok.encode(
        fast.apply_chat_template(msgs[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    )
    assert t0.completion_ids != tok.encode(call) + [tok.eos_token_id]  # the model's own (per-character) tokens...
    ids = sample.prompt_ids + sample.completion_ids
    assert ids[: len(t0.ids)] == t0.ids and ids == t1.ids  # ...are what the sample trains on, never re-tokenised
    assert sum(sample.completion_mask) == len(t0.completion_ids) + len(t1.completion_ids)


def _chat(oa, messages):
    r = oa.chat.completions.create(model="arbor", messages=messages)
    return {"role": "assistant", "content": r.choices[0].message.content}


def _model_positions(sample) -> list[bool]:
    return [False] * len(sample.prompt_ids) + [bool(m) for m in sample.completion_mask]


def test_multi_turn_session_is_token_exact(chat_tokenizer) -> None:
    tok = chat_tokenizer
    render = make_render(tok)
    with Served(FakeClient(lambda p: f"turn{len(p)}", tok=tok), tokenizer=tok) as srv:
        s = srv.open()
        oa = _openai(srv.gw.base_url(s.id))
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one"}]
        for user in ("two", "three"):
            msgs += [_chat(oa, msgs), {"role": "user", "content": user}]
        msgs.append(_chat(oa, msgs))
        assert [t.parent for t in s.turns] == [None, 0, 1]
        (sample,) = s.rollouts()
    ids = sample.prompt_ids + sample.completion_ids
    assert sample.prompt_ids == render(msgs[:2], None, True)
    model = _model_positions(sample)
    at = 0
    for t in s.turns:
        assert ids[: len(t.ids)] == t.ids  # every turn's exact prompt and completion, never re-tokenised
        assert all(model[len(t.prompt_ids) : len(t.ids)]) and not any(model[at : len(t.prompt_ids)])
        at = len(t.ids)
    assert ids == s.turns[-1].ids and len(model) == len(ids)
    # the injected tokens between turns are the template's rendering of the new user message
    assert ids[len(s.turns[0].ids) : len(s.turns[1].prompt_ids)] == [*tok.encode("\n"), *render([msgs[3]], None, True)]
    assert sample.logprobs[: len(s.turns[0].completion_ids)] == s.turns[0].logprobs
    assert {v for v, m in zip(sample.policy_versions, sample.completion_mask) if m} == {7}
    assert {v for v, m in zip(sample.policy_versions, sample.completion_mask) if not m} == {-1}
    assert sample.staleness(9) == 2
    # the batcher trains exactly the model's tokens
    from arbor.orchestrator.batcher import sample_arrays

    arrays = sample_arrays(sample)
    assert arrays["loss_mask"].tolist() == model
    assert sample.num_trained == sum(len(t.completion_ids) for t in s.turns)


def test_agent_that_truncates_its_history_branches_into_exact_samples(chat_tokenizer) -> None:
    tok = chat_tokenizer
    render = make_render(tok)
    with Served(FakeClient(lambda p: f"r{len(p)}", tok=tok), tokenizer=tok) as srv:
        s = srv.open()
        oa = _openai(srv.gw.base_url(s.id))
        msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}]
        msgs += [_chat(oa, msgs), {"role": "user", "content": "b"}]
        msgs += [_chat(oa, msgs), {"role": "user", "content": "c"}]
        trimmed = [msgs[0], *msgs[3:]]  # context management: the first exchange is dropped
        trimmed += [_chat(oa, trimmed), {"role": "user", "content": "d"}]
        trimmed.append(_chat(oa, trimmed))
        assert [t.parent for t in s.turns] == [None, 0, None, 2]
        samples = s.rollouts()
    assert len(samples) == 2
    for sample, chain in zip(samples, ([s.turns[0], s.turns[1]], [s.turns[2], s.turns[3]])):
        ids = sample.prompt_ids + sample.completion_ids
        assert ids == chain[-1].ids and sample.prompt_ids == chain[0].prompt_ids
        model = _model_positions(sample)
        for t in chain:
            assert ids[: len(t.ids)] == t.ids and all(model[len(t.prompt_ids) : len(t.ids)])
        assert sum(model) == sum(len(t.completion_ids) for t in chain)
    assert samples[1].prompt_ids == render([msgs[0], *msgs[3:6]], None, True)


def test_errors_are_4xx_and_fuzzed_requests_never_break_the_server() -> None:
    cfg = GatewayConfig(api_key="secret", max_request_bytes=4096)
    with Served(FakeClient(), cfg) as srv:
        s = srv.open("s1")
        key = {"Authorization": "Bearer secret"}
        chat = f"{srv.gw.url}/v1/sessions/s1/v1/chat/completions"
        ok = {"messages": [{"role": "user", "content": "hi"}]}
        assert _post(chat, ok)[0] == 401
        assert _post(chat, ok, {"Authorization": "Bearer wrong"})[0] == 401
        assert _post(chat, ok, key)[0] == 200
        assert _post(f"{srv.gw.url}/v1/sessions/nope/v1/chat/completions", ok, key)[0] == 404
        assert _post(chat, b"{not json", key)[0] == 400
        assert _post(chat, {"messages": [{"role": "user", "content": "x" * 5000}]}, key)[0] == 413
        assert _post(f"{srv.gw.url}/v1/chat/completions", ok, key)[0] == 400  # no session anywhere
        status, body = _post(f"{srv.gw.url}/v1/sessions", {"id": "s2"}, key)
        assert status == 201 and json.loads(body)["base_url"].endswith("/v1/sessions/s2/v1")
        assert _post(f"{srv.gw.url}/v1/sessions", {"id": "s2"}, key)[0] == 409
        reward = f"{srv.gw.url}/v1/sessions/s1/reward"
        assert _post(reward, {"reward": "high"}, key)[0] == 400
        assert _post(reward, b'{"reward": NaN}', key)[0] == 400
        assert _post(reward, b'{"reward": 1, "components": {"a": Infinity}}', key)[0] == 400
        assert _post(reward, {"reward": 1.0, "components": {"a": 1}}, key)[0] == 200
        assert _post(reward, {"reward": 1.0}, key)[0] == 409
        assert _post(chat, ok, key)[0] == 409
        assert s.reward == 1.0 and s.components == {"a": 1.0}

        rng = random.Random(0)
        values = [None, 0, -1, 1.5, True, "x", [], {}, [1, "a"], {"role": 3}, "\udcff", 10**30, [[1]], [{"a": {}}]]
        fields = [
            "messages",
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stream",
            "stop",
            "tools",
            "seed",
            "stream_options",
            "max_completion_tokens",
            "reward",
            "components",
            "id",
            "task_id",
        ]
        paths = [
            "/v1/sessions/s2/v1/chat/completions",
            "/v1/sessions/s2/v1/completions",
            "/v1/sessions",
            "/v1/sessions/s2/reward",
            "/v1/sessions/s2/v1/models",
            "/v1/nothing",
            "/v1/sessions/%00/reward",
        ]
        statuses = []
        for i in range(300):
            if i % 5 == 0:
                body: bytes | dict = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            elif i % 7 == 0:
                body = b"[" * 3000 + b"]" * 3000  # deep nesting, and beyond max_request_bytes
            else:
                body = {f: rng.choice(values) for f in rng.sample(fields, rng.randrange(1, 6))}
                try:
                    json.dumps(body).encode()
                except UnicodeEncodeError:
                    body = json.dumps(body, ensure_ascii=True).encode()
            status, _ = _post(srv.gw.url + rng.choice(paths), body, key if i % 11 else {})
            statuses.append(status)
        # s2 may have been closed by a fuzzed reward body that happened to be valid
        assert all(400 <= st < 500 or st in (200, 201) for st in statuses), sorted(set(statuses))
        assert sum(400 <= st < 500 for st in statuses) > 250
        assert _post(srv.gw.url + "/health", b"", method="GET")[0] == 200
        srv.open("s3")
        assert _post(f"{srv.gw.url}/v1/sessions/s3/v1/chat/completions", ok, key)[0] == 200


@pytest.mark.slow
def test_64_concurrent_sessions_against_the_cpu_engine_are_recorded_without_loss() -> None:
    import torch
    from openai import AsyncOpenAI

    from arbor.config.model import ModelConfig
    from arbor.inference.engine.core import Engine
    from arbor.inference.server import BackgroundServer
    from arbor.models import build_model
    from arbor.orchestrator.client import InferenceClient

    torch.manual_seed(0)
    model = build_model(ModelConfig(name="qwen3-test")).eval()
    engine = Engine(model, TOK, seq_len=128, max_batch_size=64, seed=0).start()
    render = make_render(TOK)
    try:
        with BackgroundServer(engine, TOK, model_name="qwen3-test") as backend:

            async def main() -> list:
                async with InferenceClient([backend.url], 60, 0) as client:
                    async with Gateway(
                        client, TOK, GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=6, seq_len=128
                    ) as gw:
                        sessions = [gw.open(f"s{i}") for i in range(64)]

                        async def agent(i: int) -> None:
                            oa = AsyncOpenAI(base_url=gw.base_url(f"s{i}"), api_key="none", max_retries=0)
                            msgs = [{"role": "user", "content": f"task {i}"}]
                            r = await oa.chat.completions.create(model="arbor", messages=msgs)
                            msgs += [
                                {"role": "assistant", "content": r.choices[0].message.content},
                                {"role": "user", "content": "again"},
                            ]
                            await oa.chat.completions.create(model="arbor", messages=msgs)
                            await oa.close()

                        await asyncio.gather(*(agent(i) for i in range(64)))
                        results = [(s, (await gw.finish(s.id)).rollouts()) for s in sessions]
                        await _fuzz_real_backend(gw)
                        return results

            results = asyncio.run(main())
    finally:
        engine.stop()
    assert len(results) == 64
    for i, (s, samples) in enumerate(results):
        assert len(s.turns) == 2
        assert s.turns[0].prompt_ids == render([{"role": "user", "content": f"task {i}"}], None, True)
        t0 = s.turns[0]
        assert 1 <= len(t0.completion_ids) <= 6 and len(t0.logprobs) == len(t0.completion_ids)
        assert all(v == 0 for v in t0.policy_versions)
        # the reply may not survive a decode/encode round trip (bytes of a split character): then it branches
        expected = 1 if s.turns[1].parent == 0 else 2
        assert len(samples) == expected
        assert (samples[-1].prompt_ids + samples[-1].completion_ids) == s.turns[1].ids
    assert sum(s.turns[1].parent == 0 for s, _ in results) >= 32


async def _fuzz_real_backend(gw: Gateway) -> None:
    """Odd but well-formed requests reach the real engine: whatever it refuses must come back as a 4xx."""
    import aiohttp

    gw.open("fuzz")
    url = gw.base_url("fuzz") + "/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    bodies = [
        {"messages": user, "seed": 2**62},
        {"messages": user, "stop": ["\u0000", "x" * 500]},
        {"messages": user, "max_tokens": 10**9, "n": 16},
        {"messages": [{"role": "user", "content": "é" * 200}]},
        {"messages": user, "seed": -1},
        {"messages": user, "n": 17},
        {"messages": user, "temperature": -1},
    ]
    async with aiohttp.ClientSession() as http:
        for body in bodies:
            async with http.post(url, json=body) as r:
                assert r.status < 500, (body, r.status, await r.text())
        async with http.post(gw.base_url("fuzz") + "/completions", json={"prompt": [10**6]}) as r:
            assert r.status == 400
        forced = {
            "messages": user,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
        }
        async with http.post(url, json=forced) as r:  # refused as arbor's servers refuse it, not served as "auto"
            assert r.status == 400 and (await r.json())["error"]["param"] == "tool_choice"


def _spec(task_id: int = 0):
    from arbor.orchestrator.group import GroupSpec

    return GroupSpec({"id": task_id, "text": "abc", "answer": "cba"}, [], 0, group_id=3)


def _run_group(env, client: FakeClient, group_size: int = 2, cfg: GatewayConfig | None = None) -> list:
    async def main():
        async with Gateway(
            client, TOK, cfg or GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=16, seq_len=64
        ) as gw:
            out = await env.run_group(gw, _spec(), group_size, {}, 10.0)
            assert not gw.sessions  # every session was finished and forgotten
            return out

    return asyncio.run(main())


@pytest.mark.slow
def test_black_box_env_runs_the_example_agent_as_a_subprocess() -> None:
    from arbor.environments.black_box import BlackBoxEnv

    env = BlackBoxEnv(command=[sys.executable, str(AGENT)], task_input="stdin", timeout=60)
    rollouts = _run_group(
        env,
        FakeClient(lambda p: "cba" if b"Reverse: abc" in bytes(t for t in p if t < 256) else "?"),
        cfg=GatewayConfig(api_key="k"),
    )
    assert len(rollouts) == 2 and all(r.reward == 1.0 and r.group_id == 3 for r in rollouts)
    assert rollouts[0].completion_ids == TOK.encode("cba") + [TOK.eos_token_id]


@pytest.mark.slow
def test_black_box_env_counts_failing_and_hanging_agents_and_takes_posted_rewards(tmp_path: Path) -> None:
    from arbor.environments.black_box import BlackBoxEnv

    env = BlackBoxEnv(command=[sys.executable, "-c", "import sys; sys.exit(3)"], retries=1)
    assert _run_group(env, FakeClient()) == [] and env.failed == 2 and env.retried == 2
    hang = BlackBoxEnv(command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5, retries=0)
    assert _run_group(hang, FakeClient(), group_size=1) == [] and hang.failed == 1

    poster = tmp_path / "poster.py"
    poster.write_text(
        "import json, os, sys, urllib.request\n"
        "from openai import OpenAI\n"
        "oa = OpenAI()\n"
        "oa.chat.completions.create(model='m', messages=[{'role': 'user', 'content': sys.argv[1]}])\n"
        "url = os.environ['OPENAI_BASE_URL'].rsplit('/v1', 1)[0] + '/reward'\n"
        "req = urllib.request.Request(url, json.dumps({'reward': 0.25, 'components': {'judge': 0.25}}).encode(),\n"
        "    {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
        "urllib.request.urlopen(req).read()\n"
        "print('ignored')\n"
    )
    env = BlackBoxEnv(command=[sys.executable, str(poster)])
    (r,) = _run_group(env, FakeClient(), group_size=1)
    assert r.reward == 0.25 and r.components == {"judge": 0.25}


def test_black_box_env_function_agent_and_bad_args() -> None:
    from arbor.environments.black_box import BlackBoxEnv

    env = BlackBoxEnv(function=f"{AGENT}:solve", max_concurrent_agents=4)
    rollouts = _run_group(env, FakeClient(lambda p: "cbx"), group_size=4)
    assert len(rollouts) == 4 and all(abs(r.reward - 2 / 3) < 1e-9 for r in rollouts)
    assert env.reference({"answer": "cba"}) == "cba" and env.task_text({"text": "abc"}) == "Reverse: abc"
    with pytest.raises(ValueError, match="exactly one"):
        BlackBoxEnv()
    with pytest.raises(ValueError, match="does not exist"):
        BlackBoxEnv(function="nowhere/agent.py:solve")


@pytest.mark.slow
def test_black_box_example_trains_end_to_end(tmp_path: Path) -> None:
    """The example's rl.toml, shortened: warm-up, then RL steps whose every rollout is the agent calling the
    gateway; the batches train (the reward-rising run is the full example, measured in the report)."""
    import subprocess

    from arbor.monitor.metrics import read_jsonl

    out = tmp_path / "run"
    root = Path(__file__).resolve().parents[2]
    argv = [
        sys.executable,
        "-m",
        "arbor.launch.rl",
        "@",
        str(root / "examples/black_box_agent/rl.toml"),
        "--output-dir",
        str(out),
        "--model.name",
        "qwen3-test",
        "--max-steps",
        "3",
        "--sft.steps",
        "5",
        "--sft.batch-size",
        "8",
        "--orchestrator.batch-size",
        "16",
        "--orchestrator.group-size",
        "4",
    ]
    res = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["gateway/calls"] > 0 and r["agents/failed"] == 0 and r["gateway/open_sessions"] == 0
        assert "loss" in r and 0.0 <= r["reward/mean"] <= 1.0
    assert rows[-1]["gateway/calls"] >= 48  # every rollout of the three steps went through the gateway
    assert (out / "gateway_url").read_text().startswith("http://127.0.0.1:")


def test_black_box_branched_sessions_count_once_in_group_advantages(tmp_path: Path) -> None:
    from arbor.config.orchestrator import AdvantageConfig
    from arbor.environments.black_box import BlackBoxEnv
    from arbor.orchestrator.advantages import compute_advantages

    agent = tmp_path / "restarting_agent.py"
    agent.write_text(
        "from openai import OpenAI\n"
        "def solve(task, base_url, api_key):\n"
        "    oa = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)\n"
        "    oa.chat.completions.create(model='m', messages=[{'role': 'user', 'content': task}])\n"
        "    again = [{'role': 'user', 'content': 'again: ' + task}]  # a fresh context: a second branch\n"
        "    return oa.chat.completions.create(model='m', messages=again).choices[0].message.content\n"
    )
    answers = iter(["cba", "cba", "xyz", "xyz"])  # session order is not fixed: the rewards differ by session
    env = BlackBoxEnv(function=f"{agent}:solve", max_concurrent_agents=1)
    rollouts = _run_group(env, FakeClient(lambda p: next(answers)), group_size=2)
    assert sorted(r.episode_id for r in rollouts) == [0, 0, 1, 1]
    assert sorted(r.reward for r in rollouts) == [0.0, 0.0, 1.0, 1.0]
    compute_advantages([rollouts], AdvantageConfig())
    for r in rollouts:  # two episodes (rewards 1 and 0), not four rollouts: +-0.5, shared by both branches
        assert r.advantage == pytest.approx(0.5 if r.reward == 1.0 else -0.5)


@pytest.mark.slow
def test_remote_agents_pull_work_and_post_rewards() -> None:
    """Pull mode: agents elsewhere claim tasks with POST /v1/work, call their session, POST the reward; a task
    nobody finishes in time is retried, then dropped and counted."""
    from openai import AsyncOpenAI

    from arbor.environments.black_box import BlackBoxEnv

    async def main():
        async with Gateway(
            FakeClient(lambda p: "cba"),
            TOK,
            GatewayConfig(api_key="k"),
            temperature=1.0,
            top_p=1.0,
            max_tokens=16,
            seq_len=64,
        ) as gw:
            import aiohttp

            key = {"Authorization": "Bearer k"}

            async def worker(http) -> int:
                done = 0
                while True:
                    async with http.post(gw.url + "/v1/work", json={"wait": 2}, headers=key) as r:
                        if r.status == 204:
                            return done
                        job = await r.json()
                    oa = AsyncOpenAI(base_url=job["base_url"], api_key="k", max_retries=0)
                    reply = await oa.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": job["task"]}]
                    )
                    await oa.close()
                    reward = float(reply.choices[0].message.content == "cba")
                    async with http.post(job["reward_url"], json={"reward": reward}, headers=key) as r:
                        assert r.status == 200
                    done += 1

            env = BlackBoxEnv(remote=True, timeout=30)
            async with aiohttp.ClientSession() as http:
                async with http.post(gw.url + "/v1/work", json={"wait": 99}, headers=key) as r:
                    assert r.status == 400
                group, served = await asyncio.gather(
                    env.run_group(gw, _spec(), 4, {}, 10.0), asyncio.gather(worker(http), worker(http))
                )
            assert sum(served) == 4 and len(group) == 4 and all(r.reward == 1.0 for r in group)
            lonely = BlackBoxEnv(remote=True, timeout=0.2, retries=1)
            assert await lonely.run_group(gw, _spec(), 1, {}, 10.0) == [] and lonely.failed == 1 and lonely.retried == 1
            assert not gw.sessions

    asyncio.run(main())


def test_closed_http_sessions_make_room_and_open_ones_get_429() -> None:
    with Served(FakeClient(), GatewayConfig(max_open_sessions=2)) as srv:
        url = srv.gw.url
        assert _post(url + "/v1/sessions", {"id": "a"})[0] == 201
        assert _post(url + "/v1/sessions", {"id": "b"})[0] == 201
        assert _post(url + "/v1/sessions", {"id": "c"})[0] == 429
        assert _post(url + "/v1/sessions/a/reward", {"reward": 0})[0] == 200
        assert _post(url + "/v1/sessions", {"id": "c"})[0] == 201  # closed "a" was evicted
        assert sorted(srv.gw.sessions) == ["b", "c"]
