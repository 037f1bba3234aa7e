"""The built-in router against trivial aiohttp backends: policies, failover, ejection and re-admission, fan-out."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from arbor.config.inference import RouterConfig
from arbor.inference.router.app import Router, rendezvous, session_key
from arbor.transport.http import start_site
from arbor.transport.router_wire import parse_router_metrics, vllm_router_argv


class FakeBackend:
    """Answers completions with its own name; can fail with 500, be slowed, or be stopped and restarted."""

    def __init__(self, name: str) -> None:
        self.name, self.fail_status, self.delay = name, 0, 0.0
        self.admin_fail_status = 0  # answered to admin calls instead of applying them
        self.adapters: dict[str, int] = {}
        self.seen: list[dict[str, Any]] = []
        self.admin: list[tuple[str, dict[str, Any]]] = []
        self.version = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()

        async def complete(request: web.Request) -> web.Response:
            body = await request.json()
            self.seen.append(body)
            await asyncio.sleep(self.delay)
            if self.fail_status:
                return web.json_response({"error": {"message": "boom"}}, status=self.fail_status)
            choice = {
                "index": 0,
                "token_ids": [7],
                "logprobs": {"token_logprobs": [-0.1]},
                "policy_versions": [self.version],
            }
            return web.json_response({"backend": self.name, "echo": body, "choices": [choice]})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "policy_version": self.version})

        async def update(request: web.Request) -> web.Response:
            body = await request.json()
            self.admin.append((request.path, body))
            if self.admin_fail_status:
                return web.json_response({"error": {"message": "boom"}}, status=self.admin_fail_status)
            if request.path == "/update_weights":
                if body["path"] == "missing":
                    return web.json_response({"error": {"message": "no such dir", "param": "path"}}, status=400)
                if body["version"] < self.version:  # versions only go up, as on arbor's servers
                    return web.json_response({"error": {"message": "older", "param": "version"}}, status=409)
                self.version = body["version"]
                return web.json_response({"policy_version": self.version})
            if request.path == "/v1/load_lora_adapter":  # as arbor's servers (arbor.transport.adapter_admin)
                name, current = body["lora_name"], self.adapters.get(body["lora_name"])
                if current is not None and not body.get("load_inplace"):
                    return web.json_response({"error": {"message": "loaded", "param": "lora_name"}}, status=400)
                version = body.get("version", 0 if current is None else current + 1)
                if current is not None and version < current:
                    return web.json_response({"error": {"message": "older", "param": "version"}}, status=409)
                self.adapters[name] = version
                return web.json_response({"lora_name": name, "version": version})
            return web.json_response({"paused": request.path == "/pause"})

        app.add_routes(
            [
                web.post("/v1/completions", complete),
                web.post("/v1/chat/completions", complete),
                web.get("/health", health),
                web.post("/update_weights", update),
                web.post("/pause", update),
                web.post("/resume", update),
                web.post("/v1/load_lora_adapter", update),
            ]
        )
        return app

    async def start(self) -> str:
        self.runner, url = await start_site(self.app(), "127.0.0.1", self.port)
        self.port = int(url.rsplit(":", 1)[1])
        return url

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def _fleet(n: int, **cfg: Any):
    backends = [FakeBackend(f"b{i}") for i in range(n)]
    urls = [await b.start() for b in backends]
    router = Router(urls, RouterConfig(health_interval=0.05, **cfg))
    runner, url = await start_site(router.app(), "127.0.0.1", 0)
    return backends, router, runner, url


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None):
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_round_robin_and_least_outstanding() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2, policy="round_robin")
        async with aiohttp.ClientSession() as s:
            names = [(await _post(s, url + "/v1/completions", {"prompt": [1]}))[1]["backend"] for _ in range(6)]
            assert sorted(names) == ["b0"] * 3 + ["b1"] * 3 and names[0] != names[1]
            router.cfg.policy = "least_outstanding"
            backends[0].delay = 0.5  # b0 stays busy with the first request, so the next five all go to b1
            first = asyncio.create_task(_post(s, url + "/v1/completions", {"prompt": [1]}))
            await asyncio.sleep(0.1)
            rest = [(await _post(s, url + "/v1/completions", {"prompt": [2]}))[1]["backend"] for _ in range(5)]
            busy = (await first)[1]["backend"]
            assert rest == [{"b0": "b1", "b1": "b0"}[busy]] * 5
        await runner.cleanup()
        for b in backends:
            await b.stop()

    asyncio.run(go())


def test_consistent_hash_keeps_every_turn_of_50_sessions_on_one_backend() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2, policy="consistent_hash")
        placed: dict[str, set[str]] = {}
        async with aiohttp.ClientSession() as s:
            for turn in range(3):
                for i in range(50):
                    sid = f"session-{i}"
                    if i % 3 == 0:
                        status, data = await _post(
                            s,
                            url + "/v1/chat/completions",
                            {"messages": [], "turn": turn},
                            headers={"X-Session-Id": sid},
                        )
                    elif i % 3 == 1:
                        status, data = await _post(s, url + "/v1/completions", {"session_id": sid, "turn": turn})
                    else:
                        status, data = await _post(s, url + "/v1/completions", {"user": sid, "turn": turn})
                    assert status == 200
                    placed.setdefault(sid, set()).add(data["backend"])
        assert all(len(v) == 1 for v in placed.values()), placed
        counts = [sum(v == {b.name} for v in placed.values()) for b in backends]
        assert min(counts) >= 10, counts  # the hash spreads sessions over both backends
        await runner.cleanup()
        for b in backends:
            await b.stop()

    asyncio.run(go())


def test_rendezvous_moves_only_the_lost_backends_sessions() -> None:
    urls = ["http://a", "http://b", "http://c"]
    before = {k: rendezvous(k, urls) for k in map(str, range(300))}
    after = {k: rendezvous(k, urls[:2]) for k in before}
    assert all(after[k] == before[k] for k in before if before[k] != "http://c")
    assert session_key({"X-Session-Id": "h"}, b'{"user": "u"}') == "h"
    assert session_key({}, b'{"user": 7}') == "7" and session_key({}, b"not json") is None


def test_failed_request_is_retried_dead_backend_ejected_and_readmitted_with_current_weights() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2, policy="round_robin", eject_after=2)
        async with aiohttp.ClientSession() as s:
            backends[1].fail_status = 500
            for _ in range(4):  # every request succeeds: the 500s are retried on b0
                status, data = await _post(s, url + "/v1/completions", {"prompt": [1]})
                assert status == 200 and data["backend"] == "b0"
            assert router.retries >= 1
            backends[1].fail_status = 0
            await backends[1].stop()  # dies: refused connections eject it at once
            await asyncio.sleep(0.2)
            for _ in range(4):
                status, data = await _post(s, url + "/v1/completions", {"prompt": [1]})
                assert status == 200 and data["backend"] == "b0"
            assert not router.backends[1].healthy and router.ejections >= 1
            # While it is down the fleet moves to version 3; the fan-out reports the dead backend.
            status, data = await _post(s, url + "/update_weights", {"path": "p3", "version": 3})
            assert status == 200 and data["policy_version"] == 3
            assert data["results"][router.backends[1].url]["status"] == 0
            status, data = await _post(s, url + "/update_weights", {"path": "missing", "version": 4})
            assert status == 400  # a bad directory is the caller's error, reported as such
            await backends[1].start()  # restarted on the same port, at version 0
            for _ in range(100):
                if router.backends[1].healthy:
                    break
                await asyncio.sleep(0.05)
            assert router.backends[1].healthy and router.readmissions == 1
            assert backends[1].version == 3, "a re-admitted backend first loads the fleet's current weights"
            names = {(await _post(s, url + "/v1/completions", {"prompt": [1]}))[1]["backend"] for _ in range(4)}
            assert names == {"b0", "b1"}
            async with s.get(url + "/metrics") as r:
                m = parse_router_metrics(await r.text())
            assert m["retries"] == router.retries and m["ejections"] >= 1 and m["readmissions"] == 1
            async with s.get(url + "/health") as r:
                assert (await r.json())["policy_version"] == 3
        await runner.cleanup()
        await backends[0].stop()
        await backends[1].stop()

    asyncio.run(go())


def test_a_versionless_adapter_load_is_replayed_at_the_version_the_backends_took() -> None:
    """A load sent without a version (each backend takes the next one) or `load_inplace` is recorded at the version
    the backends answered, in place. A backend that was only unreachable, its adapter kept, is re-admitted with
    that version unchanged (sent as it came, the replay was refused as a second load and kept it out for good); a
    restarted one, its adapters lost, gets the adapter back at the fleet's version."""

    async def go() -> None:
        backends, router, runner, url = await _fleet(2, policy="round_robin")
        async with aiohttp.ClientSession() as s:
            load = {"lora_name": "a", "lora_path": "/x"}
            status, data = await _post(s, url + "/v1/load_lora_adapter", load)
            assert status == 200 and [b.adapters for b in backends] == [{"a": 0}, {"a": 0}]
            assert router.fleet.adapters["a"] == {**load, "version": 0, "load_inplace": True}
            for restarted in (False, True):
                b = backends[restarted]
                await b.stop()
                if restarted:
                    b.adapters = {}
                for _ in range(100):
                    if not router.backends[restarted].healthy:
                        break
                    await asyncio.sleep(0.05)
                assert not router.backends[restarted].healthy
                await b.start()
                for _ in range(100):
                    if router.backends[restarted].healthy:
                        break
                    await asyncio.sleep(0.05)
                assert router.backends[restarted].healthy, f"re-admitted (restarted: {restarted})"
                assert b.adapters == {"a": 0}, "the fleet's version, neither bumped nor lost"
            assert router.readmissions == 2
        await runner.cleanup()
        for b in backends:
            await b.stop()

    asyncio.run(go())


def test_backend_ahead_of_the_routers_record_is_readmitted_as_it_is() -> None:
    """An update (weights, adapter) whose fan-out failed on one backend is not recorded, though the others
    loaded it. One of those, ejected and back, is past the record: it is re-admitted without a replay of the
    older record (which it would refuse with a 409 every time, staying out of rotation)."""

    async def go() -> None:
        backends, router, runner, url = await _fleet(2, policy="round_robin")
        async with aiohttp.ClientSession() as s:
            assert (await _post(s, url + "/update_weights", {"path": "p1", "version": 1}))[0] == 200
            load = {"lora_name": "a", "lora_path": "/x", "load_inplace": True}
            assert (await _post(s, url + "/v1/load_lora_adapter", {**load, "version": 1}))[0] == 200
            backends[1].admin_fail_status = 500
            assert (await _post(s, url + "/update_weights", {"path": "p2", "version": 2}))[0] == 502
            assert (await _post(s, url + "/v1/load_lora_adapter", {**load, "version": 2}))[0] == 502
            assert router.fleet.last_update["version"] == 1 and router.fleet.adapters["a"]["version"] == 1
            assert backends[0].version == 2 and backends[0].adapters == {"a": 2}
            await backends[0].stop()  # unreachable for a while, its state kept (a network partition)
            for _ in range(100):  # the health checks eject it
                if not router.backends[0].healthy:
                    break
                await asyncio.sleep(0.05)
            assert not router.backends[0].healthy
            sent = len(backends[0].admin)
            await backends[0].start()
            for _ in range(100):
                if router.backends[0].healthy:
                    break
                await asyncio.sleep(0.05)
            assert router.backends[0].healthy and router.readmissions == 1
            assert backends[0].version == 2 and backends[0].adapters == {"a": 2}
            assert [p for p, _ in backends[0].admin[sent:]] == ["/v1/load_lora_adapter"], "no weights replay"
        await runner.cleanup()
        for b in backends:
            await b.stop()

    asyncio.run(go())


def test_admin_fanout_and_all_backends_down() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2)
        async with aiohttp.ClientSession() as s:
            status, data = await _post(s, url + "/pause", {})
            assert status == 200 and all(r["status"] == 200 for r in data["results"].values())
            assert [a[0] for b in backends for a in b.admin] == ["/pause", "/pause"]
            await _post(s, url + "/resume", {})
            for b in backends:
                await b.stop()
            status, data = await _post(s, url + "/v1/completions", {"prompt": [1]})
            assert status == 503 and "no backend" in data["error"]["message"]
            status, data = await _post(s, url + "/resume", {})
            assert status == 503
            await asyncio.sleep(0.3)
            async with s.get(url + "/health") as r:
                assert r.status == 503
        await runner.cleanup()

    asyncio.run(go())


def test_vllm_router_command_line() -> None:
    cfg = RouterConfig(policy="consistent_hash", health_interval=2, eject_after=3, max_retries=1)
    argv = vllm_router_argv(cfg, ["http://a:1", "http://b:2"], 9000)
    assert argv[:6] == ["vllm-router", "--host", "127.0.0.1", "--port", "9000", "--worker-urls"]
    assert argv[6:8] == ["http://a:1", "http://b:2"]
    flags = dict(zip(argv[8::2], argv[9::2]))
    assert flags == {
        "--policy": "consistent_hash",
        "--health-check-interval-secs": "2",
        "--health-check-timeout-secs": "2",
        "--health-failure-threshold": "3",
        "--retry-max-retries": "1",
        "--request-timeout-secs": "600",
    }
    assert vllm_router_argv(RouterConfig(policy="least_outstanding"), ["http://a"], 1)[8] == "power_of_two"
    assert json.dumps(argv)  # plain strings only


def test_vllm_router_is_used_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import arbor.transport.router_wire as router_mod
    from arbor.config.loader import ConfigError

    monkeypatch.setattr(router_mod.shutil, "which", lambda name: None)
    assert router_mod.use_vllm_router(RouterConfig()) is None
    with pytest.raises(ConfigError, match="vllm-router"):
        router_mod.use_vllm_router(RouterConfig(implementation="vllm-router"))
    monkeypatch.setattr(router_mod.shutil, "which", lambda name: f"/opt/bin/{name}")
    assert router_mod.use_vllm_router(RouterConfig()) == "/opt/bin/vllm-router"
    assert router_mod.use_vllm_router(RouterConfig(implementation="builtin")) is None


def test_weight_update_through_the_router_during_generation(tmp_path) -> None:
    """Two local engines behind the router; an update fanned out mid-request: the response's versions switch at
    the update point and every later token is the new weights' greedy choice."""
    import copy

    import torch
    from test_inference import TOK, greedy_reference, make_model, running_engine, slow_down

    from arbor.inference.server import BackgroundServer
    from arbor.models.hf import save_checkpoint_dir

    old = make_model()
    new = copy.deepcopy(old)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    save_checkpoint_dir(new.state_dict(), new.args, tmp_path / "step_1")
    models = [make_model(), make_model()]
    for m in models:
        slow_down(m, 0.003)
    prompt = TOK.encode("update me")
    with (
        running_engine(models[0]) as e0,
        running_engine(models[1]) as e1,
        BackgroundServer(e0, TOK) as s0,
        BackgroundServer(e1, TOK) as s1,
    ):

        async def go() -> dict[str, Any]:
            router = Router([s0.url, s1.url], RouterConfig(health_interval=0.05))
            runner, url = await start_site(router.app(), "127.0.0.1", 0)
            async with aiohttp.ClientSession() as s:
                req = asyncio.create_task(
                    _post(
                        s,
                        url + "/v1/completions",
                        {"prompt": prompt, "max_tokens": 40, "temperature": 0, "logprobs": 0, "return_token_ids": True},
                    )
                )
                while e0.stats().generated_tokens + e1.stats().generated_tokens < 5:
                    await asyncio.sleep(0.001)
                status, data = await _post(s, url + "/update_weights", {"path": str(tmp_path / "step_1"), "version": 1})
                assert status == 200 and data["policy_version"] == 1 and len(data["results"]) == 2
                status, out = await req
                assert status == 200
            await runner.cleanup()
            return out

        out = asyncio.run(go())
        assert e0.version == e1.version == 1
    (c,) = out["choices"]
    v = c["policy_versions"]
    k = v.index(1)
    assert 0 < k < 40 and v == [0] * k + [1] * (40 - k)
    assert c["token_ids"][:k] == greedy_reference(old, prompt, 40)[:k]
    with torch.no_grad():
        logits = new(torch.tensor([prompt + c["token_ids"]]))[0].float()
    assert all(c["token_ids"][j] == int(logits[len(prompt) - 1 + j, : TOK.vocab_size].argmax()) for j in range(k, 40))


def test_orchestrator_drops_groups_whose_in_flight_tokens_are_too_old() -> None:
    """A rollout that straddles a weight update is as old as its oldest token: with max_off_policy_steps = 2 at
    step 5, a group with any version-2 token is dropped (and replaced), one whose oldest token is 3 is kept."""
    from arbor.config.orchestrator import OrchestratorConfig
    from arbor.orchestrator.client import Completion
    from arbor.orchestrator.main import Orchestrator
    from arbor.orchestrator.state import TaskSampler

    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "qwen3-test"},
            "batch_size": 4,
            "group_size": 2,
            "max_off_policy_steps": 2,
            "max_concurrent_groups": 1,
        }
    )
    orch = Orchestrator(cfg)
    orch.source.sampler = TaskSampler(orch.source.tasks, 0, 0, 0)
    versions = iter([[2, 2, 5], [3, 4, 5], [3, 3, 3], [5, 5, 5]])  # group 1 straddles 2 -> 5: too old

    class Client:
        async def generate(self, prompt_ids, n, *args, **kwargs):
            v = next(versions)
            return [Completion([65, 66, 67], [-0.1] * 3, v, "abc", "length") for _ in range(n)]

    fleet = types.SimpleNamespace(loaded_version=5, changed=asyncio.Event())  # the weight sync: version 5 served
    groups = asyncio.run(orch.assembler.collect(5, Client(), fleet))
    assert [g[0].policy_versions for g in groups] == [[3, 4, 5], [3, 3, 3]]
    assert orch.counts.dropped_stale == 2


def test_client_sends_the_cache_salt_and_admin_calls_to_admin_urls() -> None:
    """With a router lacking admin routes (vllm-router), weight updates go to every backend directly, and each
    generation carries the salt of the newest version the fleet was told to load."""
    from arbor.orchestrator.client import InferenceClient

    async def go() -> None:
        backends = [FakeBackend("b0"), FakeBackend("b1")]
        urls = [await b.start() for b in backends]
        async with InferenceClient([urls[0]], timeout=10, max_retries=0, admin_urls=urls) as client:
            await client.generate([1, 2], 1, 4, 1.0, 1.0)
            assert backends[0].seen[-1]["cache_salt"] == "policy-0"
            await client.update_weights("/w/step_2", 2)
            assert [b.version for b in backends] == [2, 2]
            (c,) = await client.generate([1, 2], 1, 4, 1.0, 1.0)
            assert backends[0].seen[-1]["cache_salt"] == "policy-2" and c.policy_versions == [2]
            assert await client.router_stats() == {}  # a plain server has no router counters
        for b in backends:
            await b.stop()

    asyncio.run(go())
