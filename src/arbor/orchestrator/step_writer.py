"""The step writer: a step's resume state, then its packed batches, on disk in that order.

The state step N+1 resumes from (dataset position, curriculum, pending tasks; arbor.orchestrator.state) is
written before batch N: the trainer cannot checkpoint step N+1 without batch N, so no trainer checkpoint ever
lacks its orchestrator state, wherever a kill lands. States older than the newest trainer checkpoint are pruned.
The batch is packed into micro-batches per trainer rank (arbor.orchestrator.batcher) and written atomically to
`rollouts/step_N/` (arbor.transport.files).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from arbor.config.orchestrator import BatchingConfig, SamplingConfig
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.state import save_state
from arbor.orchestrator.tasks import TaskSource
from arbor.run_dir import latest_checkpoint, prune_orchestrator_states
from arbor.transport.batch import StepBatch
from arbor.transport.files import write_step


@dataclasses.dataclass(frozen=True)
class WriterSettings:
    """What the step writer reads of the orchestrator config (arbor.orchestrator.main hands it out)."""

    output_dir: Path
    batching: BatchingConfig
    sampling: SamplingConfig
    """The temperature and top_p the trainer scores the samples at."""


class StepWriter:
    """Writes each step's state and batches to `settings.output_dir` (see the module docstring)."""

    def __init__(self, settings: WriterSettings, pad_token_id: int) -> None:
        self.settings, self.pad_token_id = settings, pad_token_id

    def save_state(self, step: int, source: TaskSource) -> None:
        """The state a run resuming at step + 1 starts from; call it before `write(step, ...)`."""
        out = self.settings.output_dir
        save_state(out, source.state(step + 1))
        prune_orchestrator_states(out, latest_checkpoint(out) or 0)

    def write(self, step: int, rollouts: list[Rollout]) -> list[StepBatch]:
        """Packs the step's rollouts per trainer rank and writes them; returns the batches."""
        batching, sampling = self.settings.batching, self.settings.sampling
        batches = build_step_batches(
            rollouts,
            step,
            batching.trainer_ranks,
            batching.micro_batch_tokens,
            sampling.temperature,
            self.pad_token_id,
            batching.normalization,
            batching.prefix_merge,
            batching.min_micro_batches,
            sampling.top_p,
        )
        write_step(self.settings.output_dir, step, batches)
        return batches
