"""`[trainer.parallel]`: the mesh of the trainer ranks (FSDP2, HSDP, context and expert parallelism)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from arbor.config.base import Config, Ranks, Tokens


class ParallelConfig(Config):
    """Mesh of the trainer ranks: world = dp_replicate x dp_shard x cp; ep folds into dp_shard x cp."""

    nproc: Ranks = Field(1, ge=1)
    """Trainer ranks on this node (torchrun --nproc-per-node). Parameters are FSDP2-sharded across them."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: auto = nccl with CUDA, gloo on CPU."""
    dp_replicate: Ranks = Field(1, ge=1)
    """HSDP replica groups (parameters replicated across groups, sharded within); 1 = plain FSDP2."""
    dp_shard: Ranks = Field(-1, ge=-1)
    """FSDP2 shard degree; -1 = the ranks left over by dp_replicate and cp."""
    cp: Ranks = Field(1, ge=1)
    """Context parallel degree: each packed row is split over this many ranks (attention heads must divide by
    it for Ulysses)."""
    cp_style: Literal["auto", "ulysses", "ring", "dsa"] = "auto"
    """Context parallel attention: "ulysses" (all-to-all from sequence to head sharding), "ring" (key/value
    chunks passed around the ranks, online-softmax merge; zig-zag load-balanced sharding) or "dsa" (DeepSeek
    sparse attention models only: one all-gather of the latent KV and index keys per layer, indexer and top-k
    sparse attention for the local queries); "auto" = "dsa" for DSA models, "ulysses" otherwise."""
    ep: Ranks = Field(1, ge=1)
    """Expert parallel degree for MoE models: experts are split over this many ranks, a divisor of
    dp_shard x cp (and of the number of experts)."""
    ep_backend: Literal["all_to_all", "deepep"] = "all_to_all"
    """Token dispatch: "all_to_all" (torch collectives; gloo and NCCL) or "deepep" (DeepEP kernels; CUDA with
    the optional deep_ep package)."""
    ep_max_tokens_per_rank: Tokens = Field(8192, ge=1)
    """DeepEP buffer size: the most tokens one rank dispatches in a forward."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations."""

    @model_validator(mode="after")
    def _shard_degree(self) -> "ParallelConfig":
        if self.dp_shard == 0:
            raise ValueError("dp_shard must be -1 (the ranks left over) or at least 1 (got 0)")
        return self
