"""Partial rollouts: abort with partial output (engine, server, router), the resumable GroupHandle, and the
orchestrator's oversampling / parking / straggler moves on scripted fake fleets."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from test_inference import (
    TOK,
    greedy_reference,
    http,
    make_model,
    reference_logprobs,  # noqa: F401
    running_engine,
    server,
    slow_down,
    wait_until,
)

from arbor.inference.engine.params import SamplingParams
from arbor.models.hf import save_checkpoint_dir
from arbor.orchestrator.client import Completion, InferenceClient
from arbor.orchestrator.partial import PartialRollouts


def test_engine_abort_returns_exact_partial_output() -> None:
    model, ref = make_model(), make_model()
    prompt = TOK.encode("abort me")
    slow_down(model, 0.003)
    with running_engine(model) as engine:
        assert engine.abort(["never-sent"]).result(timeout=60) == 0
        late = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0), "never-sent")
        assert late.result(timeout=5).completions[0].finish_reason == "abort"  # aborted before it arrived
        fut = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, n=2), "r1")
        other = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0), "r2")
        wait_until(lambda: engine.stats().generated_tokens >= 8)
        assert engine.abort(["r1"]).result(timeout=60) == 1
        out = fut.result(timeout=60)
        assert other.result(timeout=60).completions[0].finish_reason == "length"  # untouched
        assert engine.stats().running == 0
    full = greedy_reference(ref, prompt, 40)
    for c in out.completions:
        k = len(c.token_ids)
        assert c.finish_reason == "abort" and 0 < k < 40
        assert c.token_ids == full[:k] and c.policy_versions == [0] * k
        _, lp = reference_logprobs(ref, prompt, c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=1e-5, rtol=0)


def _abort_when(url: str, engine, ids: Any, tokens: int) -> threading.Thread:
    def go() -> None:
        wait_until(lambda: engine.stats().generated_tokens >= tokens)
        assert http(url + "/abort_requests", {"request_ids": ids})[0] == 200

    t = threading.Thread(target=go)
    t.start()
    return t


def test_server_abort_and_resumed_generation_equals_uninterrupted(tmp_path: Path) -> None:
    """Over HTTP: an aborted request answers its partial tokens; the GroupHandle resumes it, and at temperature 0
    the joined completion is the uninterrupted one; across a weight update the versions split where it resumed."""
    model, ref = make_model(), make_model()
    new = copy.deepcopy(ref)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    save_checkpoint_dir(new.state_dict(), new.args, tmp_path / "step_1")
    prompt = TOK.encode("resume me")
    full = greedy_reference(ref, prompt, 40)
    slow_down(model, 0.003)
    with server(model) as (url, engine):
        assert http(url + "/abort_requests", {"request_ids": 3})[0] == 400
        t = _abort_when(url, engine, ["x1"], 5)
        status, data = http(
            url + "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": 40,
                "temperature": 0,
                "logprobs": 0,
                "return_token_ids": True,
                "request_id": "x1",
            },
        )
        t.join()
        (c,) = data["choices"]
        k = len(c["token_ids"])
        assert status == 200 and c["finish_reason"] == "abort" and 0 < k < 40 and c["token_ids"] == full[:k]
        assert c["policy_versions"] == [0] * k and len(c["logprobs"]["token_logprobs"]) == k

        async def run(update: bool) -> tuple[Completion, int]:
            async with InferenceClient([url], timeout=60, max_retries=0) as client:
                ctl = PartialRollouts(client, TOK.decode)
                h = ctl.handle("g")
                job = asyncio.create_task(h.generate(prompt, 1, 40, 0.0, 1.0, 0))
                while engine.stats().generated_tokens < before + 6:
                    await asyncio.sleep(0.002)
                await ctl.abort([h])
                await asyncio.sleep(0.2)
                assert not job.done() and h.parked  # parked: the caller is still suspended
                if update:
                    await client.update_weights(str(tmp_path / "step_1"), 1)
                h.resume()
                (out,) = await job
                return out, h.resumes

        before = engine.stats().generated_tokens
        same, resumes = asyncio.run(run(update=False))
        assert same.pieces == 2 and resumes == 1
        assert same.token_ids == full and same.finish_reason == "length" and same.text == TOK.decode(full)
        _, lp = reference_logprobs(ref, prompt, full)
        torch.testing.assert_close(torch.tensor(same.logprobs), lp, atol=1e-5, rtol=0)
        before = engine.stats().generated_tokens
        moved, _ = asyncio.run(run(update=True))
    v = moved.policy_versions
    k = v.index(1)
    assert moved.pieces == 2 and 0 < k < 40 and v == [0] * k + [1] * (40 - k)
    assert moved.token_ids[:k] == full[:k]
    with torch.no_grad():
        logits = new(torch.tensor([prompt + moved.token_ids]))[0].float()
    assert all(moved.token_ids[j] == int(logits[len(prompt) - 1 + j, : TOK.vocab_size].argmax()) for j in range(k, 40))
    _, lp_new = reference_logprobs(new, prompt, moved.token_ids)
    torch.testing.assert_close(torch.tensor(moved.logprobs[k:]), lp_new[k:], atol=1e-5, rtol=0)


def test_router_fans_abort_out_to_every_backend() -> None:
    from test_router import FakeBackend, _post

    from arbor.config.inference import RouterConfig
    from arbor.inference.router.app import Router
    from arbor.transport.http import start_site

    async def go() -> None:
        import aiohttp
        from aiohttp import web

        backends = [FakeBackend("b0"), FakeBackend("b1")]
        for b in backends:
            app = b.app

            def with_abort(b=b, app=app) -> web.Application:
                a = app()

                async def abort(request: web.Request) -> web.Response:
                    b.admin.append((request.path, await request.json()))
                    return web.json_response({"aborted": 1})

                a.router.add_post("/abort_requests", abort)
                return a

            b.app = with_abort
        urls = [await b.start() for b in backends]
        router = Router(urls, RouterConfig(health_interval=0.05))
        runner, url = await start_site(router.app(), "127.0.0.1", 0)
        async with aiohttp.ClientSession() as s:
            status, data = await _post(s, url + "/abort_requests", {"request_ids": ["a", "b"]})
            assert status == 200 and len(data["results"]) == 2
        async with InferenceClient([url], timeout=10, max_retries=0) as client:
            await client.abort_requests(None)
        for b in backends:  # every backend got both aborts, in order
            assert b.admin == [
                ("/abort_requests", {"request_ids": ["a", "b"]}),
                ("/abort_requests", {"request_ids": "all"}),
            ]
        await runner.cleanup()
        for b in backends:
            await b.stop()

    asyncio.run(go())


# ---- the orchestrator on a scripted fleet ----


class ScriptedFleet:
    """A fake InferenceClient: a group whose seed is in `slow` generates one token and then waits until it is
    aborted; every other request (and every continuation) finishes at once with 3 tokens at the fleet's version."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.slow: set[int] = set()
        self.hold: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.calls: list[tuple[int, int, str]] = []  # (prompt length, max_tokens, request id)

    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, request_id=None):
        self.calls.append((len(prompt_ids), max_tokens, request_id))
        if seed in self.slow and request_id not in self.aborted:
            version = self.version  # its one token is sampled now, before the wait
            self.hold[request_id] = ev = asyncio.Event()
            await ev.wait()
            return [Completion([70], [-0.5], [version], "F", "abort") for _ in range(n)]
        return [
            Completion([65, 66, 67][:max_tokens], [-0.1] * 3, [self.version] * 3, "abc", "length") for _ in range(n)
        ]

    async def abort_requests(self, ids):
        for rid in ids:
            self.aborted.append(rid)
            if rid in self.hold:
                self.hold.pop(rid).set()


def _orchestrator(**over: Any):
    from arbor.config.orchestrator import OrchestratorConfig
    from arbor.orchestrator.main import Orchestrator
    from arbor.orchestrator.state import TaskSampler

    cfg = OrchestratorConfig.model_validate(
        {"model": {"name": "qwen3-test"}, "batch_size": 4, "group_size": 2, "sampling": {"max_tokens": 8}, **over}
    )
    orch = Orchestrator(cfg)
    orch.source.sampler = TaskSampler(orch.source.tasks, 0, 0, 0)
    return orch


def _seed(orch, step: int, k: int) -> int:
    import zlib

    return zlib.crc32(f"{orch.cfg.seed}/{step}/{k}".encode()) & 0x7FFFFFFF


@pytest.mark.parametrize("partial", [False, True])
def test_oversampling_cancels_or_parks_the_surplus(partial: bool) -> None:
    orch = _orchestrator(scheduler={"mode": "one_step_off", "oversample": 2.0}, partial={"enabled": partial})
    fleet = ScriptedFleet()
    fleet.slow = {_seed(orch, 0, 2), _seed(orch, 0, 3)}  # 4 launched for 2 needed: the last two straggle
    weights = types.SimpleNamespace(loaded_version=0, changed=asyncio.Event())

    async def go():
        first = await orch.assembler.collect(0, fleet, weights)
        figures0 = orch.figures.partial(first)
        await asyncio.sleep(0.05)
        fleet.slow = {_seed(orch, 1, 0), _seed(orch, 1, 1)}  # step 1's new groups straggle: the resumed win
        second = await orch.assembler.collect(1, fleet, weights)
        return first, figures0, second, orch.figures.partial(second)

    first, f0, second, f1 = asyncio.run(go())
    assert len(first) == len(second) == 2 and all(len(r.completion_ids) == 3 for g in first for r in g)
    if not partial:
        assert f0["partial/cancelled"] == 2 and f0["partial/parked"] == 0
        assert not any(r.pieces > 1 for g in second for r in g)
        assert not orch.pool.flights  # nothing left running after a cancel
        assert f1["partial/cancelled"] == 2
    else:  # parked at step 0, resumed first at step 1: one token from the first piece, the rest from the second
        assert f0["partial/parked"] == 2 and f0["partial/aborted"] == 2 and f0["partial/cancelled"] == 0
        assert f1["partial/resumed"] == 2 and f1["partial/resumed_groups"] == 2 and f1["partial/resumed_rollouts"] == 4
        assert f1["partial/parked"] == 2
        assert all(r.completion_ids == [70, 65, 66, 67] and r.pieces == 2 for g in second for r in g)
        assert [m for _, m, _ in fleet.calls if m != 8] == [7] * 4  # one per sample: the kept token, 7 left


def test_windowed_fifo_head_advances_past_an_aborted_straggler() -> None:
    """Continuous, W = 1 (async: strict FIFO): group 0 hangs at the head. Once it has run longer than
    straggler_factor x the median of recent group durations, it is aborted, leaves the head (which advances),
    and is relaunched at the tail, keeping its first token; the batches fill with the groups behind it, and it
    is trained later, whole, in two pieces."""
    orch = _orchestrator(
        scheduler={"mode": "async", "max_in_flight": 6},
        max_off_policy_steps=1,
        partial={"enabled": True, "straggler_factor": 2.0},
    )
    fleet = ScriptedFleet()
    fleet.slow = {_seed(orch, 0, 0)}
    orch.pool.parking.durations.extend([0.01] * 8)  # the rule is armed: a straggler is a group running over 0.02s
    weights = types.SimpleNamespace(loaded_version=0, changed=asyncio.Event())

    async def go():
        t0 = time.monotonic()
        batches = []
        for step in range(3):
            weights.loaded_version = fleet.version = step  # the trainer keeps up: version = step
            batches.append(await orch.assembler.collect(step, fleet, weights))
        return batches, time.monotonic() - t0

    batches, seconds = asyncio.run(go())
    ids = [[g[0].group_id for g in b] for b in batches]
    assert ids[0] == [1, 2] and seconds < 10, ids  # the head moved past group 0 instead of waiting for it
    assert orch.counts.partial["moved"] == 1 and len(fleet.aborted) == 1, ids
    (late,) = [g for b in batches for g in b if g[0].group_id == 0]
    assert all(r.pieces == 2 and r.completion_ids == [70, 65, 66, 67] for r in late)
    # its first token is from version 0, the continuation from whatever the fleet served when it ran; within bound
    assert late[0].policy_versions[0] == 0 and orch.counts.dropped_stale == 0


@pytest.mark.parametrize("max_resumes", [1, 0])
def test_straggler_retry_relaunches_its_task_as_a_new_group(max_resumes: int) -> None:
    """straggler_action = "retry", strict FIFO: group 0 hangs at the head. Once it straggles it is cancelled (its
    one generated token is thrown away) and its task is launched again as a new group at the tail, with a new
    sampling seed: it is trained later, in one piece, with staleness counted from the retry. With max_resumes 0
    the task is given up instead."""
    orch = _orchestrator(
        scheduler={"mode": "async", "max_in_flight": 6},
        max_off_policy_steps=1,
        partial={"enabled": True, "straggler_factor": 2.0, "straggler_action": "retry", "max_resumes": max_resumes},
    )
    fleet = ScriptedFleet()
    fleet.slow = {_seed(orch, 0, 0)}
    orch.pool.parking.durations.extend([0.01] * 8)
    weights = types.SimpleNamespace(loaded_version=0, changed=asyncio.Event())
    task_of: dict[int, Any] = {}
    next_spec = orch.source.next_spec

    def recording(step: int, k: int):
        spec = next_spec(step, k)
        task_of[spec.group_id] = spec.task
        return spec

    orch.source.next_spec = recording

    async def go():
        batches = []
        for step in range(3):
            weights.loaded_version = fleet.version = step
            batches.append(await orch.assembler.collect(step, fleet, weights))
        await asyncio.sleep(0.01)  # let the cancelled group's callbacks run
        return batches

    batches = asyncio.run(go())
    groups = [g for b in batches for g in b]
    ids = [g[0].group_id for g in groups]
    assert ids[:2] == [1, 2] and 0 not in ids and len(fleet.aborted) == 1, ids
    assert all(r.pieces == 1 and r.completion_ids == [65, 66, 67] for g in groups for r in g)  # nothing resumed
    retried = [g for g in groups if task_of[g[0].group_id] is task_of[0]]
    if max_resumes:
        assert orch.counts.partial["retried"] == 1 and orch.counts.partial["given_up"] == 0
        (late,) = retried
        assert late[0].group_id > 2 and all(r.policy_versions == [late[0].policy_versions[0]] * 3 for r in late)
    else:
        assert orch.counts.partial["given_up"] == 1 and orch.counts.partial["retried"] == 0 and not retried
    assert orch.counts.partial["moved"] == 0 and orch.counts.dropped_stale == 0 and 0 not in orch.pool.flights


@pytest.mark.parametrize("mode, launched", [("greedy", 6), ("windowed_fifo", 4)])
def test_windowed_fifo_admission_keeps_the_window_slack(mode: str, launched: int) -> None:
    """max_off_policy_steps 2, two groups per step, W = 1: a group can be overtaken into the next step, so
    windowed FIFO launches only 2 - 1 steps ahead (4 groups: this step's and the next's) where greedy fills the
    whole bound (6)."""
    orch = _orchestrator(scheduler={"mode": mode, "max_in_flight": 20})
    fleet = ScriptedFleet()
    weights = types.SimpleNamespace(loaded_version=0, changed=asyncio.Event())
    assert len(asyncio.run(orch.assembler.collect(0, fleet, weights))) == 2
    assert orch.source.groups_launched == launched


def test_vllm_proxy_abort_hangs_up_upstream_and_answers_partial_output() -> None:
    import aiohttp
    from test_vllm_adapter import FakeVLLM

    from arbor.config.inference import InferenceConfig
    from arbor.inference.vllm.proxy import VLLMProxy
    from arbor.transport.http import start_site

    async def go() -> None:
        fake = FakeVLLM()  # streams 3 tokens, then waits for `tick` (never set here)
        up_runner, up = await start_site(fake.app(), "127.0.0.1", 0)
        runner, url = await start_site(
            VLLMProxy(up, InferenceConfig.model_validate({"backend": "vllm"})).app(), "127.0.0.1", 0
        )
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [1, 2], "max_tokens": 6, "logprobs": 0, "request_id": "r1"}
            pending = asyncio.create_task(s.post(url + "/v1/completions", json=body))
            while not fake.requests:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            async with s.post(url + "/abort_requests", json={"request_ids": ["r1", "later"]}) as r:
                assert (await r.json())["aborted"] == 1
            async with await pending as r:
                (c,) = (await r.json())["choices"]
            assert c["finish_reason"] == "abort" and c["token_ids"] == [10, 11, 12]
            assert c["logprobs"]["token_logprobs"] == [0.0, -0.5, -1.0] and c["policy_versions"] == [0, 0, 0]
            assert fake.requests[0]["request_id"] == "r1"
            async with s.post(url + "/v1/completions", json={**body, "request_id": "later", "n": 2}) as r:
                data = await r.json()
            assert [(c["finish_reason"], c["token_ids"]) for c in data["choices"]] == [("abort", [])] * 2
            assert len(fake.requests) == 1  # never sent upstream
        await runner.cleanup()
        await up_runner.cleanup()

    asyncio.run(go())


@pytest.mark.slow
def test_rl_run_with_oversampling_and_partial_rollouts(tmp_path: Path) -> None:
    from test_rl_e2e import _finish, _rl

    from arbor.monitor.metrics import read_jsonl

    out = tmp_path / "run"
    rc, stdout, stderr = _finish(
        _rl(
            out,
            "--max-steps",
            "4",
            "--orchestrator.scheduler.mode",
            "one_step_off",
            "--orchestrator.scheduler.oversample",
            "2.0",
            "--orchestrator.partial.enabled",
            "true",
            "--orchestrator.partial.abort-on-weight-update",
            "true",
        )
    )
    assert rc == 0, stderr + stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["partial/parked"] for r in rows) > 0 and sum(r["partial/aborted"] for r in rows) > 0
    assert sum(r["partial/resumed"] for r in rows) > 0
    assert all(r["staleness/max"] <= 2 for r in rows)


def test_resume_relaunches_tasks_that_were_in_flight(tmp_path: Path) -> None:
    """Continuous mode: the state saved after a step lists the tasks launched but not in a batch; a resumed
    orchestrator launches exactly those first, then continues the dataset where it was."""
    from arbor.orchestrator.state import OrchestratorState, load_state, save_state

    orch = _orchestrator(scheduler={"mode": "windowed_fifo", "max_in_flight": 5})
    fleet = ScriptedFleet()
    fleet.slow = {_seed(orch, 0, k) for k in (2, 4)}  # two groups never finish before the "crash"
    weights = types.SimpleNamespace(loaded_version=0, changed=asyncio.Event())

    async def step0() -> list[int]:
        await orch.assembler.collect(0, fleet, weights)
        return orch.source.pending()  # as _step saves it, while the groups still run

    pending = asyncio.run(step0())
    assert len(pending) == orch.source.groups_launched - 2 and len(pending) >= 2
    sampler = orch.source.sampler
    save_state(tmp_path, OrchestratorState(1, sampler.epoch, sampler.position, None, pending))
    state = load_state(tmp_path, 1)
    resumed = _orchestrator(scheduler={"mode": "windowed_fifo", "max_in_flight": 5})
    from arbor.orchestrator.state import TaskSampler

    resumed.source.sampler = TaskSampler(resumed.source.tasks, 0, state.epoch, state.position)
    resumed.source.relaunch.extend(resumed.source.tasks[i] for i in state.pending)
    first = [resumed.source.tasks.index(resumed.source.next_spec(1, k).task) for k in range(len(pending) + 1)]
    assert first[:-1] == pending
    assert resumed.source.tasks[first[-1]] == sampler.next()  # then the dataset goes on from the saved position


def test_partial_rollouts_are_refused_for_black_box_agents():
    """Black-box agents drive their own generation through the gateway: parking them is refused at config time."""
    import pydantic

    from arbor.config.orchestrator import OrchestratorConfig

    with pytest.raises(pydantic.ValidationError, match="partial.enabled cannot be used"):
        OrchestratorConfig(partial={"enabled": True}, environment={"id": "black_box", "args": {"command": "agent"}})
