"""Several runs on one fleet: fair sharing by weight, run registration and scoped admin tokens in the router,
per-run figures in /metrics, the client's adapter mode, and the `fleet` / `rl --fleet` configs."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr

from arbor.config.fleet import FleetConfig
from arbor.config.inference import RouterConfig
from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.config.sft import SFTConfig
from arbor.inference.router.app import Router
from arbor.inference.router.tenants import FairShare, Meter, Tenants
from arbor.launch.on_fleet import resolve_on_fleet
from arbor.orchestrator.client import InferenceClient, InferenceError
from arbor.transport.http import start_site
from arbor.transport.router_wire import RUN_HEADER, parse_router_metrics, parse_run_metrics

FLEET_TOKEN = "fleet-secret"


async def _grants(share: FairShare, tenants: Tenants, plan: list[str], releases: int) -> list[str]:
    """Queues one single-slot request per name in `plan` behind a held slot, then frees slots one at a time;
    returns the order in which the runs got them."""
    order: list[str] = []
    blocker = tenants.runs[""]
    await share.acquire(blocker, 1)

    async def one(name: str) -> None:
        await share.acquire(tenants.runs[name], 1)
        order.append(name)

    tasks = [asyncio.create_task(one(n)) for n in plan]
    await asyncio.sleep(0)
    share.release(blocker, 1)
    for _ in range(releases):
        await asyncio.sleep(0)
        run = tenants.runs[order[-1]]
        share.release(run, 1)
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return order


def test_saturated_runs_share_slots_by_weight_and_a_light_run_is_not_starved() -> None:
    async def go() -> None:
        tenants = Tenants()
        tenants.register({"run": "a", "weight": 2})
        tenants.register({"run": "b", "weight": 1})
        share = FairShare(tenants, Meter(), lambda: 1)
        order = await _grants(share, tenants, ["a"] * 60 + ["b"] * 60, 59)
        assert len(order) == 60
        assert order.count("a") == 40 and order.count("b") == 20, order

        tenants = Tenants()
        tenants.register({"run": "a", "weight": 2})
        tenants.register({"run": "light"})
        share = FairShare(tenants, Meter(), lambda: 1)
        order = await _grants(share, tenants, ["a"] * 40 + ["light"], 5)
        assert "light" in order[:3], order  # its one request goes within a round, not after a's forty

    asyncio.run(go())


def test_a_paused_run_waits_while_the_others_go_on() -> None:
    async def go() -> None:
        tenants = Tenants()
        a, b = tenants.register({"run": "a"}), tenants.register({"run": "b"})
        share = FairShare(tenants, Meter(), lambda: 4)
        a.paused = True
        waiting = asyncio.create_task(share.acquire(a, 1))
        await share.acquire(b, 1)  # b is not held up behind a's queue
        await asyncio.sleep(0.01)
        assert not waiting.done() and len(a.queue) == 1
        a.paused = False
        share.dispatch()
        await asyncio.wait_for(waiting, 1)
        assert a.in_flight == 1 and b.in_flight == 1 and share.in_flight == 2

    asyncio.run(go())


class AdapterBackend:
    """A backend that speaks the dynamic-LoRA routes: completions answer with the adapter named by `model` (if
    loaded) and its version per token, and a usage block."""

    def __init__(self) -> None:
        self.adapters: dict[str, int] = {}
        self.admin: list[tuple[str, dict[str, Any]]] = []
        self.delay = 0.0
        self.mix_up: str | None = None
        """When set: answers as if this adapter had generated every choice (a fleet that mixed adapters up)."""
        self.runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        async def complete(request: web.Request) -> web.Response:
            body = await request.json()
            await asyncio.sleep(self.delay)
            model = body.get("model")
            adapter = self.mix_up or (model if model in self.adapters else None)
            n = body.get("n", 1)
            version = self.adapters.get(adapter, 0) if adapter else 0
            choices = [
                {
                    "index": i,
                    "token_ids": [5, 6],
                    "logprobs": {"token_logprobs": [-0.1, -0.2]},
                    "policy_versions": [version, version],
                    "adapter": adapter,
                }
                for i in range(n)
            ]
            return web.json_response(
                {"choices": choices, "usage": {"prompt_tokens": 3 * n, "completion_tokens": 2 * n}}
            )

        async def admin(request: web.Request) -> web.Response:
            body = await request.json()
            self.admin.append((request.path, body))
            if request.path == "/v1/load_lora_adapter":
                self.adapters[body["lora_name"]] = body["version"]
            elif request.path == "/v1/unload_lora_adapter":
                self.adapters.pop(body["lora_name"], None)
            return web.json_response({"ok": True, "lora_name": body.get("lora_name")})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "policy_version": 0})

        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", complete),
                web.get("/health", health),
                *[
                    web.post(p, admin)
                    for p in (
                        "/v1/load_lora_adapter",
                        "/v1/unload_lora_adapter",
                        "/abort_requests",
                        "/update_weights",
                        "/pause",
                        "/resume",
                    )
                ],
            ]
        )
        return app

    async def start(self) -> str:
        self.runner, url = await start_site(self.app(), "127.0.0.1", 0)
        return url


async def _fleet(n: int, **cfg: Any) -> tuple[list[AdapterBackend], Router, web.AppRunner, str]:
    backends = [AdapterBackend() for _ in range(n)]
    urls = [await b.start() for b in backends]
    router = Router(urls, RouterConfig(health_interval=0.05, admin_token=SecretStr(FLEET_TOKEN), **cfg))
    runner, url = await start_site(router.app(), "127.0.0.1", 0)
    return backends, router, runner, url


async def _close(backends: list[AdapterBackend], runner: web.AppRunner) -> None:
    await runner.cleanup()
    for b in backends:
        assert b.runner is not None
        await b.runner.cleanup()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _post(
    s: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    async with s.post(url, json=body, headers={**(_auth(token) if token else {}), **(headers or {})}) as r:
        return r.status, await r.json(content_type=None)


def test_runs_register_and_their_tokens_reach_only_their_own_adapter_queue_and_requests() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2, backend_slots=4)
        async with aiohttp.ClientSession() as s:
            assert (await _post(s, url + "/runs/register", {"run": "a"}))[0] == 401
            status, a = await _post(s, url + "/runs/register", {"run": "a", "weight": 2}, FLEET_TOKEN)
            assert status == 200 and a["slots"] == 8
            _, b = await _post(s, url + "/runs/register", {"run": "b"}, FLEET_TOKEN)
            assert (await _post(s, url + "/runs/register", {"run": "b"}, FLEET_TOKEN))[0] == 409
            assert (await _post(s, url + "/runs/register", {"run": "c"}, a["token"]))[0] == 403

            load = {"lora_name": "a", "lora_path": "/x/a", "load_inplace": True, "version": 1}
            assert (await _post(s, url + "/v1/load_lora_adapter", load, a["token"]))[0] == 200
            assert all(be.adapters == {"a": 1} for be in backends)
            for path, body in [
                ("/v1/load_lora_adapter", {**load, "version": 2}),
                ("/v1/unload_lora_adapter", {"lora_name": "a"}),
                ("/update_weights", {"path": "/x", "version": 3}),
            ]:
                status, answer = await _post(s, url + path, body, b["token"])
                assert status == 403 and answer["error"]["type"] == "permission_error", (path, answer)
            assert all(be.adapters == {"a": 1} for be in backends)

            # b's request in flight: a may not abort it; b's "all" means b's own requests only.
            for be in backends:
                be.delay = 0.3
            pending = asyncio.create_task(
                _post(s, url + "/v1/completions", {"prompt": [1], "request_id": "b-1"}, headers={RUN_HEADER: "b"})
            )
            await asyncio.sleep(0.1)
            assert (await _post(s, url + "/abort_requests", {"request_ids": ["b-1"]}, a["token"]))[0] == 403
            assert (await _post(s, url + "/abort_requests", {"request_ids": "all"}, b["token"]))[0] == 200
            assert backends[0].admin[-1] == ("/abort_requests", {"request_ids": ["b-1"]})
            assert (await pending)[0] == 200

            # A run's pause holds its own queue in the router; the backends never see it.
            assert (await _post(s, url + "/pause", {}, a["token"]))[1] == {"run": "a", "paused": True}
            assert not any(p == "/pause" for be in backends for p, _ in be.admin)
            held = asyncio.create_task(_post(s, url + "/v1/completions", {"prompt": [1], "model": "a"}))
            assert (await _post(s, url + "/v1/completions", {"prompt": [1]}, headers={RUN_HEADER: "b"}))[0] == 200
            assert not held.done()
            await _post(s, url + "/resume", {}, a["token"])
            status, answer = await held
            assert status == 200 and answer["choices"][0]["adapter"] == "a"

            async with s.get(url + "/runs", headers=_auth(FLEET_TOKEN)) as r:
                assert set(await r.json()) == {"a", "b"}
            status, gone = await _post(s, url + "/runs/unregister", {"run": "a"}, b["token"])
            assert status == 403
            status, gone = await _post(s, url + "/runs/unregister", {}, a["token"])
            assert status == 200 and gone["run"] == "a" and gone["completion_tokens"] == 2
            assert all(be.adapters == {} for be in backends)  # its adapter is unloaded everywhere
            assert (await _post(s, url + "/pause", {}, a["token"]))[0] == 401  # its token is void
        await _close(backends, runner)

    asyncio.run(go())


def test_metrics_report_each_runs_tokens_and_utilisation_and_the_fleets() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(1, backend_slots=2)
        for be in backends:
            be.delay = 0.2
        async with aiohttp.ClientSession() as s:
            for name in ("a", "b"):
                await _post(s, url + "/runs/register", {"run": name}, FLEET_TOKEN)
            calls = [
                _post(s, url + "/v1/completions", {"prompt": [1], "n": 2}, headers={RUN_HEADER: "a"}) for _ in range(3)
            ]
            calls.append(_post(s, url + "/v1/completions", {"prompt": [1]}, headers={RUN_HEADER: "b"}))
            t0 = time.monotonic()
            assert [st for st, _ in await asyncio.gather(*calls)] == [200] * 4
            wall = time.monotonic() - t0
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        fleet, runs = parse_router_metrics(text), parse_run_metrics(text)
        assert runs["a"]["completion_tokens"] == 12 and runs["b"]["completion_tokens"] == 2
        assert runs["a"]["requests"] == 3 and runs["a"]["prompt_tokens"] == 18
        assert fleet["completion_tokens"] == 14 and fleet["slots"] == 2 and fleet["queued"] >= 1
        # Three n=2 requests and one n=1 request of >= 0.2 s each through 2 slots: ~0.7 slot-seconds on an idle
        # machine, never more than the 2 slots were open for.
        assert 0.5 < fleet["slot_seconds"] <= 2 * wall + 0.05
        assert runs["a"]["slot_seconds"] > runs["b"]["slot_seconds"] > 0
        assert 0 < runs["b"]["utilisation"] < runs["a"]["utilisation"] <= 1
        assert 0 < fleet["utilisation"] <= 1 and runs["a"]["tokens_per_s"] > 0
        await _close(backends, runner)

    asyncio.run(go())


def test_a_readmitted_backend_gets_every_loaded_adapter_back() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(2, backend_slots=4)
        async with aiohttp.ClientSession() as s:
            _, a = await _post(s, url + "/runs/register", {"run": "a"}, FLEET_TOKEN)
            load = {"lora_name": "a", "lora_path": "/x/a", "load_inplace": True, "version": 4}
            await _post(s, url + "/v1/load_lora_adapter", load, a["token"])
        backends[1].adapters.clear()  # a restarted replica comes back empty
        router.fleet.failed(router.backends[1], refused=True)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if router.backends[1].healthy:
                break
        assert router.backends[1].healthy and backends[1].adapters == {"a": 4}
        await _close(backends, runner)

    asyncio.run(go())


def test_client_in_adapter_mode_names_its_run_and_loads_its_adapter() -> None:
    async def go() -> None:
        backends, router, runner, url = await _fleet(1)
        async with aiohttp.ClientSession() as s:
            _, a = await _post(s, url + "/runs/register", {"run": "a"}, FLEET_TOKEN)
        async with InferenceClient([url], 10, 0, admin_token=SecretStr(a["token"]), adapter="a") as client:
            assert await client.wait_healthy(5) == 0
            (before,) = await client.generate([1, 2], 1, 2, 1.0, 1.0)
            assert before.policy_versions == [0, 0]  # the base model is the run's version 0
            await client.load_adapter("a", "relative/step_1", 1)
            path, body = backends[0].admin[-1]
            assert path == "/v1/load_lora_adapter" and body["lora_name"] == "a" and body["version"] == 1
            assert Path(body["lora_path"]).is_absolute() and body["load_inplace"] is True
            (after,) = await client.generate([1, 2], 1, 2, 1.0, 1.0)
            assert after.policy_versions == [1, 1]
            backends[0].mix_up = "b"
            with pytest.raises(InferenceError, match="adapter 'b', not this run's 'a'"):
                await client.generate([1, 2], 1, 2, 1.0, 1.0)
        assert router.tenants.runs["a"].requests == 3
        assert router.tenants.runs["a"].choices == {"adapter": 1, "base": 1, "foreign": 1}
        await _close(backends, runner)

    asyncio.run(go())


@pytest.mark.parametrize(
    "cls, argv, pattern",
    [
        (RLConfig, ["--fleet", "http://127.0.0.1:9"], r"^fleet needs \[model\.lora\]"),
        (RLConfig, ["--fleet", "not a url"], r"^fleet: "),
        (RLConfig, ["--fleet-weight", "0"], r"^fleet_weight: "),
        (RLConfig, ["--run-name", "a/b"], r"^run_name: "),
        (
            FleetConfig,
            ["--inference.router.implementation", "vllm-router"],
            r"vllm-router.*cannot serve a shared fleet",
        ),
        (FleetConfig, ["--metrics-interval", "0"], r"^metrics_interval: "),
        (FleetConfig, ["--inference.router.backend-slots", "0"], r"^inference\.router\.backend_slots: "),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_fleet_keys_fail_in_one_line_naming_the_key(cls: type, argv: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(cls, argv)
    assert "\n" not in str(e.value) and re.search(pattern, str(e.value)), str(e.value)


def test_fleet_config_pushes_the_model_down_and_sizes_the_slots(tmp_path: Path) -> None:
    cfg = load_config(
        FleetConfig, ["--model.name", "qwen3-tiny", "--inference.max-batch-size", "12", "--output-dir", str(tmp_path)]
    )
    assert cfg.inference.model.name == "qwen3-tiny" and cfg.inference.output_dir == tmp_path
    assert cfg.inference.router.backend_slots == 12
    assert cfg.inference.vllm.enable_lora is True and cfg.inference.router.implementation == "builtin"


def test_rl_on_a_fleet_points_the_orchestrator_at_it_as_the_runs_adapter(tmp_path: Path) -> None:
    cfg = load_config(
        RLConfig,
        [
            "--fleet",
            "http://127.0.0.1:9",
            "--model.lora.rank",
            "4",
            "--output-dir",
            str(tmp_path / "run-a"),
            "--sft.steps",
            "0",
        ],
    )
    cfg = resolve_on_fleet(cfg)
    client = cfg.orchestrator.client
    assert client.base_urls == ["http://127.0.0.1:9"] and client.admin_urls == []
    assert cfg.trainer.model.lora.name == "run-a" and cfg.orchestrator.model.lora.adapter_name() == "run-a"
    with pytest.raises(ConfigError, match="sft.steps must be 0 with --fleet"):
        resolve_on_fleet(load_config(RLConfig, ["--fleet", "http://h:1", "--model.lora.rank", "4", "--sft.steps", "2"]))


def test_the_shared_fleet_example_configs_load_and_agree() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "shared_fleet"
    base = load_config(SFTConfig, ["@", str(example / "base.toml")], env={})
    fleet = load_config(FleetConfig, ["@", str(example / "fleet.toml")], env={})
    served = base.output_dir / "sft"
    assert Path(fleet.model.name) == served and fleet.inference.router.backend_slots == fleet.inference.max_batch_size
    envs = set()
    for name in ("reverse_text", "skewed_latency"):
        run = load_config(RLConfig, ["@", str(example / f"{name}.toml")], env={})
        assert Path(run.model.name) == served and run.model.lora is not None and run.sft.steps == 0
        assert run.fleet == f"http://127.0.0.1:{fleet.inference.router.port}" and run.output_dir.name == name
        assert run.model.lora.rank <= fleet.inference.max_lora_rank
        assert run.output_dir.is_relative_to(fleet.inference.weight_roots[0])  # the servers may load its adapters
        envs.add(run.orchestrator.environment.id)
    assert len(envs) == 2
