"""arbor.orchestrator.weight_sync.WeightSync: the fleet is told to load each newly published policy, and the watch
looks for it as often as arbor.run_dir.poll_interval says."""

from __future__ import annotations

import asyncio

from arbor import run_dir
from arbor.orchestrator import weight_sync as weights
from arbor.orchestrator.weight_sync import WeightSync


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
