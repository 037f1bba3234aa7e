"""`inference --backend vllm` against a real vLLM server (CPU or CUDA build), the session's shared one: token
ids and logprobs through arbor's proxy, per-token policy versions, filesystem weight updates in a row with the
trainer-vs-vLLM mismatch after each, abort and resume, cache salts, pause/resume, chat with the byte
tokenizer's Hugging Face export, hostile requests answered in arbor's error shape (never a 5xx, never a dead
engine), and the router in front of it and a second server that is killed (serving test_vllm_padding's
padding-heavy model, whose check it passes first).

The dense model is the `qwen3-tiny` preset (head_dim 32: vLLM's CPU attention refuses `qwen3-test`'s 8), in
float32, served by name (the adapter writes it and its tokenizer out once)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from fuzz_requests import check_answer, malformed, send
from test_orphans import alive
from test_vllm_padding import check_never_samples_a_padding_row, serve_padding_heavy_model
from vllm_server import SharedServer, post_json, vllm_server

from arbor.config.inference import RouterConfig
from arbor.config.model import ModelConfig
from arbor.inference.router.app import Router
from arbor.models import build_model
from arbor.models.tokenizer import ByteTokenizer
from arbor.orchestrator.client import Completion, InferenceClient
from arbor.orchestrator.partial import PartialRollouts
from arbor.trainer.step import shifted_logprobs
from arbor.transport.chat import parse_messages
from arbor.transport.http import start_site
from arbor.weights.transport import FilesystemTransport

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "qwen3-tiny"
SEQ_LEN = 512  # room for a greedy request long enough (~490 tokens) that an abort lands mid-decode
KL_TARGET = 1e-3
PROMPTS = [ByteTokenizer().encode(t) for t in ("reverse: abcdef", "hello vllm", "x", "0123456789 tokens")]


@pytest.fixture(scope="module")
def server(shared_vllm: SharedServer) -> str:
    """The session's shared server of this preset (conftest): the module's tests leave it trained (three updates)."""
    assert (shared_vllm.model, shared_vllm.seq_len) == (MODEL, SEQ_LEN)
    return shared_vllm.url()


def mismatch_kl(trainer_lp: torch.Tensor, inference_lp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(inference || trainer) estimated on the sampled tokens (k3: r - 1 - log r, r = p_train / p_inf)."""
    d = trainer_lp.double() - inference_lp.double()
    return torch.expm1(d) - d


def trainer_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], **forward: torch.Tensor
) -> torch.Tensor:
    ids = torch.tensor(prompt + completion)
    with torch.no_grad():
        # over the tokenizer's ids: the policy vLLM samples and reports behind arbor's padding mask, as the trainer
        logits = model(ids[None], **forward)[0, :, : ByteTokenizer().vocab_size]
        lp, _ = shifted_logprobs(logits, ids, temperature=1.0, with_entropy=False)
    return lp[len(prompt) :]


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Moves every weight by `scale` of its own spread (a large RL step), deterministically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * (p.std() if p.numel() > 1 else 1.0) * torch.randn(p.shape, generator=gen))


def test_logprobs_and_versions_match_the_trainer_over_three_weight_updates(server: str, tmp_path: Path) -> None:
    """fp32, same weights: vLLM's processed logprobs of its own samples agree with the trainer's full forward
    (mismatch KL per token < 1e-3) before and after three consecutive updates from published directories,
    and every token carries the version it was sampled under."""
    model = build_model(ModelConfig(name=MODEL))
    kls = []
    for version in range(4):
        if version:
            perturbed(model, version)
            path = FilesystemTransport().publish(tmp_path / "run", version, model.state_dict(), model.args)
            assert post_json(server, "/update_weights", {"path": str(path), "version": version}) == {
                "policy_version": version
            }
        per_token = []
        for i, prompt in enumerate(PROMPTS):
            out = post_json(
                server,
                "/v1/completions",
                {
                    "prompt": prompt,
                    "max_tokens": 24,
                    "n": 2,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "seed": 10 * version + i,
                },
            )
            for c in out["choices"]:
                assert c["policy_versions"] == [version] * len(c["token_ids"]) and c["prompt_token_ids"] == prompt
                assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"]) > 0
                ref = trainer_logprobs(model, prompt, c["token_ids"])
                per_token.append(mismatch_kl(ref, torch.tensor(c["logprobs"]["token_logprobs"])))
        kls.append(float(torch.cat(per_token).mean()))
    print(f"dense mismatch KL per token, versions 0-3: {kls}")
    assert max(kls) < KL_TARGET, kls


def test_abort_and_resume_equals_uninterrupted_greedy(server: str) -> None:
    """A greedy request aborted through /abort_requests answers its partial tokens, and the GroupHandle's
    resumed completion equals the uninterrupted one token for token."""
    prompt, max_tokens = PROMPTS[0], SEQ_LEN - len(PROMPTS[0]) - 8

    async def go() -> tuple[Completion, Completion]:
        async with InferenceClient([server], timeout=600, max_retries=0) as client:
            await client.generate(prompt, 1, 4, 0.0, 1.0, 0)  # warm the connection: the timing below is decode
            start = time.perf_counter()
            (whole,) = await client.generate(prompt, 1, max_tokens, 0.0, 1.0, 0)
            took = time.perf_counter() - start
            ctl = PartialRollouts(client)
            # The abort must land while the request decodes, a window whose length depends on the machine: aim
            # at fractions of the uninterrupted request's own time, a few rounds over.
            for attempt, fraction in enumerate((0.5, 0.3, 0.7, 0.2, 0.4, 0.6, 0.1, 0.8) * 3):
                delay = fraction * took
                h = ctl.handle(f"g{attempt}")
                job = asyncio.create_task(h.generate(prompt, 1, max_tokens, 0.0, 1.0, 0))
                await asyncio.sleep(delay)
                await ctl.abort([h])
                h.resume()
                (out,) = await job
                if out.pieces > 1:
                    return whole, out
            raise AssertionError("every request finished before its abort")

    whole, resumed = asyncio.run(go())
    assert whole.finish_reason == "length" and resumed.token_ids == whole.token_ids
    assert len(resumed.logprobs) == len(resumed.policy_versions) == max_tokens


def test_a_completion_ends_at_the_stop_token_ids_the_client_sends(server: str) -> None:
    """The orchestrator's client sends its tokenizer's stop ids (a chat template's turn end, which vLLM would not
    know from a checkpoint without generation_config.json): vLLM stops at the first of them, keeping it, as arbor's
    engine does (tests/models/test_turn_end.py)."""

    async def greedy(stop: tuple[int, ...]) -> tuple[list[int], str]:
        async with InferenceClient([server], timeout=600, max_retries=0, stop_token_ids=stop) as client:
            (c,) = await client.generate(PROMPTS[3], 1, 12, 0.0, 1.0, 0)
            return c.token_ids, c.finish_reason

    ids, _ = asyncio.run(greedy(()))
    k = next((k for k in range(1, len(ids)) if ids[k] not in ids[:k]), 0)
    assert asyncio.run(greedy((ByteTokenizer().eos_token_id, ids[k]))) == (ids[: k + 1], "stop")


def test_cache_salts_pause_resume_and_chat(server: str) -> None:
    """Salted requests (the proxy's per-version salt or the caller's own) decode alike; /pause holds new
    requests in the proxy until /resume; chat runs through vLLM's tokenizer (the byte tokenizer's export)."""
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0.0, "logprobs": 0}
    plain = post_json(server, "/v1/completions", body)["choices"][0]
    for salt in ("a", "b"):
        salted = post_json(server, "/v1/completions", {**body, "cache_salt": salt})["choices"][0]
        assert salted["token_ids"] == plain["token_ids"]
        torch.testing.assert_close(
            salted["logprobs"]["token_logprobs"], plain["logprobs"]["token_logprobs"], atol=1e-4, rtol=0
        )

    post_json(server, "/pause", {})
    held: dict[str, object] = {}
    thread = threading.Thread(target=lambda: held.update(out=post_json(server, "/v1/completions", body)))
    thread.start()
    time.sleep(2.0)
    assert thread.is_alive() and "out" not in held  # held in the proxy while paused
    post_json(server, "/resume", {})
    thread.join(timeout=120)
    assert held["out"]["choices"][0]["token_ids"] == plain["token_ids"]  # type: ignore[index]

    chat = post_json(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.0, "logprobs": True},
    )
    (c,) = chat["choices"]
    tok = ByteTokenizer()
    assert len(c["token_ids"]) == len(c["logprobs"]["content"]) == len(c["policy_versions"]) > 0
    assert c["message"]["content"] == tok.decode(c["token_ids"])
    assert chat["prompt_token_ids"] == tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # tools and an earlier call (its arguments a JSON string, as OpenAI clients send them) render as the local
    # engine renders them; vLLM runs without a tool parser, so the proxy sends tool_choice "none" and parses
    tools = [
        {"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}}}}}
    ]
    turns = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    chat = post_json(
        server, "/v1/chat/completions", {"messages": turns, "tools": tools, "max_tokens": 4, "temperature": 0.0}
    )
    assert chat["prompt_token_ids"] == tok.apply_chat_template(parse_messages({"messages": turns}), tools=tools)
    assert chat["choices"][0]["message"]["role"] == "assistant"


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


@pytest.mark.timeout(1800)  # a second vLLM start: minutes on a loaded 2-core machine
def test_router_in_front_of_two_vllm_servers_survives_one_killed(server: str, tmp_path: Path) -> None:
    """arbor's router over the module's server and a second one: requests go to both; once the second is killed
    (its proxy SIGKILLed, vLLM then dies with it) every request still answers (retried on the survivor), the dead
    one is ejected, and an admin fan-out reports it as unreachable while the survivor takes the call.

    The second server serves test_vllm_padding's padding-heavy `qwen3-tiny` (one vLLM start for both claims), and
    before the router test that module's claim is checked on it: vLLM never samples or decodes a padding row of
    the head, and reports the tempered logprobs renormalised over the tokenizer's ids
    (test_vllm_padding.check_never_samples_a_padding_row)."""
    body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    procs: list = []
    _, padding_heavy, padding_logits = serve_padding_heavy_model(tmp_path)
    with vllm_server(tmp_path, padding_heavy, SEQ_LEN, procs=procs) as second:
        check_never_samples_a_padding_row(second, padding_logits)

        async def go() -> None:
            router = Router([server, second], RouterConfig(policy="round_robin", health_interval=0.5, eject_after=1))
            runner, url = await start_site(router.app(), "127.0.0.1", 0)
            try:
                async with aiohttp.ClientSession() as s:
                    for _ in range(4):
                        async with s.post(url + "/v1/completions", json=body) as r:
                            assert r.status == 200 and len((await r.json())["choices"][0]["token_ids"]) == 6
                    assert [b.requests for b in router.backends] == [2, 2]
                    vllm_pids = children(procs[0].pid)  # vLLM's server: its own session, out of the group
                    assert vllm_pids
                    os.killpg(procs[0].pid, signal.SIGKILL)
                    procs[0].wait(timeout=60)
                    for _ in range(4):
                        async with s.post(url + "/v1/completions", json=body) as r:
                            assert r.status == 200 and len((await r.json())["choices"][0]["token_ids"]) == 6
                    assert not router.backends[1].healthy and router.ejections >= 1
                    assert router.backends[0].healthy
                    async with s.post(url + "/resume", json={}) as r:  # admin fan-out: the dead one is reported
                        results = (await r.json())["results"]
                    assert results[router.backends[0].url]["status"] == 200
                    assert results[router.backends[1].url]["status"] != 200
                    deadline = time.monotonic() + 120  # vLLM dies with its proxy (arbor.orphans)
                    while any(alive(p) for p in vllm_pids) and time.monotonic() < deadline:
                        await asyncio.sleep(0.5)
                    assert not any(alive(p) for p in vllm_pids)
            finally:
                await runner.cleanup()

        asyncio.run(go())


def test_fuzzed_requests_get_arbors_error_shape_and_never_kill_vllm(server: str) -> None:
    """The local engine's fuzz (tests/fuzz_requests.py) through the vLLM proxy: malformed JSON, deep nesting, bad
    gzip, surrogates, NaN, huge numbers, token ids past the vocabulary, unknown routes. Every refusal is a 4xx in
    arbor's JSON error shape (vLLM's own refusals relayed, FastAPI's 404 rewrapped), and vLLM still serves."""
    rng = random.Random(7)
    chat = [{"role": "user", "content": "hi"}]
    valid = {
        "/v1/completions": {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0},
        "/v1/chat/completions": {"messages": chat, "max_tokens": 2},
        "/abort_requests": {"request_ids": ["nobody"]},
        "/resume": {},
        "/no/such/route": {},
    }
    requests = [(path, *malformed(rng, valid[path])) for path in (rng.choice(list(valid)) for _ in range(240))]
    requests.append(("/v1/completions", b'{"prompt": [1000000000], "max_tokens": 2}', {}))  # vLLM: 500, code 400

    async def go() -> list[tuple[int, object]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            return [await send(s, server + path, body, headers) for path, body, headers in requests]

    results = asyncio.run(go())
    for (path, body, headers), (status, data) in zip(requests, results):
        check_answer(status, data, (path, body[:100], headers))
    assert results[-1][0] == 400 and "out of vocabulary" in results[-1][1]["error"]["message"]
    assert sum(400 <= s < 500 for s, _ in results) > 150
    out = post_json(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 3, "n": 2, "temperature": 1.0})
    assert [len(c["token_ids"]) for c in out["choices"]] == [3, 3]
