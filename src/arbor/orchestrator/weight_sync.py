"""Keeps the inference fleet on the newest published policy.

A background task watches `broadcasts/` (as often as `arbor.run_dir.poll_interval` says, counting from the last
version it loaded) and, as soon as the trainer publishes a newer version, tells every server to load it (servers
swap weights between decode steps, so in-flight requests continue and their later tokens carry the new version).
`ensure(v)` blocks a step until the fleet serves version >= v: that is the scheduler's lag bound
(`ensure(step - lag)`, arbor.orchestrator.scheduler). Pinned (`scheduler.weight_updates = "between_steps"`), the
watcher loads no version beyond the one the last `ensure` asked for, and that one exactly, so no update lands
while a step's groups generate and every batch comes from one policy. With `pause_generation`/`resume_generation`
set (partial rollouts, `abort_on_weight_update`), running generations are aborted before each update and resumed
after it. A LoRA run (`lora_name` set) loads each published adapter version through `/v1/load_lora_adapter`
under that name instead of `/update_weights`: the base weights, and other runs' adapters on a shared fleet, stay
as they are.

A server that was unreachable (a restarted process) is brought back to the policy the fleet serves before it
serves again (`catch_up`, the client's recovery hook): the same version is loaded on it alone, or the newest
published one when that directory was pruned meanwhile. Where that cannot be done (an NCCL transfer cannot be
replayed to a late receiver) the server serves its own weights until the next update, and says so per token.

A version N the fleet refuses (a shard whose checksum does not match its manifest) is retried once from a fresh
publish: the directory is withdrawn, the trainer is asked to publish N again from its in-memory weights
(arbor.transport.republish; it answers between steps, arbor.trainer.republish), and the first version >= N that
appears is loaded (N itself, or a newer one the trainer published meanwhile). Refused again, or not republished
within `republish_timeout` seconds, the orchestrator stops on one line naming the file and the checksums
(`WeightUpdateRefused`); `--resume` then republishes from the trainer's verified checkpoint. Meanwhile generation
goes on with the weights the fleet serves, and `ensure` keeps the staleness bound as before.
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
from arbor.run_dir import broadcast_dir, latest_published, poll_interval, published_steps, withdraw_published
from arbor.transport.republish import clear_republish_request, request_republish

log = logging.getLogger("arbor.orchestrator.weight_sync")


class WeightUpdateRefused(CheckpointDamaged):
    """The fleet refused a published version, then its fresh publish (its checksums do not match its manifest,
    typically), or the trainer did not republish it in time: one line naming the file and the checksums, on which
    the orchestrator stops; a resume republishes from the trainer's verified checkpoint."""


class WeightSync:
    def __init__(
        self,
        client: InferenceClient,
        output_dir: str | Path,
        loaded_version: int,
        lora_name: str | None = None,
        republish_timeout: float = 1800.0,
        pinned: bool = False,
    ) -> None:
        self.client, self.output_dir = client, Path(output_dir)
        self.pinned = pinned
        self.target = loaded_version
        """Pinned: the version the last `ensure` asked for, the only one the watcher may load next."""
        self.lora_name = lora_name
        self.loaded_version = loaded_version
        self.republish_timeout = republish_timeout
        """Seconds to wait for the trainer's fresh publish of a refused version before stopping."""
        self.republishing: str | None = None
        """While a fresh publish is awaited: the refusal, which a timeout in `ensure` says instead of its own."""
        self.refused = 0
        """Weight updates the fleet refused (each answered by a fresh publish, or the run stopped)."""
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
        clear_republish_request(self.output_dir)  # an earlier attempt's request is not this run's

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
        refused: set[int] = set()  # versions the fleet refused once, then asked for again
        while True:
            if self.awake is not None:
                await self.awake.wait()
            newest = self._next_version()
            if newest is not None and newest > self.loaded_version:
                t0 = time.perf_counter()
                try:
                    await self._load(newest)
                except InferenceError as e:
                    # The directory may have been pruned after a newer one appeared; retry with the newest.
                    if (self._next_version() or -1) > newest:
                        continue
                    self.refused += 1
                    reason = " ".join(str(e).split())
                    if newest in refused:
                        raise WeightUpdateRefused(
                            f"weight update {newest} refused twice (the second time after a fresh publish): {reason}"
                        ) from None
                    refused.add(newest)
                    await self._await_republish(newest, reason)
                    continue
                self.loaded_version = newest
                self.updates += 1
                self.update_seconds += time.perf_counter() - t0
                log.info("inference serves policy version %d", newest)
                self._changed.set()
                self._changed = asyncio.Event()
                since = time.monotonic()
            await asyncio.sleep(poll_interval(time.monotonic() - since))

    def _next_version(self) -> int | None:
        """The version to load next: the newest published one, or (pinned) the target itself once it is
        published; pinned, a target that is gone (a refused version republished as a newer one) gives the oldest
        published version after it."""
        if not self.pinned:
            return latest_published(self.output_dir)
        if self.target <= self.loaded_version:
            return None
        published = published_steps(self.output_dir)
        if self.target in published:
            return self.target
        later = [v for v in published if v > self.target]
        if later:
            log.warning("policy version %d is not published; loading version %d instead", self.target, later[0])
            return later[0]
        return None

    async def _load(self, version: int) -> None:
        """Tells the fleet to load published `version` (running generations paused around it when configured)."""
        paused = await self.pause_generation() if self.pause_generation is not None else None
        try:
            # Absolute: the servers load only absolute paths (arbor.transport.admin), and a run's output_dir may
            # be relative (the examples' default).
            path = str(broadcast_dir(self.output_dir, version).resolve())
            if self.lora_name is not None:
                await self.client.load_adapter(self.lora_name, path, version)
            else:
                await self.client.update_weights(path, version)
        finally:
            if self.resume_generation is not None:
                self.resume_generation(paused)

    async def _await_republish(self, version: int, reason: str) -> None:
        """Withdraws refused `version`, asks the trainer to publish it again and waits until a version >= it is
        published (the fresh one: the refused directory is gone); WeightUpdateRefused after `republish_timeout`."""
        log.warning("weight update %d refused (%s); asking the trainer to publish it again", version, reason)
        self.republishing = f"weight update {version} refused: {reason}"
        withdraw_published(self.output_dir, version)
        request_republish(self.output_dir, version, reason)
        t0 = time.monotonic()
        while (latest_published(self.output_dir) or -1) < version:
            waited = time.monotonic() - t0
            if waited > self.republish_timeout:
                raise WeightUpdateRefused(
                    f"{self.republishing}; the trainer did not publish it again within {self.republish_timeout:g}s"
                )
            await asyncio.sleep(poll_interval(waited))
        log.info("version %d republished after %.1fs", latest_published(self.output_dir), time.monotonic() - t0)
        self.republishing = None

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
        """Waits until the fleet serves `version` or newer (pinned: loads `version` itself); the seconds waited."""
        self.target = max(self.target, version)
        t0 = time.perf_counter()
        deadline = t0 + timeout
        while self.loaded_version < version:
            self.check()
            remaining = deadline - time.perf_counter()
            if remaining <= 0 and self.republishing is not None:  # waiting on a fresh publish: say why, one line
                raise WeightUpdateRefused(
                    f"{self.republishing}; the trainer did not publish it again within {timeout:g}s"
                )
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
