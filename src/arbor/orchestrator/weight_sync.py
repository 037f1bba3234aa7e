"""Keeps the inference fleet on the newest published policy.

A background task watches `broadcasts/` (as often as `arbor.run_dir.poll_interval` says, counting from the last
version it loaded) and, as soon as the trainer publishes a newer version, tells every server to load it (servers
swap weights between decode steps, so in-flight requests continue and their later tokens carry the new version).
`ensure(v)` blocks a step until the fleet serves version >= v: that is the scheduler's lag bound
(`ensure(step - lag)`, arbor.orchestrator.scheduler). With `pause_generation`/`resume_generation` set (partial
rollouts, `abort_on_weight_update`), running generations are aborted before each update and resumed after it. A
LoRA run (`lora_name` set) loads each published adapter version through `/v1/load_lora_adapter` under that name
instead of `/update_weights`: the base weights, and other runs' adapters on a shared fleet, stay as they are.

A server that was unreachable (a restarted process) is brought back to the policy the fleet serves before it
serves again (`catch_up`, the client's recovery hook): the same version is loaded on it alone, or the newest
published one when that directory was pruned meanwhile. Where that cannot be done (an NCCL transfer cannot be
replayed to a late receiver) the server serves its own weights until the next update, and says so per token.

A version the fleet refuses (a checksum that does not match its manifest) is asked for once more; refused twice,
the orchestrator stops on one line naming the file and the checksums (`WeightUpdateRefused`), and `--resume` (or
`max_restarts`) republishes the weights from the trainer's verified checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from arbor.checkpoint_manifest import CheckpointDamaged
from arbor.orchestrator.client import InferenceClient, InferenceError
from arbor.run_dir import broadcast_dir, latest_published, poll_interval, published_steps

log = logging.getLogger("arbor.orchestrator.weight_sync")


class WeightUpdateRefused(CheckpointDamaged):
    """The fleet refused a published version twice (its checksums do not match its manifest, typically): one
    line naming the file and the checksums, on which the orchestrator stops; a resume republishes from the
    trainer's verified checkpoint."""


class WeightSync:
    def __init__(
        self, client: InferenceClient, output_dir: str | Path, loaded_version: int, lora_name: str | None = None
    ) -> None:
        self.client, self.output_dir = client, Path(output_dir)
        self.lora_name = lora_name
        self.loaded_version = loaded_version
        self.updates = 0
        self.update_seconds = 0.0
        self._changed = asyncio.Event()
        self.error: Exception | None = None
        self.pause_generation: Callable[[], Awaitable[Any]] | None = None
        """Optional (partial rollouts' abort_on_weight_update): awaited before each update; its result is
        passed to `resume_generation` after the update, whether it succeeded or not."""
        self.resume_generation: Callable[[Any], None] | None = None
        self.initial_version = loaded_version
        self.awake: asyncio.Event | None = None
        """A colocated run's gate (arbor.orchestrator.colocated): updates wait while it is clear (the fleet
        asleep), and the first one after a wake loads the new policy into the woken engine."""
        client.catch_up = self.catch_up

    @property
    def changed(self) -> asyncio.Event:
        """An event set when the fleet next serves a newer policy (or the watcher fails): take it before
        checking `loaded_version`, then wait on it, and no change is missed."""
        return self._changed

    async def run(self) -> None:
        try:
            await self._watch()
        except Exception as e:  # surfaced by ensure()/check() in the main loop instead of dying unseen
            self.error = e
            self._changed.set()

    def check(self) -> None:
        if isinstance(self.error, WeightUpdateRefused):  # one line (arbor.checkpoint_manifest.stop_cleanly)
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"weight update failed: {self.error}") from self.error

    async def _watch(self) -> None:
        since = time.monotonic()  # when the newest version was loaded: the poll interval grows from there
        refused: set[int] = set()  # versions the fleet refused once
        while True:
            if self.awake is not None:
                await self.awake.wait()
            newest = latest_published(self.output_dir)
            if newest is not None and newest > self.loaded_version:
                t0 = time.perf_counter()
                paused = await self.pause_generation() if self.pause_generation is not None else None
                try:
                    # Absolute: the servers load only absolute paths (arbor.transport.admin), and a run's output_dir
                    # may be relative (the examples' default).
                    path = str(broadcast_dir(self.output_dir, newest).resolve())
                    if self.lora_name is not None:
                        await self.client.load_adapter(self.lora_name, path, newest)
                    else:
                        await self.client.update_weights(path, newest)
                except InferenceError as e:
                    # The directory may have been pruned after a newer one appeared; retry with the newest.
                    if (latest_published(self.output_dir) or -1) > newest:
                        continue
                    if newest not in refused:  # a torn read (a network filesystem): once more
                        refused.add(newest)
                        log.warning("weight update %d refused (%s); retrying it once", newest, e)
                        continue
                    raise WeightUpdateRefused(f"weight update {newest} refused twice: {' '.join(str(e).split())}")
                finally:
                    if self.resume_generation is not None:
                        self.resume_generation(paused)
                self.loaded_version = newest
                self.updates += 1
                self.update_seconds += time.perf_counter() - t0
                log.info("inference serves policy version %d", newest)
                self._changed.set()
                self._changed = asyncio.Event()
                since = time.monotonic()
            await asyncio.sleep(poll_interval(time.monotonic() - since))

    async def catch_up(self, url: str, version: int) -> None:
        """Loads the fleet's policy on server `url`, which came back reporting policy `version` (module docstring).
        A LoRA server reports its base model's version, so a loaded adapter is always replayed."""
        target = self.loaded_version
        behind = version < target if self.lora_name is None else target > self.initial_version
        if not behind or url not in self.client.admin_urls:  # a router's backends are the router's to catch up
            return
        published = [v for v in published_steps(self.output_dir) if v >= target]
        if not published:
            log.warning(
                "%s came back at policy version %d; no published version >= %d to load on it", url, version, target
            )
            return
        newest = target if target in published else published[-1]
        path = str(broadcast_dir(self.output_dir, newest).resolve())
        try:
            if self.lora_name is not None:
                await self.client.load_adapter(self.lora_name, path, newest, urls=[url], gate=False)
            else:
                await self.client.update_weights(path, newest, urls=[url], gate=False)
        except InferenceError as e:
            log.warning(
                "%s came back at policy version %d and could not load version %d (%s): it serves its own "
                "weights until the next update, its tokens tagged with their version",
                url,
                version,
                newest,
                e,
            )
            return
        log.warning("%s came back at policy version %d: loaded version %d on it", url, version, newest)

    async def ensure(self, version: int, timeout: float) -> float:
        """Waits until the fleet serves `version` or newer; returns the seconds waited."""
        t0 = time.perf_counter()
        deadline = t0 + timeout
        while self.loaded_version < version:
            self.check()
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(
                    f"policy version {version} was not published within {timeout:.0f}s "
                    f"(newest in {self.output_dir / 'broadcasts'}: {latest_published(self.output_dir)})"
                )
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
            except TimeoutError:
                pass
        return time.perf_counter() - t0
