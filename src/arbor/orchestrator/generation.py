"""The generation pool: groups of rollouts generating on the inference fleet, in the scheduler's queue.

Each launched group is an asyncio task (`generate_group` through a resumable `GroupHandle`, or a black-box
agent environment's `run_group` through the gateway) with a position in the `RolloutQueue`; `take` hands out
finished groups under the queue's window rule (windowed FIFO: only positions in [H, H + W) are visible, the head
advances as the group at H is consumed; arbor.orchestrator.scheduler), in the scheduling mode's `pick` order.

Admission (`admit`) follows the scheduling mode's launch rule (arbor.orchestrator.modes): a per-step mode
launches exactly the step's groups (ceil(oversample x need), replacements for dropped ones, parked ones resumed
first), a continuous one keeps groups generating across step boundaries as far as the staleness bound allows,
both at most `max_in_flight` at once (the mode's default, adapted per step by arbor.orchestrator.concurrency).

A group whose generation failed for good (`InferenceError`: the fleet rejected a request, or it failed all of
the client's retries) is taken as a `FailedGroup`, which the assembler skips and counts; any other exception in a
group is a bug and ends the run.

When nothing visible is ready (`wait`), stragglers are moved (arbor.orchestrator.parking) and the pool waits for
the next group to finish; with nothing running and nothing parked the scheduler has stalled, which is an
error. After a per-step batch fills (`end_step`), the surplus is cancelled or parked. With
`abort_on_weight_update`, running groups are aborted around each weight update and resumed after it, except
those the scheduler parked meanwhile (`resume_after_update`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from arbor.config.environment import EnvironmentConfig
from arbor.config.orchestrator import GatewayConfig, SamplingConfig
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.client import InferenceClient, InferenceError
from arbor.orchestrator.concurrency import IdleClock
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.episode import EpisodeStats
from arbor.orchestrator.gateway.service import Gateway
from arbor.orchestrator.group import generate_group
from arbor.orchestrator.parking import Flight, Parking, ParkingSettings
from arbor.orchestrator.partial import GroupHandle, PartialRollouts
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.scheduler import RolloutQueue, SchedulingMode
from arbor.orchestrator.tasks import TaskSource
from arbor.run_dir import gateway_url_path, write_text_atomic


@dataclasses.dataclass
class FailedGroup:
    """A group whose generation failed for good, in the place of its rollouts."""

    group_id: int
    error: InferenceError


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """What the generation pool reads of the orchestrator config (arbor.orchestrator.main hands it out)."""

    group_size: int
    seq_len: int
    output_dir: Path
    """Where the gateway's URL is written."""
    sampling: SamplingConfig
    environment: EnvironmentConfig
    gateway: GatewayConfig
    parking: ParkingSettings
    """Partial rollouts: the parked surplus and the straggler moves."""


class GenerationPool:
    """Groups generating in the queue (see the module docstring)."""

    def __init__(
        self,
        settings: GenerationSettings,
        mode: SchedulingMode,
        env: Any,
        tokenizer: Tokenizer,
        source: TaskSource,
        counts: Counts,
        env_stats: EpisodeStats,
    ) -> None:
        self.settings, self.mode, self.env, self.tokenizer = settings, mode, env, tokenizer
        self.source, self.counts, self.env_stats = source, counts, env_stats
        self.queue: RolloutQueue[asyncio.Task] = RolloutQueue(mode.window, mode.pick)
        self.flights: dict[int, Flight] = {}
        """Group id -> its generation, while it runs or is parked."""
        self.parking = Parking(settings.parking, self.queue, source, counts)
        self.partial: PartialRollouts | None = None
        """The partial-rollout controller for the current client (`use`)."""
        self.gateway: Gateway | None = None
        """The OpenAI-compatible gateway black-box agents call (`start_gateway`)."""
        self.max_in_flight = mode.max_in_flight
        """Groups generating at once: the mode's, then what arbor.orchestrator.concurrency chooses per step."""
        self.idle = IdleClock(time.monotonic())
        """Wall time with no group generating (the generator-idle fraction)."""
        self._failed: dict[asyncio.Task, int] = {}
        """Finished groups whose generation failed for good -> their group id, until taken."""

    def use(self, client: InferenceClient) -> None:
        """Generates on `client` from now on."""
        if self.partial is None or self.partial.client is not client:
            self.partial = PartialRollouts(client, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))

    async def start_gateway(self, client: InferenceClient) -> None:
        """Starts the gateway when configured or when the environment drives black-box agents, and writes its
        URL to `<output_dir>/gateway_url`."""
        cfg = self.settings
        if not (cfg.gateway.enabled or getattr(self.env, "needs_gateway", False)):
            return
        self.gateway = Gateway(
            client,
            self.tokenizer,
            cfg.gateway,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            max_tokens=cfg.sampling.max_tokens,
            seq_len=cfg.seq_len,
        )
        url = await self.gateway.start()
        write_text_atomic(gateway_url_path(cfg.output_dir), url + "\n")  # agents poll for it: never half-written

    async def stop(self) -> None:
        """Cancels every group still generating or parked, and stops the gateway."""
        for f in self.flights.values():
            f.task.cancel()
        if self.gateway is not None:
            await self.gateway.stop()

    def admit(self, step: int, kept: int, need: int, version: int, launched: int) -> int:
        """Launches what the mode allows now, for a step that has `kept` of its `need` groups, the fleet serving
        `version`; `launched` counts the step's launches so far. Returns how many it launched (a parked group
        resumed takes a launch's place without counting)."""
        n = 0
        while self.mode.admits(step, kept, need, version, self.queue, self.max_in_flight):
            if not self.parking.unpark(step):
                self._launch(step, launched + n, version)
                n += 1
        return n

    def take(self, limit: int) -> list[list[Rollout] | FailedGroup]:
        """Up to `limit` finished groups the window lets out, in queue order (a failed one as a FailedGroup)."""
        out: list[list[Rollout] | FailedGroup] = []
        for _, task in self.queue.take(limit):
            key = self._failed.pop(task, None)
            out.append(task.result() if key is None else FailedGroup(key, task.exception()))  # type: ignore[arg-type]
        return out

    async def wait(
        self, step: int, kept: int, need: int, version: int, newer_policy: asyncio.Event | None = None
    ) -> None:
        """Nothing ready: moves stragglers (then returns at once), or waits until a group finishes, the next
        straggler is due or (continuous modes) `newer_policy` is set: the staleness bound then admits more
        launches, which would otherwise wait for the next group to finish."""
        q = self.queue
        due = None
        if self.settings.parking.partial.enabled and self.mode.continuous:
            due = await self.parking.move_stragglers(step, self.flights, self.partial)
        if due is not None and due <= time.monotonic():
            return
        running = [f.task for f in self.flights.values() if not f.parked]
        if not running:
            if self.parking.parked:
                return
            raise RuntimeError(
                f"scheduler stalled at step {step}: nothing running, {kept}/{need} groups kept, queue head "
                f"{q.head}, next {q.next_position}, in flight {q.in_flight}, waiting {q.waiting}, policy "
                f"version {version}"
            )
        timeout = None if due is None else max(due - time.monotonic(), 0.0)
        # One already set (a failed weight watcher leaves it so) would make this wait spin: ignored then.
        newer = (
            asyncio.ensure_future(newer_policy.wait())
            if newer_policy is not None and not newer_policy.is_set() and self.mode.continuous
            else None
        )
        try:
            await asyncio.wait(
                running + ([newer] if newer is not None else []), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if newer is not None:
                newer.cancel()

    async def end_step(self) -> None:
        """A batch is full: per-step modes cancel or park the groups still generating."""
        if not self.mode.continuous:
            await self.parking.surplus(self.flights.values(), self.partial)

    def resume_after_update(self, handles: list[GroupHandle]) -> None:
        """Resumes the groups paused for a weight update, except those the scheduler parked meanwhile."""
        live = [h for h in handles if (f := self.flights.get(h.key)) is not None and not f.parked]
        self.partial.resume(live, scheduled=False)

    def _launch(self, step: int, k: int, version: int) -> None:
        cfg = self.settings
        spec = self.source.next_spec(step, k)
        handle = self.partial.handle(spec.group_id)
        if hasattr(self.env, "run_group"):  # black-box agents: the environment drives them via the gateway
            coro = self.env.run_group(
                self.gateway, spec, cfg.group_size, cfg.environment.reward_weights, cfg.environment.timeout
            )
        else:
            sampling = cfg.sampling
            coro = generate_group(
                handle,
                self.env,
                spec,
                cfg.group_size,
                sampling.max_tokens,
                sampling.temperature,
                sampling.top_p,
                cfg.environment.reward_weights,
                cfg.environment.timeout,
                generate=handle.generate,
                env_cfg=cfg.environment,
                tokenizer=self.tokenizer,
                seq_len=cfg.seq_len,
                stats=self.env_stats,
            )
        now = time.monotonic()
        self.idle.busy(now)
        flight = Flight(self.queue.launch(), asyncio.create_task(coro), handle, now, now, version)
        self.flights[spec.group_id] = flight
        flight.task.add_done_callback(lambda t, f=flight, key=spec.group_id: self._finished(key, f, t))

    def _finished(self, key: int, flight: Flight, task: asyncio.Task) -> None:
        self.flights.pop(key, None)
        if all(f.parked for f in self.flights.values()):
            self.idle.idle(time.monotonic())
        cancelled = task.cancelled()
        self.source.closed(key, cancelled)
        if self.partial is not None:
            self.partial.forget(key)
        self.parking.finished(flight, None if cancelled else time.monotonic() - flight.started)
        if cancelled:
            if not flight.parked:
                self.queue.discard(flight.pos)
            return
        if flight.parked:  # it finished while parked (it was not generating): back in the queue, done
            flight.pos, flight.parked = self.queue.launch(), False
        self.counts.finished_groups += 1
        if isinstance(task.exception(), InferenceError):  # any other exception ends the run when taken
            self._failed[task] = key
        self.queue.finish(flight.pos, task)
