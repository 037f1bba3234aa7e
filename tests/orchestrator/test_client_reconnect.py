"""A server that dies and comes back: the orchestrator's client waits for it instead of failing, and WeightSync
loads the fleet's policy on it before any request reaches it (arbor.orchestrator.client, .weights)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from test_router import FakeBackend

from arbor import run_dir
from arbor.orchestrator.client import InferenceClient, InferenceError
from arbor.orchestrator.weight_sync import WeightSync


class DyingBackend(FakeBackend):
    """Drops the connection of its first completion and from then on fails /health, as a process being killed."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.dying = asyncio.Event()

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def die(request: web.Request, handler):
            if self.dying.is_set():
                return web.json_response({"error": {"message": "dying"}}, status=503)
            if request.path == "/v1/completions":
                self.dying.set()
                assert request.transport is not None
                request.transport.close()
            return await handler(request)

        app.middlewares.append(die)
        return app


def _publish(out, *steps: int) -> None:
    for step in steps:
        d = run_dir.broadcast_dir(out, step)
        d.mkdir(parents=True)
        (d / run_dir.STABLE).write_text(str(step))


async def _dead_url() -> tuple[FakeBackend, str]:
    """A server that was started, then stopped: its URL refuses connections; its port is free to start again."""
    gone = FakeBackend("gone")
    url = await gone.start()
    await gone.stop()
    return gone, url


async def _generate(client: InferenceClient):
    return await client.generate([1, 2], n=1, max_tokens=1, temperature=1.0, top_p=1.0)


def test_a_restarted_server_gets_the_fleets_policy_before_the_waiting_request(tmp_path):
    _publish(tmp_path, 1, 2, 3)

    async def scenario():
        first = DyingBackend("first")
        first.version = 3
        url = await first.start()
        async with InferenceClient([url], timeout=10, max_retries=2, reconnect_timeout=20) as client:
            WeightSync(client, tmp_path, loaded_version=3)
            answer = asyncio.create_task(_generate(client))
            await first.dying.wait()
            await asyncio.sleep(0.7)  # a /health poll or two meets the dying process's 503
            await first.stop()
            await asyncio.sleep(0.7)  # then a refused connection
            second = FakeBackend("second")  # the restarted process: same port, the weights it started with
            second.port = first.port
            await second.start()
            try:
                completions = await asyncio.wait_for(answer, 15)
            finally:
                await second.stop()
            return completions, client, second

    completions, client, second = asyncio.run(scenario())
    path = str(run_dir.broadcast_dir(tmp_path, 3).resolve())
    assert second.admin == [("/update_weights", {"path": path, "version": 3})]
    assert completions[0].policy_versions == [3], "the restarted server answered before it had the fleet's weights"
    assert len(second.seen) == 1 and client.reconnects == 1 and client.retries == 1


def test_a_server_that_never_comes_back_fails_its_requests_naming_the_timeout():
    async def scenario():
        _, url = await _dead_url()
        async with InferenceClient([url], timeout=10, max_retries=3, reconnect_timeout=1.0) as client:
            t0 = time.monotonic()
            with pytest.raises(InferenceError, match="unreachable for 1s .*reconnect_timeout"):
                await _generate(client)
            return time.monotonic() - t0

    assert asyncio.run(scenario()) < 8  # reconnect_timeout (1 s), not the request timeout (10 s) x retries


def test_requests_go_to_a_live_server_while_another_recovers():
    async def scenario():
        (_, dead_url), live = await _dead_url(), FakeBackend("live")
        live_url = await live.start()
        try:
            async with InferenceClient([dead_url, live_url], timeout=10, max_retries=2, reconnect_timeout=30) as client:
                t0 = time.monotonic()
                for _ in range(4):
                    await _generate(client)
                return time.monotonic() - t0, live, client
        finally:
            await live.stop()

    seconds, live, client = asyncio.run(scenario())
    assert seconds < 10  # never waits out the dead one's reconnect_timeout (30 s)
    assert len(live.seen) == 4 and client.retries == 1 and client.reconnects == 0


class RecordingClient:
    def __init__(self, admin_urls: list[str], fail: bool = False) -> None:
        self.admin_urls, self.fail = admin_urls, fail
        self.calls: list[tuple] = []

    async def update_weights(self, path: str, version: int, urls=None, gate=True) -> None:
        self.calls.append(("update", path, version, urls, gate))
        if self.fail:
            raise InferenceError("no such weights")

    async def load_adapter(self, name: str, path: str, version: int, urls=None, gate=True) -> None:
        self.calls.append(("adapter", name, path, version, urls, gate))


def test_catch_up_replays_the_served_version_or_the_newest_when_it_was_pruned(tmp_path):
    _publish(tmp_path, 4, 5, 6)
    where = ["http://a"]

    def caught_up(
        loaded: int, reported: int, url: str = "http://a", lora: str | None = None, initial: int = 0, fail: bool = False
    ) -> list[tuple]:
        client = RecordingClient(where, fail)
        sync = WeightSync(client, tmp_path, loaded_version=initial, lora_name=lora)  # type: ignore[arg-type]
        assert client.catch_up == sync.catch_up
        sync.loaded_version = loaded
        asyncio.run(sync.catch_up(url, reported))
        return client.calls

    def path(step: int) -> str:
        return str(run_dir.broadcast_dir(tmp_path, step).resolve())

    assert caught_up(5, 0) == [("update", path(5), 5, where, False)]
    assert caught_up(3, 0) == [("update", path(6), 6, where, False)]  # version 3 was pruned: the newest
    assert caught_up(5, 5) == []  # not behind: a dropped connection, not a restart
    assert caught_up(5, 0, url="http://router") == []  # not an admin URL: the router catches its backends up
    assert caught_up(0, 0) == []  # the base weights: nothing to replay
    assert caught_up(5, 0, fail=True) == [("update", path(5), 5, where, False)]  # logged, not raised
    # LoRA: /health reports the base model's version, so a loaded adapter is replayed whatever it says.
    assert caught_up(5, 7, lora="run") == [("adapter", "run", path(5), 5, where, False)]
    assert caught_up(0, 0, lora="run") == []


class UnavailableBackend(FakeBackend):
    """Answers 503 to everything, /health included, until `until` (a router whose replicas are all restarting)."""

    def __init__(self, name: str, until: float) -> None:
        super().__init__(name)
        self.until = until

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def unavailable(request: web.Request, handler):
            if time.monotonic() < self.until:
                return web.json_response({"error": {"message": "no backend in rotation"}}, status=503)
            return await handler(request)

        app.middlewares.append(unavailable)
        return app


def test_a_503_is_waited_out_until_health_says_the_server_is_back():
    async def scenario():
        router = UnavailableBackend("router", until=time.monotonic() + 2.0)
        url = await router.start()
        try:
            # One retry with its 0.5 s backoff would fail within the outage; the wait for /health does not.
            async with InferenceClient([url], timeout=10, max_retries=1, reconnect_timeout=20) as client:
                completions = await _generate(client)
                return completions, client
        finally:
            await router.stop()

    completions, client = asyncio.run(scenario())
    assert completions[0].token_ids == [7] and client.retries == 1 and client.reconnects == 1


def test_a_cancelled_waiter_leaves_the_shared_recovery_running():
    async def scenario():
        gone, url = await _dead_url()
        async with InferenceClient([url], timeout=10, max_retries=2, reconnect_timeout=20) as client:
            waiters = [asyncio.create_task(_generate(client)) for _ in range(2)]
            await asyncio.sleep(0.3)  # both failed once and wait for the server's return
            waiters[0].cancel()
            await asyncio.sleep(0.3)
            back = FakeBackend("back")
            back.port = gone.port
            await back.start()
            try:
                completions = await asyncio.wait_for(waiters[1], 10)
            finally:
                await back.stop()
            return completions, waiters[0]

    completions, cancelled = asyncio.run(scenario())
    assert cancelled.cancelled() and completions[0].token_ids == [7]
