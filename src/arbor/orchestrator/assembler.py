"""The step assembler: a step's groups, from the generation pool (and the experience buffer) to the batch.

`collect` admits groups as the mode allows (arbor.orchestrator.generation), takes finished ones from the queue
and keeps `batch_size / group_size` of them; a dropped group is replaced by a newly launched one, so a batch is
always full. Each taken group, in order: an empty one (every rollout skipped after environment failures) is
dropped as `env_skipped`; one with a token older than `max_off_policy_steps` is dropped as stale (counted in
rollouts); otherwise its advantages are computed (group-relative), its solve rate goes to the curriculum, and
the filters (zero advantage, solve-rate band) may drop it. More than 50 x need groups in a row filtered at a
step with nothing kept fails the run with the reason (a filter or an environment that can never pass). A group
whose generation failed for good (a request the fleet rejected, or one that failed every retry) is skipped with
a warning and counted (`generate/failed_groups`); more than `client.max_failed_groups` in a row fail the run
with the last error (a fleet that refuses every request: a model or length the servers were not started for).

With the experience buffer (`[orchestrator.buffer]`) the step's new groups are written to it and the batch is
claimed from it (which may include groups left from before a restart). A group claimed from the buffer obeys
the same staleness bound as a fresh one: one too old for the claiming step is discarded, counted in
dropped/stale, and the next one claimed. Train-only (`buffer.train_only`) generates nothing: every batch is
claimed from the buffer, whatever its groups' policy versions (they are another run's). A resumed run first
rewinds the buffer to where the step it resumes at began (arbor.orchestrator.buffer: claims of the lost steps
released, groups those steps wrote discarded, since the restored dataset position regenerates their tasks), so
with the buffer on or off a crash trains no task twice and skips none; `buffer.reuse` also releases every
earlier claim.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path

from arbor.config.orchestrator import AdvantageConfig, BufferConfig, FilterConfig
from arbor.orchestrator.advantages import compute_advantages
from arbor.orchestrator.buffer import ExperienceBuffer
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.filters import filter_reason, solve_rate
from arbor.orchestrator.generation import FailedGroup, GenerationPool
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.tasks import TaskSource
from arbor.orchestrator.weight_sync import WeightSync

log = logging.getLogger("arbor.orchestrator")

Group = list[Rollout]


def open_buffer(cfg: BufferConfig, output_dir: Path, start: int, resume: bool) -> ExperienceBuffer | None:
    """The experience buffer when configured, rewound to step `start` (this run's claims of steps >= start
    released, its groups written by those steps discarded); `resume`: the run continues an earlier one."""
    if not (cfg.enabled or cfg.train_only):
        return None
    buffer = ExperienceBuffer(cfg.path or output_dir / "buffer.sqlite", str(output_dir.resolve()))
    if cfg.reuse:
        buffer.release(0, every_run=True)
    if not (start or resume):  # a fresh run keeps what an earlier one left (and claims it first)
        return buffer
    # Also a resume at step 0: an attempt that died before its first checkpoint trained nothing, so what it wrote
    # and claimed is undone like any lost step's.
    released, discarded = buffer.rewind(start)
    if released or discarded:
        log.info(
            "buffer: %d rollouts claimed for steps >= %d returned to the buffer, %d written by those steps "
            "discarded (their tasks are generated again)",
            released,
            start,
            discarded,
        )
    return buffer


@dataclasses.dataclass(frozen=True)
class AssemblerSettings:
    """What the step assembler reads of the orchestrator config (arbor.orchestrator.main hands it out)."""

    groups_per_step: int
    """batch_size / group_size: the groups a step keeps."""
    max_off_policy_steps: int
    """The staleness bound a taken (or claimed) group must meet."""
    advantage: AdvantageConfig
    filters: FilterConfig
    max_failed_groups: int
    """`client.max_failed_groups`: groups in a row whose generation failed before the run fails."""
    buffer: BufferConfig


class StepAssembler:
    """A step's kept groups (see the module docstring)."""

    def __init__(self, settings: AssemblerSettings, pool: GenerationPool, source: TaskSource, counts: Counts) -> None:
        self.settings, self.pool, self.source, self.counts = settings, pool, source, counts
        self.need = settings.groups_per_step
        self._filtered_here = 0  # groups dropped by filters or environment skips in this step's collection
        self._failed_in_row = 0  # groups whose generation failed, since the last one that did not

    async def collect(self, step: int, client: InferenceClient, weights: WeightSync) -> list[Group]:
        """Takes a step's groups from the generation queue (launching as the mode allows), replacing those
        dropped; applies oversampling and partial rollouts (arbor.orchestrator.parking)."""
        need, pool = self.need, self.pool
        pool.use(client)
        kept: list[Group] = []
        launched = 0
        self._filtered_here = 0
        while len(kept) < need:
            newer_policy = weights.changed  # taken before the version is read: no update slips between
            launched += pool.admit(step, len(kept), need, weights.loaded_version, launched)
            taken = pool.take(need - len(kept))
            for group in taken:
                if self._keep(step, group, len(kept)):
                    kept.append(group)
            if len(kept) >= need:
                break
            if taken:  # some were dropped: launch replacements and look at the queue again before waiting
                continue
            await pool.wait(step, len(kept), need, weights.loaded_version, newer_policy)
        await pool.end_step()
        return kept

    def _keep(self, step: int, group: Group | FailedGroup, kept: int) -> bool:
        """Staleness bound, advantages, curriculum record and filters for one taken group."""
        cfg = self.settings
        if isinstance(group, FailedGroup):
            return self._skip_failed(step, group)
        self._failed_in_row = 0
        if not group:  # every rollout skipped after environment failures (counted in env/skipped)
            self.counts.filtered["env_skipped"] += 1
            if self._too_many_dropped(kept):
                raise RuntimeError(
                    f"the environment failed every rollout of {self._filtered_here} groups in a row at step {step}"
                )
            return False
        task = self.source.taken(group[0].group_id)
        if not self._fresh(step, group):
            return False
        compute_advantages([group], cfg.advantage)  # per group: advantages are group-relative
        self.source.record(task, solve_rate(group, cfg.filters.solve_threshold))
        reason = filter_reason(group, cfg.filters)
        if reason is None:
            return True
        self.counts.filtered[reason] += len(group)
        if self._too_many_dropped(kept):
            raise RuntimeError(
                f"orchestrator.filters dropped {self._filtered_here} groups in a row at step {step} "
                f"(last reason: {reason}): loosen drop_zero_advantage / min_solve_rate / max_solve_rate"
            )
        return False

    def _skip_failed(self, step: int, failed: FailedGroup) -> bool:
        """Skips a group whose generation failed (its task is not retried: the same request would fail again);
        fails the run after too many in a row."""
        self.source.taken(failed.group_id)
        self.counts.failed_groups += 1
        self._failed_in_row += 1
        limit = self.settings.max_failed_groups
        if self._failed_in_row > limit:
            raise RuntimeError(
                f"generation failed for {self._failed_in_row} groups in a row at step {step} "
                f"(orchestrator.client.max_failed_groups = {limit}): {failed.error}"
            ) from failed.error
        log.warning(
            "step %d: a group is skipped, its generation failed (%d in a row; the run fails after %d): %s",
            step,
            self._failed_in_row,
            limit,
            failed.error,
        )
        return False

    def _fresh(self, step: int, group: Group) -> bool:
        """The staleness bound: False (and the group counted in dropped/stale) when a token is older than
        `max_off_policy_steps` at `step`."""
        if max(r.staleness(step) for r in group) <= self.settings.max_off_policy_steps:
            return True
        self.counts.dropped_stale += len(group)
        return False

    def _too_many_dropped(self, kept: int) -> bool:
        """Counts one more filtered group; True when the step has dropped so many with nothing kept that it
        would spin forever."""
        self._filtered_here += 1
        return self._filtered_here > 50 * self.need and not kept

    def through_buffer(self, step: int, groups: list[Group], buffer: ExperienceBuffer) -> list[Group]:
        """Writes the step's new groups to the buffer, then claims the step's batch from it (which may include
        groups left from before a restart, or, train-only, only those)."""
        for g in groups:
            buffer.put_group(g, uuid.uuid4().hex, step=step)
        accept = None if self.settings.buffer.train_only else lambda g: self._fresh(step, g)
        claimed = buffer.claim(self.need, step, self.settings.buffer.order, accept)
        if not claimed:
            raise RuntimeError(f"buffer {buffer.path} has no ready, unclaimed group left for step {step}")
        if len(claimed) < self.need:
            log.warning("step %d: the buffer had only %d of %d groups", step, len(claimed), self.need)
        for k, g in enumerate(claimed):  # ids restart with each orchestrator run: make them unique in the batch
            for r in g:
                r.group_id = k
        return claimed
