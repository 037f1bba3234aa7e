"""arbor.orchestrator.weight_sync.WeightSync: the fleet is told to load each newly published policy, and the watch
looks for it as often as arbor.run_dir.poll_interval says."""

from __future__ import annotations

import asyncio

import pytest

from arbor import run_dir
from arbor.checkpoint_manifest import stop_cleanly
from arbor.orchestrator import weight_sync as weights
from arbor.orchestrator.client import InferenceError
from arbor.orchestrator.weight_sync import WeightSync
from arbor.transport.republish import read_republish_request, request_republish


class FakeClient:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, int]] = []

    async def update_weights(self, path: str, version: int) -> None:
        self.loaded.append((path, version))


def _publish(out, step):
    d = run_dir.broadcast_dir(out, step)
    d.mkdir(parents=True)
    (d / run_dir.STABLE).write_text(str(step))


def test_the_fleet_loads_each_new_version_and_an_idle_watch_looks_rarely(tmp_path, monkeypatch):
    looks = []
    real = weights.latest_published
    monkeypatch.setattr(weights, "latest_published", lambda out: looks.append(1) or real(out))

    async def scenario():
        client = FakeClient()
        sync = WeightSync(client, tmp_path, loaded_version=0)
        watching = asyncio.create_task(sync.run())
        try:
            await asyncio.sleep(1.0)  # nothing published: the interval grows to 50 ms
            idle_looks = len(looks)
            _publish(tmp_path, 1)
            await sync.ensure(1, timeout=10)
            _publish(tmp_path, 2)
            _publish(tmp_path, 3)  # two at once: the newest is loaded, the older one skipped
            await sync.ensure(3, timeout=10)
        finally:
            watching.cancel()
        return client, sync, idle_looks

    client, sync, idle_looks = asyncio.run(scenario())
    # a fixed 2 ms poll would have looked ~500 times in that second, 50 ms 20 times
    assert 20 <= idle_looks <= 80
    assert [v for _, v in client.loaded] == [1, 3] and sync.loaded_version == 3 and sync.updates == 2
    assert all(path == str(run_dir.broadcast_dir(tmp_path, v).resolve()) for path, v in client.loaded)


def test_pinned_the_fleet_loads_exactly_the_version_a_step_asks_for_and_nothing_meanwhile(tmp_path):
    """`weight_updates = "between_steps"`: a version the trainer published ahead is not loaded while a step's
    groups generate, and `ensure(v)` loads v itself, not the newest; a v that is gone (withdrawn after a refusal
    and republished as a newer version) gives the next one."""

    async def scenario():
        client = FakeClient()
        sync = WeightSync(client, tmp_path, loaded_version=0, pinned=True)
        watching = asyncio.create_task(sync.run())
        seen = []
        try:
            _publish(tmp_path, 1)
            _publish(tmp_path, 2)  # the trainer a version ahead of what the next step needs
            await asyncio.sleep(0.3)  # the watch looks ~10 times: published, not asked for
            seen.append(sync.loaded_version)
            await sync.ensure(1, timeout=10)
            seen.append(sync.loaded_version)
            await asyncio.sleep(0.3)  # generation of step 2 (lag 1): version 2 stays on the shelf
            seen.append(sync.loaded_version)
            await sync.ensure(2, timeout=10)
            seen.append(sync.loaded_version)
            _publish(tmp_path, 4)  # 3 never appears
            await sync.ensure(3, timeout=10)
            seen.append(sync.loaded_version)
        finally:
            watching.cancel()
        return client, sync, seen

    client, sync, seen = asyncio.run(scenario())
    assert seen == [0, 1, 1, 2, 4]
    assert [v for _, v in client.loaded] == [1, 2, 4] and sync.updates == 3


class RefusingClient(FakeClient):
    """Refuses the first `refusals` updates as a server refuses weights whose checksum fails the manifest."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    async def update_weights(self, path: str, version: int) -> None:
        if self.refusals:
            self.refusals -= 1
            raise InferenceError(
                f"{path}/model.safetensors: crc32 1a2b3c4d... does not match the manifest (9f8e7d6c...): "
                "the copy is corrupted or incomplete",
                status=400,
            )
        await super().update_weights(path, version)


async def _trainer(out, republishes: list[int]) -> None:
    """Answers republish requests as the trainer does between steps: publishes the asked version again."""
    answered = 0
    while True:
        request = read_republish_request(out)
        if request is not None and request.version > answered:
            answered = request.version
            assert not run_dir.broadcast_dir(out, answered).exists()  # the refused copy was withdrawn first
            _publish(out, answered)
            republishes.append(answered)
        await asyncio.sleep(0.01)


def _refused(
    tmp_path,
    refusals: int,
    trainer: bool = True,
    timeout: float = 10.0,
    ensure_timeout: float = 10.0,
    pinned: bool = False,
) -> tuple[RefusingClient, WeightSync, BaseException | None, list[int]]:
    async def scenario():
        client = RefusingClient(refusals)
        sync = WeightSync(client, tmp_path, loaded_version=0, republish_timeout=timeout, pinned=pinned)
        republishes: list[int] = []
        tasks = [asyncio.create_task(sync.run())]
        if trainer:
            tasks.append(asyncio.create_task(_trainer(tmp_path, republishes)))
        _publish(tmp_path, 1)
        try:
            await sync.ensure(1, timeout=ensure_timeout)
        except Exception as e:  # noqa: BLE001 - returned for the test to look at
            return client, sync, e, republishes
        finally:
            for task in tasks:
                task.cancel()
        return client, sync, None, republishes

    return asyncio.run(scenario())


@pytest.mark.parametrize("pinned", [False, True])
def test_a_refused_update_is_retried_once_from_a_fresh_publish(tmp_path, pinned):
    client, sync, error, republishes = _refused(tmp_path, refusals=1, pinned=pinned)
    assert error is None and [v for _, v in client.loaded] == [1] and sync.loaded_version == 1
    assert republishes == [1] and sync.refused == 1 and sync.republishing is None
    request = read_republish_request(tmp_path)
    assert request is not None and request.version == 1 and "model.safetensors: crc32 1a2b3c4d" in request.reason


def _said(error: BaseException | None, capsys) -> str:
    def orchestrator() -> int:
        raise error

    assert stop_cleanly(orchestrator) == 1
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith(run_dir.STOP_PREFIX + "weight update 1 refused")
    assert "model.safetensors: crc32 1a2b3c4d" in line and "does not match the manifest" in line
    return line


def test_an_update_refused_after_its_fresh_publish_stops_in_one_line_naming_the_file_and_checksum(tmp_path, capsys):
    _, sync, error, republishes = _refused(tmp_path, refusals=2)
    assert republishes == [1] and sync.refused == 2
    assert "refused twice (the second time after a fresh publish)" in _said(error, capsys)


@pytest.mark.parametrize("republish_timeout, ensure_timeout", [(0.3, 10.0), (10.0, 0.3)])
def test_a_fresh_publish_that_never_comes_stops_in_one_line(tmp_path, capsys, republish_timeout, ensure_timeout):
    """Whichever wait ends first, the watch's for the fresh publish or the step's for its policy, says why."""
    _, _, error, _ = _refused(tmp_path, 1, trainer=False, timeout=republish_timeout, ensure_timeout=ensure_timeout)
    assert "the trainer did not publish it again within 0.3s" in _said(error, capsys)


def test_an_earlier_attempts_request_is_cleared_at_start(tmp_path):
    request_republish(tmp_path, 7, "an earlier attempt's refusal")
    WeightSync(FakeClient(), tmp_path, loaded_version=0)  # type: ignore[arg-type]
    assert read_republish_request(tmp_path) is None
