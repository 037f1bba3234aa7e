"""The step writer: a step's resume state, then its packed batches, on disk in that order.

The state step N+1 resumes from (dataset position, curriculum, pending tasks; arbor.orchestrator.state) is
written before batch N: the trainer cannot checkpoint step N+1 without batch N, so no trainer checkpoint ever
lacks its orchestrator state, wherever a kill lands. States older than the newest trainer checkpoint are pruned.
The batch is packed into micro-batches per trainer rank (arbor.orchestrator.batcher) and written atomically to
`rollouts/step_N/` (arbor.transport.files).
"""

from __future__ import annotations

from arbor.config.orchestrator import OrchestratorConfig
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.state import save_state
from arbor.orchestrator.tasks import TaskSource
from arbor.run_dir import latest_checkpoint, prune_orchestrator_states
from arbor.transport.batch import StepBatch
from arbor.transport.files import write_step


class StepWriter:
    """Writes each step's state and batches to `cfg.output_dir` (see the module docstring)."""

    def __init__(self, cfg: OrchestratorConfig, pad_token_id: int) -> None:
        self.cfg, self.pad_token_id = cfg, pad_token_id

    def save_state(self, step: int, source: TaskSource) -> None:
        """The state a run resuming at step + 1 starts from; call it before `write(step, ...)`."""
        save_state(self.cfg.output_dir, source.state(step + 1))
        prune_orchestrator_states(self.cfg.output_dir, latest_checkpoint(self.cfg.output_dir) or 0)

    def write(self, step: int, rollouts: list[Rollout]) -> list[StepBatch]:
        """Packs the step's rollouts per trainer rank and writes them; returns the batches."""
        cfg = self.cfg
        batches = build_step_batches(
            rollouts,
            step,
            cfg.batching.trainer_ranks,
            cfg.batching.micro_batch_tokens,
            cfg.sampling.temperature,
            self.pad_token_id,
            cfg.batching.normalization,
            cfg.batching.prefix_merge,
            cfg.batching.min_micro_batches,
            cfg.sampling.top_p,
        )
        write_step(cfg.output_dir, step, batches)
        return batches
