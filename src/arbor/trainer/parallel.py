"""Process group setup, the device mesh (`ParallelDims`) and model parallelisation (`parallelize`).

Follows torchtitan's structure (ParallelDims -> build_mesh -> parallelize applying one transform per kind of
parallelism) but builds its mesh on CPU with gloo as well as on CUDA with NCCL, which torchtitan's ParallelDims
does not. Today the only dimension is `dp_shard` (FSDP2 over every rank); context and expert parallelism will
add mesh dimensions here and transforms in `parallelize`, in the order documented there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from arbor.config.trainer import TrainerConfig


def init_distributed(backend: str = "auto") -> tuple[torch.device, str]:
    """Initialises the default process group and returns this rank's device and the backend used.

    Under torchrun the group comes from its environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); a plain process
    gets a world of one over an in-process store, so the same collectives run either way with no port to pick.
    Backend "gloo" means training on CPU even where CUDA is present; "auto" picks NCCL and the GPU when it can.
    """
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("trainer.parallel.backend = 'nccl' needs CUDA, and none is available; use 'gloo' or 'auto'")
    chosen = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(chosen)
    else:
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1)
    return device, chosen


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Sizes of the named mesh dimensions; their product is the world size."""

    dp_shard: int
    """Ranks that FSDP2 shards parameters, gradients and optimizer state across (and averages gradients over)."""
    world_size: int

    def __post_init__(self) -> None:
        if self.dp_shard < 1 or self.dp_shard != self.world_size:
            raise ValueError(f"dp_shard ({self.dp_shard}) must equal the world size ({self.world_size})")

    @classmethod
    def from_world(cls, world_size: int | None = None) -> "ParallelDims":
        ws = dist.get_world_size() if world_size is None else world_size
        return cls(dp_shard=ws, world_size=ws)

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (the gradient-averaging group)."""
        return self.dp_shard

    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """A device mesh over the default process group; `device_type` "cpu" uses the gloo group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))


def parallelize(
    model: nn.Module, parallel_dims: ParallelDims, config: "TrainerConfig", device_type: str = "cpu"
) -> nn.Module:
    """Applies the model transforms in a fixed order and returns the model (changed in place).

    Order, as in torchtitan: activation checkpointing, expert parallelism and context parallelism rewrite or
    wrap submodules and must see plain modules, so they come first (`apply_ac`, `apply_ep`, `apply_cp` slot in
    here when those features land); FSDP2 goes last because it replaces parameters with sharded DTensors.
    With one rank nothing is sharded and the model stays a plain module.
    """
    if parallel_dims.fsdp_enabled:
        apply_fsdp(model, parallel_dims.build_mesh(device_type), compute_dtype(config))
    return model


def compute_dtype(config: "TrainerConfig") -> torch.dtype:
    return getattr(torch, config.model.dtype)


def apply_fsdp(model: nn.Module, mesh: "DeviceMesh", param_dtype: torch.dtype) -> None:
    """FSDP2: one group per decoder layer, then the root (embeddings, final norm, head).

    Tied embeddings stay tied because `embed_tokens` and `lm_head` both live in the root group, whose single
    FSDPParam is registered on both modules. Master weights stay fp32; a lower `model.dtype` becomes the
    all-gather/compute dtype with fp32 gradient reduction.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again first in backward: keep them gathered.
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def forward_context(
    parallel_dims: ParallelDims, config: "TrainerConfig", device_type: str
) -> contextlib.AbstractContextManager:
    """Lower-precision compute for an unsharded model (FSDP2's MixedPrecisionPolicy covers the sharded case)."""
    dtype = compute_dtype(config)
    if parallel_dims.fsdp_enabled or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
