"""Admin routes: the bearer token on the inference server and the router (forwarded to the backends), the
`/update_weights` path and version policy, servers that refuse to bind beyond loopback without a token, and `rl`
generating a token per run and handing it to its children through the environment only."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fuzz_requests import raw_http
from pydantic import SecretStr
from test_inference import TOK, make_model, running_engine
from test_rl_e2e import TINY, _finish

from arbor.config.admin import ADMIN_TOKEN_ENV, CLIENT_TOKEN_ENV
from arbor.config.inference import InferenceConfig, RouterConfig
from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.inference.router.app import Router
from arbor.inference.server import BackgroundServer
from arbor.launch.children import replica_servers, token_env
from arbor.launch.process import Supervisor
from arbor.launch.rl import resolve, write_configs
from arbor.models.hf import save_checkpoint_dir
from arbor.monitor.metrics import read_jsonl
from arbor.run_dir import broadcast_dir, broadcasts_root, configs_dir
from arbor.transport.admin import ADMIN_ROUTES, WeightUpdates
from arbor.transport.http import start_site

TOKEN = "s3cret-admin-token"
BODIES = {
    "/update_weights": {"path": "/nope", "version": 0},
    "/pause": {},
    "/resume": {},
    "/abort_requests": {"request_ids": ["nobody"]},
    "/sleep": {"level": 1},  # then /wake_up: the server ends awake
    "/wake_up": {},
}
BEARER = {"Authorization": f"Bearer {TOKEN}"}


async def _call(
    s: aiohttp.ClientSession, url: str, body: Any = None, headers: dict[str, str] | None = None, method: str = "POST"
) -> tuple[int, Any]:
    async with s.request(method, url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def _assert_admin_guarded(s: aiohttp.ClientSession, url: str) -> None:
    """Each admin route: 401 without the token and with a wrong one (JSON error shape), 200 with it."""
    for route in ADMIN_ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            status, data = await _call(s, url + route, BODIES[route], headers)
            assert status == 401, (route, headers, data)
            assert set(data["error"]) == {"message", "type", "param"}
            assert data["error"]["type"] == "authentication_error"
        status, data = await _call(s, url + route, BODIES[route], BEARER)
        assert status == 200, (route, data)


def test_admin_routes_of_the_server_need_the_token_and_the_api_stays_open() -> None:
    with running_engine(make_model()) as engine, BackgroundServer(engine, TOK, admin_token=SecretStr(TOKEN)) as srv:

        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                await _assert_admin_guarded(s, srv.url)
                status, data = await _call(s, srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 200 and data["usage"]["completion_tokens"] == 2
                assert (await _call(s, srv.url + "/health", method="GET"))[0] == 200
                async with s.get(srv.url + "/metrics") as r:
                    assert r.status == 200
                assert (await _call(s, srv.url + "/collective_rpc", {}))[0] == 401  # unknown, but not /v1/: admin
                assert (await _call(s, srv.url + "/collective_rpc", {}, BEARER))[0] == 404

        asyncio.run(go())


def test_the_router_needs_the_token_and_forwards_it_to_its_backends() -> None:
    token = SecretStr(TOKEN)
    with (
        running_engine(make_model()) as e0,
        running_engine(make_model()) as e1,
        BackgroundServer(e0, TOK, admin_token=token) as s0,
        BackgroundServer(e1, TOK, admin_token=token) as s1,
    ):

        async def go() -> None:
            router = Router([s0.url, s1.url], RouterConfig(health_interval=0.05, admin_token=token))
            runner, url = await start_site(router.app(), "127.0.0.1", 0)
            try:
                async with aiohttp.ClientSession() as s:
                    await _assert_admin_guarded(s, url)  # 200 only if both backends took the router's token
                    status, data = await _call(s, url + "/pause", {}, BEARER)
                    assert status == 200 and all(r["status"] == 200 for r in data["results"].values())
                    assert e0.stats().paused and e1.stats().paused
                    await _call(s, url + "/resume", {}, BEARER)
                    assert (await _call(s, s0.url + "/pause", {}))[0] == 401  # the backends guard themselves
                    status, _ = await _call(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
                    assert status == 200
                    assert (await _call(s, url + "/health", method="GET"))[0] == 200
                    assert (await _call(s, url + "/collective_rpc", {}))[0] == 401  # forwarded routes outside /v1/
                    for target in ("/v1/../collective_rpc", "/v1/%2e%2e/pause", "/v1/./x/../../pause"):
                        head = f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        assert (await raw_http(url, head.encode()))[0] == 401, target  # not /v1/ once normalized
            finally:
                await runner.cleanup()

        asyncio.run(go())


def _publish(path: Path, seed: int) -> Path:
    model = make_model(seed)
    save_checkpoint_dir(model.state_dict(), model.args, path)
    return path


def test_a_frozen_server_takes_no_weight_update(tmp_path: Path) -> None:
    """`inference.frozen` (a distillation teacher, as `rl` launches it): a published directory it could otherwise
    load is refused with a 409 that names the setting, and the server keeps serving its own weights."""
    run = tmp_path / "run"
    step1 = _publish(broadcast_dir(run, 1), 1)
    weights = WeightUpdates.of(InferenceConfig(output_dir=run, frozen=True))
    assert weights.frozen and weights.roots == [broadcasts_root(run).resolve()]
    with (
        running_engine(make_model()) as engine,
        BackgroundServer(engine, TOK, weight_roots=weights.roots, frozen=True) as srv,
    ):

        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                status, data = await _call(s, srv.url + "/update_weights", {"path": str(step1), "version": 1})
                assert status == 409 and "inference.frozen = true" in data["error"]["message"], data
                assert engine.version == 0
                status, _ = await _call(s, srv.url + "/v1/completions", {"prompt": "ab", "max_tokens": 2})
                assert status == 200

        asyncio.run(go())


def test_update_weights_loads_only_newer_versions_from_the_allowed_roots(tmp_path: Path) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    step1 = _publish(broadcast_dir(run, 1), 1)
    _publish(outside, 2)
    (broadcasts_root(run) / "step_2").symlink_to(outside)  # inside by name, outside once resolved
    (broadcasts_root(run) / "alias").symlink_to(step1)  # a symlink resolving inside is fine
    (broadcasts_root(run) / "loop").symlink_to(broadcasts_root(run) / "loop")
    refused = [
        str(outside),  # outside the run
        str(broadcasts_root(run) / "step_2"),  # a symlink pointing outside
        f"{broadcasts_root(run)}/step_1/../../../outside",  # `..` segments
        f"{broadcasts_root(run)}/step_1/..",  # `..` even where it would stay inside
        str(broadcasts_root(run) / "step_9"),  # nonexistent
        str(step1 / "config.json"),  # not a directory
        "run/broadcasts/step_1",  # relative
        str(broadcasts_root(run) / "loop"),  # a symlink loop
        "/a\x00b",  # a NUL byte
    ]
    roots = WeightUpdates.of(InferenceConfig(output_dir=run)).roots  # the run's broadcasts/, as a server has it
    assert roots == [broadcasts_root(run).resolve()]
    with running_engine(make_model()) as engine, BackgroundServer(engine, TOK, weight_roots=roots) as srv:

        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                bodies = []
                for path in refused:
                    status, data = await _call(s, srv.url + "/update_weights", {"path": path, "version": 1})
                    assert status == 400 and data["error"]["param"] == "path", (path, data)
                    bodies.append(json_without(data, path))
                assert all(b == bodies[0] for b in bodies), bodies  # one answer, whatever exists
                assert engine.version == 0
                status, data = await _call(
                    s, srv.url + "/update_weights", {"path": str(broadcasts_root(run) / "alias"), "version": 1}
                )
                assert (status, data) == (200, {"policy_version": 1}) and engine.version == 1
                # Equal: a no-op answering the loaded version (the path is not even looked at).
                status, data = await _call(s, srv.url + "/update_weights", {"path": "/nope", "version": 1})
                assert (status, data) == (200, {"policy_version": 1})
                status, data = await _call(s, srv.url + "/update_weights", {"path": str(step1), "version": 0})
                assert status == 409 and data["error"]["param"] == "version" and engine.version == 1
                status, data = await _call(s, srv.url + "/update_weights", {"path": str(step1), "version": 2**70})
                assert status == 400 and data["error"]["param"] == "version" and engine.version == 1
                status, data = await _call(s, srv.url + "/update_weights", {"path": str(step1), "version": 5})
                assert (status, data) == (200, {"policy_version": 5})

        asyncio.run(go())


def json_without(data: dict[str, Any], path: str) -> dict[str, Any]:
    """An error body with the path the client sent (echoed back) blanked out."""
    error = dict(data["error"])
    error["message"] = error["message"].replace(repr(path), "<path>")
    return error


def test_racing_updates_never_regress_the_served_version(tmp_path: Path) -> None:
    step1, step2 = _publish(tmp_path / "step_1", 1), _publish(tmp_path / "step_2", 2)
    with running_engine(make_model()) as engine, BackgroundServer(engine, TOK, weight_roots=[tmp_path]) as srv:

        async def go() -> list[int]:
            async with aiohttp.ClientSession() as s:
                results = await asyncio.gather(
                    *(
                        _call(s, srv.url + "/update_weights", {"path": str(p), "version": v})
                        for p, v in [(step2, 2), (step1, 1), (step2, 2)]
                    )
                )
            return [status for status, _ in results]

        statuses = asyncio.run(go())
        assert engine.version == 2 and statuses.count(409) <= 1 and all(s in (200, 409) for s in statuses)


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, extra",
    [("arbor.inference.server", []), ("arbor.inference.router.app", ["--backends", '["http://127.0.0.1:9"]'])],
)
def test_a_server_binding_beyond_loopback_needs_a_token(module: str, extra: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARBOR_")}
    res = subprocess.run(
        [sys.executable, "-m", module, "--host", "0.0.0.0", "--port", "0", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "admin_token is required" in res.stderr and ADMIN_TOKEN_ENV in res.stderr


def test_tokens_come_from_the_environment_and_are_never_written_out(tmp_path: Path) -> None:
    cfg = load_config(InferenceConfig, ["--host", "0.0.0.0"], env={ADMIN_TOKEN_ENV: "12345"})
    assert cfg.admin_token is not None and cfg.admin_token.get_secret_value() == "12345"  # text, not a number
    assert "12345" not in repr(cfg) and "admin_token" not in cfg.to_toml_dict()
    with pytest.raises(ConfigError, match="set admin_token once"):
        load_config(RLConfig, ["--inference.admin-token", "a", "--orchestrator.client.admin-token", "b"])
    given = load_config(RLConfig, ["--output-dir", str(tmp_path / "given")], env={ADMIN_TOKEN_ENV: TOKEN})
    given = resolve(given)
    assert given.orchestrator.client.admin_token.get_secret_value() == TOKEN  # type: ignore[union-attr]
    write_configs(given)
    for f in configs_dir(given.output_dir).iterdir():
        assert TOKEN not in f.read_text() and "admin_token" not in f.read_text(), f


def test_rl_generates_a_token_beyond_loopback_and_hands_it_over_the_environment(tmp_path: Path) -> None:
    local = resolve(RLConfig.model_validate({"output_dir": str(tmp_path / "local")}))
    assert local.inference.admin_token is None and token_env(local, ADMIN_TOKEN_ENV) == {}
    cfg = resolve(
        RLConfig.model_validate(
            {"output_dir": str(tmp_path / "run"), "inference": {"replicas": 2, "router": {"host": "0.0.0.0"}}}
        )
    )
    token = cfg.inference.admin_token
    assert token is not None and len(token.get_secret_value()) >= 32
    assert cfg.inference.router.admin_token == cfg.orchestrator.client.admin_token == token
    assert resolve(
        RLConfig.model_validate({"output_dir": str(tmp_path / "b"), "inference": {"host": "0.0.0.0"}})
    ).inference.admin_token not in (None, token)  # one per run
    assert token_env(cfg, CLIENT_TOKEN_ENV) == {CLIENT_TOKEN_ENV: token.get_secret_value()}
    fleet = replica_servers(cfg, configs_dir(cfg.output_dir), Supervisor(tmp_path / "logs", {}))
    assert fleet.env == {ADMIN_TOKEN_ENV: token.get_secret_value()}
    assert not any(token.get_secret_value() in " ".join(argv) for argv in fleet.argv.values())


@pytest.mark.slow
def test_a_run_binding_beyond_loopback_trains_with_a_generated_token(tmp_path: Path) -> None:
    """Two replicas and the router on 0.0.0.0: every weight update goes through the guarded admin routes."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "arbor.launch.rl",
        "--output-dir",
        str(out),
        *TINY,
        "--max-steps",
        "3",
        "--inference.host",
        "0.0.0.0",
        "--inference.replicas",
        "2",
        "--inference.router.host",
        "0.0.0.0",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARBOR_")}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    rc, stdout, stderr = _finish(proc, timeout=400)
    assert rc == 0, stderr + stdout
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    for f in configs_dir(out).iterdir():
        assert "admin_token" not in f.read_text(), f
