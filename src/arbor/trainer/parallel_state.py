"""`ParallelState`: what the trainer set up around a model when it prepared it (arbor.trainer.parallel.parallelize,
the SFT trainer), handed explicitly to whatever runs that model (the step, the chunked logprobs, the gradient
clipping) instead of being stuck onto the module. The default is a model nobody prepared: one rank, the
default logprob chunk, every head row in the policy."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the device mesh and the cp state load torch.distributed
    from torch.distributed.device_mesh import DeviceMesh

    from arbor.trainer.context_parallel import ContextParallel


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """One prepared model's setup; a reference model prepared beside the policy has its own."""

    logprob_chunk: int = 0
    """Rows per chunk of the chunked logprobs (`trainer.logprob_chunk_tokens`); 0: the default from the
    vocabulary size (arbor.trainer.logprobs.default_chunk)."""
    vocab: int = 0
    """The head rows the policy spans, its tokenizer's `vocab_size` (fewer than the head's rows when the head is
    padded); 0: every row."""
    cp: ContextParallel | None = None
    """The context-parallel state installed in the model's attention (arbor.trainer.context_parallel,
    arbor.trainer.dsa_cp); None without context parallelism."""
    expert_replicas: DeviceMesh | None = None
    """Ranks holding the same expert shard, whose expert gradients are averaged before clipping
    (arbor.trainer.expert_parallel); None without expert parallelism or when ep is the world."""


UNPREPARED = ParallelState()
"""A model nobody prepared (tests, tools)."""
