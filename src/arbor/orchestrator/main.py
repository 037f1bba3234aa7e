"""The orchestrator: tasks -> rollouts -> rewards -> advantages -> packed batches, one training step at a time.

Each step waits for a recent enough policy, collects its groups, writes the resume state and then the packed
batch to `rollouts/step_N/`, and records the step's figures; weight updates and metrics merging run in the
background. The work is split into parts with one job each (tasks, modes, generation, assembler, teacher,
step_writer, figures, concurrency); `Orchestrator` is the one holder of the whole `OrchestratorConfig`, and
`slice_config` cuts it into each part's small typed settings, so the parts see only what they read.

Details: docs/architecture.md, "4. Data flow"; docs/async.md; docs/operations.md, "Stopping and resuming".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

from arbor import runloop
from arbor.checkpoint_manifest import stop_cleanly
from arbor.config.loader import load_config, main_guard
from arbor.config.orchestrator import OrchestratorConfig
from arbor.environments import load_environment
from arbor.loopwatch import LoopWatch
from arbor.models import build_tokenizer
from arbor.monitor.heartbeat import beat, install
from arbor.monitor.metrics import MetricsWriter, RunClock, init_wandb
from arbor.orchestrator.assembler import AssemblerSettings, StepAssembler, open_buffer
from arbor.orchestrator.buffer import ExperienceBuffer
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.colocated import ColocatedFleet
from arbor.orchestrator.concurrency import ConcurrencyController
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.episode import EpisodeStats
from arbor.orchestrator.evaluator import client_generator, evaluate
from arbor.orchestrator.figures import FigureSettings, StepFigures, StepTimes, drain_metrics, poll_metrics
from arbor.orchestrator.generation import GenerationPool, GenerationSettings
from arbor.orchestrator.parking import ParkingSettings
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.scheduler import ModeSettings, build_mode
from arbor.orchestrator.state import OrchestratorState, load_state
from arbor.orchestrator.step_writer import StepWriter, WriterSettings
from arbor.orchestrator.tasks import TaskSettings, TaskSource
from arbor.orchestrator.teacher import Teacher
from arbor.orchestrator.weight_sync import WeightSync
from arbor.run_dir import latest_checkpoint, stopped_path
from arbor.transport.batch import StepBatch

log = logging.getLogger("arbor.orchestrator")

STOP_POLL = 0.5
"""Seconds between two looks for the trainer's `stopped.json` while a step is produced."""


@dataclasses.dataclass(frozen=True)
class Slices:
    """Each part's share of the orchestrator config."""

    mode: ModeSettings
    tasks: TaskSettings
    generation: GenerationSettings
    assembler: AssemblerSettings
    writer: WriterSettings
    figures: FigureSettings


def slice_config(cfg: OrchestratorConfig) -> Slices:
    """The one place the whole config is read for the parts: each gets the sub-tables and fields it uses."""
    groups = cfg.batch_size // cfg.group_size
    return Slices(
        mode=ModeSettings(cfg.scheduler, groups, cfg.max_off_policy_steps, cfg.max_concurrent_groups),
        tasks=TaskSettings(
            seed=cfg.seed,
            seq_len=cfg.seq_len,
            max_tokens=cfg.sampling.max_tokens,
            prompt_format=cfg.environment.prompt_format,
            curriculum=cfg.curriculum,
            max_retries=cfg.partial.max_resumes,
        ),
        generation=GenerationSettings(
            group_size=cfg.group_size,
            seq_len=cfg.seq_len,
            output_dir=cfg.output_dir,
            sampling=cfg.sampling,
            environment=cfg.environment,
            gateway=cfg.gateway,
            parking=ParkingSettings(cfg.partial, cfg.group_size, cfg.max_off_policy_steps),
        ),
        assembler=AssemblerSettings(
            groups_per_step=groups,
            max_off_policy_steps=cfg.max_off_policy_steps,
            advantage=cfg.advantage,
            filters=cfg.filters,
            max_failed_groups=cfg.client.max_failed_groups,
            buffer=cfg.buffer,
        ),
        writer=WriterSettings(cfg.output_dir, cfg.batching, cfg.sampling),
        figures=FigureSettings(cfg.group_size, cfg.batching.prefix_merge, cfg.filters.solve_threshold, cfg.curriculum),
    )


class Orchestrator:
    """The loop over steps, composed of the parts above; resumes from the newest trainer checkpoint when
    `cfg.resume`."""

    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.cfg = cfg
        parts = slice_config(cfg)
        self.tokenizer = build_tokenizer(cfg.model)
        self.env = load_environment(cfg.environment)
        self.mode = build_mode(parts.mode)
        self.start = (latest_checkpoint(cfg.output_dir) or 0) if cfg.resume else 0
        state = load_state(cfg.output_dir, self.start) if self.start else OrchestratorState()
        self.counts = Counts()
        self.env_stats = EpisodeStats()  # environment retries, failures and skips; multi-turn episode figures
        self.source = TaskSource(parts.tasks, self.env, self.tokenizer, state)
        self.pool = GenerationPool(
            parts.generation, self.mode, self.env, self.tokenizer, self.source, self.counts, self.env_stats
        )
        self.assembler = StepAssembler(parts.assembler, self.pool, self.source, self.counts)
        self.writer = StepWriter(parts.writer, self.tokenizer.pad_token_id)
        self.figures = StepFigures(parts.figures, self.env, self.source, self.pool, self.counts, self.env_stats)
        self.buffer: ExperienceBuffer | None = None
        """Opened by `run` when `[orchestrator.buffer]` is on."""
        self.teacher = Teacher(cfg.teacher, self.tokenizer.vocab_size) if cfg.teacher is not None else None
        """On-policy distillation's teacher (arbor.orchestrator.teacher), opened by `run`."""
        self.clock = RunClock(cfg.output_dir, self.start)
        self.stopped_at: int | None = None
        """The trainer's last checkpoint when its `max_minutes` stopped the run early."""
        self.matching = ConcurrencyController.for_mode(self.mode, parts.mode)
        self._trainer_seen: int | None = None  # the trainer row the controller last read
        self._dropped_before = 0  # stale drops counted before the current step
        self.colocated: ColocatedFleet | None = None
        """A colocated run's turns with the trainer (arbor.orchestrator.colocated), set up with the fleet."""
        self.watch = LoopWatch()
        """Names blocking code on the event loop as it blocks (an environment's, typically); entered by `run`."""

    async def run(self) -> None:
        cfg = self.cfg
        install(cfg.output_dir, "orchestrator")
        metrics = MetricsWriter(cfg.output_dir, init_wandb(cfg.wandb, cfg.output_dir, cfg.model_dump(mode="json")))
        self.buffer = open_buffer(cfg.buffer, cfg.output_dir, self.start, cfg.resume)
        polling = asyncio.create_task(poll_metrics(metrics))
        try:
            async with contextlib.AsyncExitStack() as stack:
                await stack.enter_async_context(self.watch)
                if self.teacher is not None:
                    await stack.enter_async_context(self.teacher)
                    await self.teacher.wait_ready()
                if cfg.buffer.train_only:
                    await self._run_steps(metrics, None, None)
                else:
                    await self._run_with_fleet(metrics)
            if self.stopped_at is not None:
                log.info(
                    "orchestrator stopped after %d of %d steps: the trainer reached max_minutes",
                    self.stopped_at,
                    cfg.max_steps,
                )
            else:
                log.info(
                    "orchestrator done after %d steps%s",
                    cfg.max_steps,
                    f" (train-only from {self.buffer.path})" if cfg.buffer.train_only else "",
                )
        finally:
            polling.cancel()
            metrics.close()
            if self.buffer is not None:
                self.buffer.close()

    async def _run_with_fleet(self, metrics: MetricsWriter) -> None:
        cfg = self.cfg
        # A LoRA run generates with its own adapter, served under its name (arbor.transport.adapter_admin).
        lora = cfg.model.lora.adapter_name(cfg.output_dir) if cfg.model.lora is not None else None
        async with InferenceClient(
            cfg.client.base_urls,
            cfg.client.timeout,
            cfg.client.max_retries,
            admin_urls=cfg.client.admin_urls,
            admin_token=cfg.client.admin_token,
            adapter=lora,
            reconnect_timeout=cfg.client.reconnect_timeout,
            vocab_size=self.tokenizer.vocab_size,
            stop_token_ids=self.tokenizer.stop_token_ids,
        ) as client:
            beat("waiting for the inference servers' /health")
            weights = WeightSync(
                client,
                cfg.output_dir,
                await client.wait_healthy(cfg.client.timeout),
                lora_name=lora,
                republish_timeout=cfg.republish_timeout,
                pinned=cfg.scheduler.weight_updates == "between_steps",
            )
            client.policy_version = weights.loaded_version
            if cfg.colocate:
                self.colocated = ColocatedFleet(client, weights, cfg.output_dir, cfg.weight_update_timeout, self.start)
            self.pool.use(client)
            if cfg.partial.enabled and cfg.partial.abort_on_weight_update:
                weights.pause_generation = self.pool.partial.abort_all
                weights.resume_generation = self.pool.resume_after_update
            syncing = asyncio.create_task(weights.run())
            try:
                await self.pool.start_gateway(client)
                if self.start:
                    log.info("resuming at step %d", self.start)
                    await weights.ensure(self.start, cfg.weight_update_timeout)
                await self._run_steps(metrics, client, weights)
            finally:
                syncing.cancel()
                await self.pool.stop()

    async def _run_steps(
        self, metrics: MetricsWriter, client: InferenceClient | None, weights: WeightSync | None
    ) -> None:
        """Steps start..max_steps (train-only: without a fleet), then the trainer's figures of the last ones;
        fewer when the trainer stops the run early (`max_minutes`)."""
        for step in range(self.start, self.cfg.max_steps):
            if not await self._step_unless_stopped(step, client, weights, metrics):
                metrics.forget_from(self.stopped_at)  # steps the trainer will not train: no half will come
                break
        if self.colocated is not None and self.stopped_at is None:  # the device for the steps still untrained
            await self._unless_stopped(self.colocated.train_until(self.cfg.max_steps))
        await drain_metrics(metrics, weights, self.cfg.weight_update_timeout)

    async def _step_unless_stopped(
        self, step: int, client: InferenceClient | None, weights: WeightSync | None, metrics: MetricsWriter
    ) -> bool:
        """Produces the step, looking for the trainer's stop meanwhile; False (the step cancelled) when the
        trainer stopped at or before it. A step before the stop is finished: the trainer trained it."""
        if self.stopped_at is None:
            self.stopped_at = self._trainer_stop()
        if self.stopped_at is not None and step >= self.stopped_at:
            return False
        stepping = asyncio.create_task(self._step(step, client, weights, metrics))
        while not stepping.done():
            await asyncio.wait([stepping], timeout=STOP_POLL)
            if self.stopped_at is None:
                self.stopped_at = self._trainer_stop()
            if self.stopped_at is not None and step >= self.stopped_at:
                stepping.cancel()
                await asyncio.gather(stepping, return_exceptions=True)
                return False
        stepping.result()
        return True

    async def _unless_stopped(self, work: Coroutine[Any, Any, None]) -> None:
        """Runs `work`, looking for the trainer's stop meanwhile (`max_minutes`): cancelled when it comes."""
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait([task], timeout=STOP_POLL)
            if self.stopped_at is None:
                self.stopped_at = self._trainer_stop()
            if self.stopped_at is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
        task.result()

    def _trainer_stop(self) -> int | None:
        """The step the trainer stopped at (its last checkpoint) when it wrote `stopped.json` for this run."""
        path = stopped_path(self.cfg.output_dir)
        if not path.exists():
            return None
        step = int(json.loads(path.read_text())["step"])
        return step if step > self.start else None  # one left by an earlier attempt is not this run's

    async def _step(
        self, step: int, client: InferenceClient | None, weights: WeightSync | None, metrics: MetricsWriter
    ) -> None:
        """One step: the policy the mode says it waits for, its groups, its batch on disk, its figures, then the
        in-flight limit for the next admissions."""
        t0 = time.perf_counter()
        waited = await self._wait_for_policy(step, weights)
        groups, gen_seconds = await self._collect(step, client, weights)
        groups = await self._through_buffer_and_teacher(step, groups)
        batches = self._write(step, groups)
        times = StepTimes(gen_seconds, waited, time.perf_counter() - t0, self.watch.take())
        figures = await self._figures(step, groups, batches, times, weights, client)
        if self.colocated is not None:
            figures.update(self.colocated.take_figures())
        metrics.add(step, {**figures, **self.clock.stamp()})
        self._match_throughput(metrics)

    async def _wait_for_policy(self, step: int, weights: WeightSync | None) -> float:
        """Waits until the fleet serves version step - lag(step) (the mode's admission rule); the seconds waited."""
        version = step - self.mode.lag(step)
        if self.colocated is not None:  # the trainer trains on the fleet's devices first
            await self.colocated.train_until(version)
        beat(f"waiting for policy version {max(0, version)} (step {step})")
        return 0.0 if weights is None else await weights.ensure(version, self.cfg.weight_update_timeout)

    async def _collect(
        self, step: int, client: InferenceClient | None, weights: WeightSync | None
    ) -> tuple[list[list[Rollout]], float]:
        """The step's kept groups (none without a fleet: train-only) and the seconds collecting them took."""
        t_gen = time.perf_counter()
        beat(f"generating and scoring step {step}")
        groups = await self.assembler.collect(step, client, weights) if client is not None else []
        beat(f"packing and writing rollouts step {step}")
        return groups, time.perf_counter() - t_gen

    async def _through_buffer_and_teacher(self, step: int, groups: list[list[Rollout]]) -> list[list[Rollout]]:
        """The step's batch through the experience buffer (when on), scored by the teacher (when configured)."""
        if self.buffer is not None:
            groups = self.assembler.through_buffer(step, groups, self.buffer)
        if self.teacher is not None:
            beat(f"scoring step {step} with the teacher")
            await self.teacher.score([r for g in groups for r in g])
        return groups

    def _write(self, step: int, groups: list[list[Rollout]]) -> list[StepBatch]:
        """The resume state, then the batch (arbor.orchestrator.step_writer)."""
        self.writer.save_state(step, self.source)
        return self.writer.write(step, [r for g in groups for r in g])

    async def _figures(
        self,
        step: int,
        groups: list[list[Rollout]],
        batches: list[StepBatch],
        times: StepTimes,
        weights: WeightSync | None,
        client: InferenceClient | None,
    ) -> dict[str, Any]:
        """The step's figures, with decoding speed, the periodic evaluation, the buffer and the teacher's."""
        cfg = self.cfg
        figures = await self.figures.step(step, groups, batches, times, weights, client)
        if client is not None:  # decode speed and speculative acceptance over the step (local engines)
            figures.update(self.figures.decoding(await client.engine_counters()))
        if client is not None and cfg.eval.interval and step % cfg.eval.interval == 0:
            t_eval = time.perf_counter()
            figures.update(
                await evaluate(client_generator(client, cfg.eval), self.tokenizer, cfg.eval, seq_len=cfg.seq_len)
            )
            figures["time/eval"] = time.perf_counter() - t_eval
        if self.buffer is not None:
            figures.update(self.buffer.counts())
        if self.teacher is not None:
            figures["time/teacher"] = self.teacher.seconds
        return figures

    def _match_throughput(self, metrics: MetricsWriter) -> None:
        """The in-flight limit for the next admissions, from the trainer's newest wait and the queue left."""
        self.pool.max_in_flight = self.matching.decide(
            self._new_trainer_wait(metrics), self.pool.queue.waiting, self.counts.dropped_stale - self._dropped_before
        )
        self._dropped_before = self.counts.dropped_stale

    def _new_trainer_wait(self, metrics: MetricsWriter) -> float | None:
        """The newest trainer row's wait fraction, once: None when no row arrived since the last call."""
        newest = max(metrics.trainer, default=None)
        if newest is None or newest == self._trainer_seen:
            return None
        self._trainer_seen = newest
        return metrics.trainer[newest].get("throughput/trainer_wait_frac")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("aiohttp", "httpx", "openai"):  # httpx/openai: in-process black-box agents log every request
        logging.getLogger(noisy).setLevel(logging.WARNING)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(OrchestratorConfig, argv, prog="orchestrator")
    setup_logging(cfg.log_level)
    # a full disk or a damaged state: one line, no traceback (arbor.checkpoint_manifest.stop_cleanly)
    code = stop_cleanly(lambda: runloop.run(Orchestrator(cfg).run(), threads=cfg.environment.threads) or 0)
    runloop.exit_if_stuck()  # an environment call that never returned must not keep the run from ending
    return code


if __name__ == "__main__":
    raise SystemExit(main())
