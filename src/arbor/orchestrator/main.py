"""The orchestrator: tasks -> rollouts -> rewards -> advantages -> packed batches, one training step at a time.

Each step waits until the inference fleet serves a policy at most `lag(step)` versions behind the step (see
arbor.orchestrator.scheduler: 0 = synchronous on-policy; 1 = batch N+1 is generated while the trainer trains on
batch N), then takes `batch_size / group_size` finished groups from the generation queue under the scheduler's
window rule, drops groups with a token older than `max_off_policy_steps` (counted, and replaced), computes
advantages, packs micro-batches per trainer rank and writes them atomically to `rollouts/step_N/`. Weight
updates run in the background (`WeightSync`) and metrics are merged with the trainer's as they arrive
(`MetricsWriter`).

Per-step modes (sync, one_step_off: the default) launch exactly the step's groups when the step starts. The
continuous modes (async, greedy, windowed_fifo) keep up to `max_in_flight` groups generating across step
boundaries, so generation never idles while a step is written or the trainer catches up. Groups still in
flight (or parked, or finished but not taken) when a run stops lose their generation, but not their tasks:
the saved state lists them (`pending`) and a resumed run launches them first, so no task is skipped (the
dataset position is saved as launched).

Oversampling and partial rollouts (`scheduler.oversample`, `[orchestrator.partial]`; every group generates
through a resumable `GroupHandle`, arbor.orchestrator.partial): per-step modes launch ceil(oversample x need)
groups and, when the batch is full, cancel those still generating or, with partial rollouts, abort and park them
(tokens kept, environment coroutine suspended) and resume them first at the next step (dropped instead when
their oldest token is already too stale; a group parked max_resumes times keeps running). Continuous modes with
a window, when the loop is about to wait (nothing in the window ready), take a window member running longer
than straggler_factor x the median of recent group durations out of its position (the head advances) and
either continue it at the queue's tail (abort + immediate resume, `straggler_action = "resume"`) or cancel it
and launch its task again as a new group at the tail (`"retry"`; a task retried max_resumes times is given up
when it straggles again); benchmarks/scheduler_sim.py models that rule. windowed_fifo's admission keeps
`policy.slack` steps of the staleness bound free (arbor.orchestrator.scheduler). `abort_on_weight_update` aborts running groups around each weight update and resumes them after.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import zlib
from typing import Any

from arbor.config.loader import load_config, main_guard
from arbor.config.orchestrator import OrchestratorConfig

log = logging.getLogger("arbor.orchestrator")

STRAGGLER_MIN_FINISHED, STRAGGLER_RECENT = 8, 1024
"""The straggler rule's median is over the last STRAGGLER_RECENT finished groups, once MIN_FINISHED have. A long
memory on purpose: while the window waits, launches pause and the last groups to finish are the slow ones, so a
median of only the last few dozen climbs exactly when the rule is needed (the window then stalls for longer)."""


@dataclasses.dataclass(eq=False)
class _Flight:
    """One group's generation: its queue position, task and resumable handle."""

    pos: int
    task: asyncio.Task
    handle: Any  # arbor.orchestrator.partial.GroupHandle
    since: float
    """When it took its current position (launch, or relaunch at the tail)."""
    started: float
    version: int
    """Policy version the fleet served at launch: no token of it is older."""
    parked: bool = False

    @property
    def oldest(self) -> int:
        v = self.handle.oldest_version
        return self.version if v is None else min(v, self.version)


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig) -> None:
        from arbor.environments import load_environment
        from arbor.models import build_tokenizer

        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.model)
        self.env = load_environment(cfg.environment)
        self.tasks = self.env.dataset(cfg.seed)
        self.dropped_stale = 0
        self.skipped_long = 0
        self.groups_launched = 0
        self.gateway = None
        self.curriculum = None
        self.buffer = None
        self.filtered: dict[str, int] = {"zero_advantage": 0, "difficulty": 0, "env_skipped": 0}
        from arbor.orchestrator.episode import EpisodeStats

        self.env_stats = EpisodeStats()  # environment retries, failures and skips; multi-turn episode figures
        self._task_of_group: dict[int, dict] = {}
        from arbor.orchestrator.scheduler import RolloutQueue, SchedulePolicy

        self.policy = SchedulePolicy.from_config(cfg)
        self.queue: RolloutQueue[asyncio.Task] = RolloutQueue(self.policy.window)
        self._flights: dict[int, _Flight] = {}  # group id -> its generation, while it runs or is parked
        self._parked: list[_Flight] = []  # per-step modes: surplus groups aborted at batch fill, oldest first
        self._durations: collections.deque[float] = collections.deque(maxlen=STRAGGLER_RECENT)
        self.partial = None  # the PartialRollouts controller, made for the client in _collect_groups
        self.partial_counts = {"cancelled": 0, "parked": 0, "resumed": 0, "moved": 0, "retried": 0, "given_up": 0}
        self._last_aborted = 0
        self._relaunch: collections.deque[dict] = collections.deque()  # pending tasks of a resumed run
        self._retry: collections.deque[tuple[dict, int]] = collections.deque()  # (task, retries) to launch again
        self._retries: dict[int, int] = {}  # group id -> how many times its task was retried before it
        self.finished_groups = 0  # groups the generator has produced (for the production rate)
        self._last_write: float | None = None
        self._last_finished = 0

    async def run(self) -> None:
        from arbor.monitor.heartbeat import install
        from arbor.monitor.metrics import MetricsWriter, init_wandb
        from arbor.orchestrator.client import InferenceClient
        from arbor.orchestrator.state import OrchestratorState, TaskSampler, load_state
        from arbor.orchestrator.weights import WeightSync
        from arbor.run_dir import latest_checkpoint

        cfg = self.cfg
        install(cfg.output_dir, "orchestrator")
        start = (latest_checkpoint(cfg.output_dir) or 0) if cfg.resume else 0
        state = load_state(cfg.output_dir, start) if start else OrchestratorState()
        self.sampler = TaskSampler(self.tasks, cfg.seed, state.epoch, state.position)
        self._relaunch.extend(self.tasks[i] for i in state.pending)
        if cfg.curriculum.enabled:
            from arbor.orchestrator.filters import CurriculumSampler

            self.curriculum = CurriculumSampler(self.tasks, cfg.seed, cfg.curriculum, state.curriculum)
        metrics = MetricsWriter(cfg.output_dir, init_wandb(cfg.wandb, cfg.output_dir, cfg.model_dump(mode="json")))
        if cfg.buffer.enabled or cfg.buffer.train_only:
            from arbor.orchestrator.buffer import ExperienceBuffer

            self.buffer = ExperienceBuffer(cfg.buffer.path or cfg.output_dir / "buffer.sqlite")
            if cfg.buffer.reuse:
                self.buffer.release(0)
            elif start:
                released = self.buffer.release(start)  # claims whose training the crash lost
                log.info("buffer: %d rollouts claimed for steps >= %d returned to the buffer", released, start)
        if cfg.buffer.train_only:
            background = [asyncio.create_task(self._poll_metrics(metrics))]
            try:
                for step in range(start, cfg.max_steps):
                    await self._step(step, None, None, metrics)
                await self._drain_metrics(metrics, None)
            finally:
                for t in background:
                    t.cancel()
                metrics.close()
                self.buffer.close()
            log.info("orchestrator done after %d steps (train-only from %s)", cfg.max_steps, self.buffer.path)
            return
        async with InferenceClient(cfg.client.base_urls, cfg.client.timeout, cfg.client.max_retries,
                                   admin_urls=cfg.client.admin_urls) as client:
            weights = WeightSync(client, cfg.output_dir, await client.wait_healthy(cfg.client.timeout))
            client.policy_version = weights.loaded_version
            from arbor.orchestrator.partial import PartialRollouts

            self.partial = PartialRollouts(client, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
            if cfg.partial.enabled and cfg.partial.abort_on_weight_update:
                weights.pause_generation = self.partial.abort_all
                weights.resume_generation = self._resume_after_update
            background = [asyncio.create_task(weights.run()), asyncio.create_task(self._poll_metrics(metrics))]
            try:
                await self._start_gateway(client)
                if start:
                    log.info("resuming at step %d", start)
                    await weights.ensure(start, cfg.weight_update_timeout)
                for step in range(start, cfg.max_steps):
                    await self._step(step, client, weights, metrics)
                await self._drain_metrics(metrics, weights)
            finally:
                for t in [*background, *(f.task for f in self._flights.values())]:
                    t.cancel()
                if self.gateway is not None:
                    await self.gateway.stop()
                metrics.close()
                if self.buffer is not None:
                    self.buffer.close()
        log.info("orchestrator done after %d steps", cfg.max_steps)

    async def _step(self, step: int, client, weights, metrics) -> None:
        from arbor.monitor.heartbeat import beat
        from arbor.orchestrator.batcher import build_step_batches
        from arbor.orchestrator.state import OrchestratorState, prune_states, save_state
        from arbor.run_dir import latest_checkpoint
        from arbor.transport.files import write_step

        cfg = self.cfg
        t0 = time.perf_counter()
        beat(f"waiting for policy version {max(0, step - self.policy.lag(step))} (step {step})")
        waited = 0.0 if weights is None else await weights.ensure(step - self.policy.lag(step), cfg.weight_update_timeout)
        t_gen = time.perf_counter()
        dropped_before, filtered_before = self.dropped_stale, sum(self.filtered.values())
        beat(f"generating and scoring step {step}")
        groups = await self._collect_groups(step, client, weights) if client is not None else []
        beat(f"packing and writing rollouts step {step}")
        gen_seconds = time.perf_counter() - t_gen
        dropped = self.dropped_stale - dropped_before + sum(self.filtered.values()) - filtered_before
        if self.buffer is not None:
            groups = self._through_buffer(step, groups)
        # The state step+1 resumes from is on disk before batch `step` is: the trainer cannot checkpoint step+1
        # without this batch, so no trainer checkpoint ever lacks its orchestrator state, wherever a kill lands.
        curriculum = self.curriculum.state() if self.curriculum is not None else None
        save_state(cfg.output_dir, OrchestratorState(step + 1, self.sampler.epoch, self.sampler.position, curriculum,
                                                     self._pending_tasks()))
        prune_states(cfg.output_dir, latest_checkpoint(cfg.output_dir) or 0)
        rollouts = [r for g in groups for r in g]
        batches = build_step_batches(
            rollouts, step, cfg.batching.trainer_ranks, cfg.batching.micro_batch_tokens, cfg.temperature,
            self.tokenizer.pad_token_id, cfg.batching.normalization, cfg.batching.prefix_merge,
        )
        write_step(cfg.output_dir, step, batches)
        figures = self._figures(step, rollouts, gen_seconds, waited, time.perf_counter() - t0, weights, client)
        if cfg.batching.prefix_merge:  # sample tokens per trained (trie) token: what merging saved this step
            rows = sum(mb.num_tokens for b in batches for mb in b.micro_batches)
            figures["batch/prefix_merge_ratio"] = sum(r.num_tokens for r in rollouts) / max(rows, 1)
        if client is not None:
            for name, value in (await client.router_stats()).items():  # cumulative fleet counters (replicas > 1)
                if name in ("requests", "retries", "ejections", "readmissions", "backends_in_rotation"):
                    figures[f"router/{name}"] = value
        figures.update(self._throughput(len(rollouts), dropped, waited))
        figures.update(self._difficulty_mix(groups))
        figures.update(self._partial_figures(groups))
        if client is not None and cfg.eval.interval and step % cfg.eval.interval == 0:
            from arbor.orchestrator.eval import client_generator, evaluate

            t_eval = time.perf_counter()
            figures.update(await evaluate(client_generator(client, cfg.eval), self.tokenizer, cfg.eval,
                                          seq_len=cfg.seq_len))
            figures["time/eval"] = time.perf_counter() - t_eval
        if self.buffer is not None:
            figures.update(self.buffer.counts())
        metrics.add(step, figures)

    async def _collect_groups(self, step: int, client, weights) -> list[list]:
        """Takes a step's groups from the generation queue (launching as the mode allows), replacing those
        dropped as too stale; applies oversampling and partial rollouts (module docstring)."""
        from arbor.orchestrator.partial import PartialRollouts

        cfg, pol, q = self.cfg, self.policy, self.queue
        need = cfg.batch_size // cfg.group_size
        if self.partial is None or self.partial.client is not client:
            self.partial = PartialRollouts(client, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        kept: list[list] = []
        launched = 0
        self._filtered_here = 0
        while len(kept) < need:
            if pol.continuous:
                # Keep the fleet busy, but launch only groups the staleness bound will still admit when their
                # step comes (AReaL's rule): the outstanding groups fill the rest of this step's batch (after the
                # len(kept) groups it already has), then the next steps, in order.
                while q.in_flight < pol.max_in_flight and (
                    step + (len(kept) + q.outstanding) // need - weights.loaded_version
                    <= cfg.max_off_policy_steps - pol.slack
                ):
                    self._launch(step, launched, weights)
                    launched += 1
            else:  # the step's groups (oversampled, plus replacements), parked ones first, max_in_flight at once
                while len(kept) + q.in_flight + q.ready < pol.per_step and q.in_flight < pol.max_in_flight:
                    if not self._unpark(step):
                        self._launch(step, launched, weights)
                        launched += 1
            taken = q.take(need - len(kept))
            for _, task in taken:
                group = task.result()  # a failed generation fails the run, as the client already retried
                if self._keep(step, group, need, len(kept)):
                    kept.append(group)
            if len(kept) >= need:
                break
            if taken:  # some were dropped: launch replacements and look at the queue again before waiting
                continue
            due = await self._move_stragglers(step) if cfg.partial.enabled and pol.continuous else None
            if due is not None and due <= time.monotonic():  # stragglers moved: relaunch, look at the queue again
                continue
            running = [f.task for f in self._flights.values() if not f.parked]
            if not running:
                if self._parked:
                    continue
                raise RuntimeError(
                    f"scheduler stalled at step {step}: nothing running, {len(kept)}/{need} groups kept, queue head "
                    f"{q.head}, next {q.next_position}, in flight {q.in_flight}, waiting {q.waiting}, policy "
                    f"version {weights.loaded_version}"
                )
            timeout = None if due is None else max(due - time.monotonic(), 0.0)
            await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not pol.continuous:
            await self._surplus(step)
        return kept

    def _keep(self, step: int, group: list, need: int, kept: int) -> bool:
        """Staleness bound, advantages, curriculum record and filters for one taken group."""
        from arbor.orchestrator.advantages import compute_advantages
        from arbor.orchestrator.filters import filter_reason, solve_rate

        cfg = self.cfg
        task = self._task_of_group.pop(group[0].group_id, None) if group else None
        if not group:  # every rollout skipped after environment failures (counted in env/skipped)
            self.filtered["env_skipped"] += 1
            self._filtered_here += 1
            if self._filtered_here > 50 * need and not kept:
                raise RuntimeError(
                    f"the environment failed every rollout of {self._filtered_here} groups in a row at step {step}"
                )
            return False
        if max(r.staleness(step) for r in group) > cfg.max_off_policy_steps:
            self.dropped_stale += len(group)
            return False
        compute_advantages([group], cfg.advantage)  # per group: advantages are group-relative
        if self.curriculum is not None and task is not None:
            self.curriculum.record(task, solve_rate(group, cfg.filters.solve_threshold))
        reason = filter_reason(group, cfg.filters)
        if reason is None:
            return True
        self.filtered[reason] += len(group)
        self._filtered_here += 1
        if self._filtered_here > 50 * need and not kept:
            raise RuntimeError(
                f"orchestrator.filters dropped {self._filtered_here} groups in a row at step {step} "
                f"(last reason: {reason}): loosen drop_zero_advantage / min_solve_rate / max_solve_rate"
            )
        return False

    def _launch(self, step: int, k: int, weights) -> None:
        from arbor.orchestrator.rollout import generate_group

        cfg = self.cfg
        spec = self._next_spec(step, k)
        handle = self.partial.handle(spec.group_id)
        if hasattr(self.env, "run_group"):  # black-box agents: the environment drives them via the gateway
            coro = self.env.run_group(self.gateway, spec, cfg.group_size, cfg.environment.reward_weights,
                                      cfg.environment.timeout)
        else:
            coro = generate_group(handle, self.env, spec, cfg.group_size, cfg.sampling.max_tokens, cfg.temperature,
                                  cfg.sampling.top_p, cfg.environment.reward_weights, cfg.environment.timeout,
                                  generate=handle.generate, env_cfg=cfg.environment, tokenizer=self.tokenizer,
                                  seq_len=cfg.seq_len, stats=self.env_stats)
        now = time.monotonic()
        flight = _Flight(self.queue.launch(), asyncio.create_task(coro), handle, now, now, weights.loaded_version)
        self._flights[spec.group_id] = flight
        flight.task.add_done_callback(lambda t, f=flight, key=spec.group_id: self._finished(key, f, t))

    def _unpark(self, step: int) -> bool:
        """Resumes the oldest parked group at the queue's tail (True), dropping parked groups whose oldest token
        is already too stale for this step; False when none is left."""
        while self._parked:
            f = self._parked.pop(0)
            if f.task.done():
                continue
            if step - f.oldest > self.cfg.max_off_policy_steps:
                self.dropped_stale += self.cfg.group_size
                f.task.cancel()
                continue
            f.parked, f.pos, f.since = False, self.queue.launch(), time.monotonic()
            f.handle.resume()
            self.partial_counts["resumed"] += 1
            return True
        return False

    async def _surplus(self, step: int) -> None:
        """Per-step modes, batch full: groups still generating are cancelled, or parked for the next step (partial
        rollouts); a group already resumed max_resumes times keeps running into the next step."""
        cfg = self.cfg
        running = [f for f in self._flights.values() if not f.parked and not f.task.done()]
        if not running:
            return
        if not cfg.partial.enabled:
            for f in running:
                f.task.cancel()
            self.partial_counts["cancelled"] += len(running)
            return
        park = [f for f in running if f.handle.resumes < cfg.partial.max_resumes]
        for f in park:
            self.queue.discard(f.pos)
            f.parked = True
        self._parked.extend(park)
        await self.partial.abort([f.handle for f in park])
        self.partial_counts["parked"] += len(park)

    async def _move_stragglers(self, step: int) -> float | None:
        """Continuous modes with a window, called when the loop would wait: takes groups in [H, H+W) running
        longer than straggler_factor x the recent median group duration out of their positions and continues
        them at the tail (resume; too stale ones are dropped) or relaunches their tasks there (retry; given up
        after max_resumes retries). Returns when the next window member becomes a straggler (None: never, as
        things stand)."""
        cfg, q = self.cfg, self.queue
        if q.window is None or len(self._durations) < STRAGGLER_MIN_FINISHED:
            return None
        import statistics

        retry = cfg.partial.straggler_action == "retry"
        limit = cfg.partial.straggler_factor * statistics.median(self._durations)
        now, due = time.monotonic(), []
        movers = []
        for key, f in self._flights.items():
            if f.parked or f.task.done() or not q.head <= f.pos < q.head + q.window:
                continue
            if not retry and f.handle.resumes >= cfg.partial.max_resumes:
                continue
            if now - f.since > limit:
                movers.append((key, f))
            else:
                due.append(f.since + limit)
        if not movers:
            return min(due) if due else None
        for _, f in movers:
            q.discard(f.pos)
            f.parked = True  # until relaunched below; a finish in between is handled by _finished
        await self.partial.abort([f.handle for _, f in movers])
        for key, f in movers:
            if f.task.done():
                continue
            if retry:
                self._retry_task(key, f)
            elif step - f.oldest > cfg.max_off_policy_steps:  # its tokens can never be trained
                self.dropped_stale += cfg.group_size
                f.task.cancel()
            else:
                f.parked, f.pos, f.since = False, q.launch(), time.monotonic()
                f.handle.resume()
                self.partial_counts["moved"] += 1
        return time.monotonic()  # look at the queue again at once

    def _retry_task(self, key: int, f: "_Flight") -> None:
        """straggler_action = "retry": cancels the group (its tokens are discarded) and queues its task to be
        launched again, first, by the admission loop (at the queue's tail, with a new sampling seed), unless it
        has been retried max_resumes times already: then it is given up."""
        task, retries = self._task_of_group.pop(key, None), self._retries.get(key, 0)
        f.task.cancel()
        if task is None or retries >= self.cfg.partial.max_resumes:
            self.partial_counts["given_up"] += 1
            return
        self._retry.append((task, retries + 1))
        self.partial_counts["retried"] += 1

    async def _start_gateway(self, client) -> None:
        """The OpenAI-compatible gateway, when configured or when the environment drives black-box agents."""
        cfg = self.cfg
        if not (cfg.gateway.enabled or getattr(self.env, "needs_gateway", False)):
            return
        from arbor.orchestrator.gateway import Gateway

        self.gateway = Gateway(client, self.tokenizer, cfg.gateway, temperature=cfg.temperature,
                               top_p=cfg.sampling.top_p, max_tokens=cfg.sampling.max_tokens, seq_len=cfg.seq_len)
        url = await self.gateway.start()
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        (cfg.output_dir / "gateway_url").write_text(url + "\n")

    def _resume_after_update(self, handles: list) -> None:
        """Resumes the groups paused for a weight update, except those the scheduler parked meanwhile."""
        live = [h for h in handles if (f := self._flights.get(h.key)) is not None and not f.parked]
        self.partial.resume(live, scheduled=False)

    def _finished(self, key: int, flight: "_Flight", task: asyncio.Task) -> None:
        self._flights.pop(key, None)
        self._retries.pop(key, None)
        if task.cancelled():
            self._task_of_group.pop(key, None)
        if self.partial is not None:
            self.partial.forget(key)
        if flight in self._parked:
            self._parked.remove(flight)
        if task.cancelled():
            if not flight.parked:
                self.queue.discard(flight.pos)
            return
        if flight.parked:  # it finished while parked (it was not generating): back in the queue, done
            flight.pos, flight.parked = self.queue.launch(), False
        self.finished_groups += 1
        self._durations.append(time.monotonic() - flight.started)
        self.queue.finish(flight.pos, task)

    def _partial_figures(self, groups: list[list]) -> dict[str, Any]:
        """Per-step partial-rollout counts: groups/rollouts of this batch generated in pieces, and what the
        scheduler aborted, parked, moved or cancelled since the last batch (plus the cumulative aborts)."""
        out: dict[str, Any] = {
            "partial/resumed_groups": sum(any(r.pieces > 1 for r in g) for g in groups),
            "partial/resumed_rollouts": sum(r.pieces > 1 for g in groups for r in g),
            "partial/parked_now": len(self._parked),
        }
        aborted = self.partial.aborted if self.partial is not None else 0
        out["partial/aborted"] = aborted - self._last_aborted
        self._last_aborted = aborted
        for k, v in self.partial_counts.items():
            out[f"partial/{k}"] = v
            self.partial_counts[k] = 0
        return out

    def _through_buffer(self, step: int, groups: list[list]) -> list[list]:
        """Writes the step's new groups to the buffer, then claims the step's batch from it (which may include
        groups left from before a restart, or, train-only, only those)."""
        import uuid

        cfg = self.cfg
        for g in groups:
            self.buffer.put_group(g, uuid.uuid4().hex)
        need = cfg.batch_size // cfg.group_size
        claimed = self.buffer.claim(need, step, cfg.buffer.order)
        if not claimed:
            raise RuntimeError(f"buffer {self.buffer.path} has no ready, unclaimed group left for step {step}")
        if len(claimed) < need:
            log.warning("step %d: the buffer had only %d of %d groups", step, len(claimed), need)
        for k, g in enumerate(claimed):  # ids restart with each orchestrator run: make them unique in the batch
            for r in g:
                r.group_id = k
        return claimed

    def _difficulty_mix(self, groups: list[list]) -> dict[str, Any]:
        """The batch's difficulty mix: the fraction of its groups that are easy / normal / hard by their own solve
        rate (the curriculum's thresholds), plus the cumulative filter counts."""
        from arbor.orchestrator.filters import POOLS, difficulty, solve_rate

        cfg = self.cfg
        kinds = [difficulty(solve_rate(g, cfg.filters.solve_threshold), cfg.curriculum) for g in groups]
        out: dict[str, Any] = {f"batch/{p}_frac": kinds.count(p) / max(len(kinds), 1) for p in POOLS}
        out.update({f"filtered/{k}": v for k, v in self.filtered.items()})
        return out

    def _throughput(self, taken: int, dropped: int, waited: float) -> dict[str, Any]:
        """Throughput-matching figures: generator production vs trainer consumption, between two batch writes."""
        now = time.perf_counter()
        out: dict[str, Any] = {
            "scheduler/in_flight": self.queue.in_flight,
            "scheduler/ready": self.queue.ready,
            "scheduler/head": self.queue.head,
            "accepted/frac": taken / max(taken + dropped, 1),
        }
        if self._last_write is not None:
            interval = max(now - self._last_write, 1e-9)
            produced = (self.finished_groups - self._last_finished) * self.cfg.group_size
            out["throughput/produced_rollouts_per_s"] = produced / interval
            out["throughput/consumed_rollouts_per_s"] = taken / interval
            out["throughput/orchestrator_wait_ratio"] = min(waited / interval, 1.0)
        self._last_write, self._last_finished = now, self.finished_groups
        return out

    def _next_spec(self, step: int, k: int):
        from arbor.environments import env_prompt_ids
        from arbor.orchestrator.rollout import GroupSpec

        cfg = self.cfg
        while True:
            retries = 0
            if self._retry:
                task, retries = self._retry.popleft()
            elif self._relaunch:
                task = self._relaunch.popleft()
            else:
                task = self.curriculum.next() if self.curriculum is not None else self.sampler.next()
            prompt_ids = env_prompt_ids(self.env, task, self.tokenizer)
            if len(prompt_ids) + cfg.sampling.max_tokens <= cfg.seq_len:
                seed = zlib.crc32(f"{cfg.seed}/{step}/{k}".encode()) & 0x7FFFFFFF
                self.groups_launched += 1
                self._task_of_group[self.groups_launched - 1] = task
                if retries:
                    self._retries[self.groups_launched - 1] = retries
                return GroupSpec(task, prompt_ids, seed, self.groups_launched - 1)
            self.skipped_long += 1

    def _pending_tasks(self) -> list[int]:
        """Dataset indices of the tasks launched and not yet taken (for the saved state; see state.pending)."""
        index = {id(t): i for i, t in enumerate(self.tasks)}
        out = [index[id(t)] for t in self._task_of_group.values() if id(t) in index]
        out += [index[id(t)] for t, _ in self._retry if id(t) in index]
        return out + [index[id(t)] for t in self._relaunch if id(t) in index]

    def _figures(self, step, rollouts, gen_seconds, waited, step_seconds, weights, client) -> dict[str, Any]:
        import numpy as np

        from arbor.orchestrator.scheduler import staleness_histogram

        rewards = np.array([r.reward for r in rollouts])
        stale = np.array([r.staleness(step) for r in rollouts])
        comp_lens = np.array([r.num_trained for r in rollouts])  # sampled tokens (multi-turn: all turns)
        figures: dict[str, Any] = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/max": float(rewards.max()),
            "completion_len/mean": float(comp_lens.mean()),
            "truncated/frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "rollouts/s": len(rollouts) / max(gen_seconds, 1e-9),
            "staleness/max": int(stale.max()),
            "staleness/mean": float(stale.mean()),
            **staleness_histogram(stale.tolist()),
            "dropped/stale": self.dropped_stale,
            "skipped/too_long": self.skipped_long,
            "score/failed": int(sum(r.score_failed for r in rollouts)),
            **self._agent_figures(),
            "policy_version": weights.loaded_version if weights is not None else -1,
            "weights/updates": weights.updates if weights is not None else 0,
            "client/retries": client.retries if client is not None else 0,
            "time/generate": gen_seconds,
            "time/wait_weights": waited,
            "time/orchestrator_step": step_seconds,
            "epoch": self.sampler.epoch,
            **self.env_stats.figures(),
        }
        for name in sorted({k for r in rollouts for k in r.components}):
            figures[f"reward/{name}"] = float(np.mean([r.components.get(name, 0.0) for r in rollouts]))
        return figures

    def _agent_figures(self) -> dict[str, Any]:
        if self.gateway is None:
            return {}
        out = {"gateway/calls": self.gateway.calls, "gateway/open_sessions": len(self.gateway.sessions)}
        for name in ("failed", "retried"):
            if hasattr(self.env, name):
                out[f"agents/{name}"] = getattr(self.env, name)
        return out

    async def _poll_metrics(self, metrics) -> None:
        while True:
            metrics.poll()
            await asyncio.sleep(0.2)

    async def _drain_metrics(self, metrics, weights) -> None:
        """Waits for the trainer's figures of the last steps so that metrics.jsonl ends complete."""
        deadline = time.monotonic() + self.cfg.weight_update_timeout
        while metrics.pending and time.monotonic() < deadline:
            if weights is not None:
                weights.check()
            metrics.poll()
            await asyncio.sleep(0.1)
        if metrics.pending:
            raise TimeoutError(f"the trainer reported no metrics for steps {sorted(metrics.pending)}")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("aiohttp", "httpx", "openai"):  # httpx/openai: in-process black-box agents log every request
        logging.getLogger(noisy).setLevel(logging.WARNING)


@main_guard
def main(argv: list[str] | None = None) -> int:
    cfg = load_config(OrchestratorConfig, argv, prog="orchestrator")
    setup_logging(cfg.log_level)
    asyncio.run(Orchestrator(cfg).run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
