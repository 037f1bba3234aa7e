"""Process group setup, the device mesh (`ParallelDims`) and model parallelisation (`parallelize`).

Follows torchtitan's structure (ParallelDims -> build_meshes -> parallelize applying one transform per kind of
parallelism) but builds its mesh on CPU with gloo as well as on CUDA with NCCL, which torchtitan's ParallelDims
does not (and depends on torchtitan's own config classes). Named dimensions dp_replicate, dp_shard, cp and ep;
the transforms (FP8 swap -> LoRA -> AC -> EP -> CP -> FSDP2) and the reasons for that order are documented in
`parallelize`. Gradient clipping is our own because parameters live on different meshes (FSDP2 vs
expert-parallel DTensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint

from arbor.config.parallel import ParallelConfig
from arbor.config.trainer import TrainerConfig
from arbor.models import build_tokenizer
from arbor.models.fp8 import apply_fp8
from arbor.models.lora import apply_lora, load_adapter_into
from arbor.models.lora_peft import load_adapter
from arbor.trainer.context_parallel import apply_cp
from arbor.trainer.dsa_cp import apply_dsa_cp, resolve_cp_style
from arbor.trainer.expert_parallel import apply_ep, expert_params, sync_expert_grads
from arbor.trainer.parallel_state import ParallelState


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
    """Sizes of the named mesh dimensions. `world_size = dp_replicate * dp_shard * cp`; expert parallelism
    folds into the data-parallel ranks as in torchtitan: `ep` divides `dp_shard * cp`, and the ranks of an ep
    group hold different experts while seeing different tokens."""

    dp_replicate: int
    """HSDP replicas: parameters are replicated across them and gradients all-reduced."""
    dp_shard: int
    """Ranks that FSDP2 shards parameters, gradients and optimizer state across (and that see different data)."""
    cp: int
    """Context parallel: ranks splitting every sequence (FSDP2 shards over dp_shard x cp too)."""
    ep: int
    """Expert parallel: ranks splitting the experts of each MoE layer (a divisor of dp_shard x cp)."""
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise ValueError(
                f"trainer.parallel: dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x cp ({self.cp}) "
                f"must equal the world size ({self.world_size})"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"trainer.parallel.ep ({self.ep}) must divide dp_shard x cp ({self.dp_shard * self.cp})")

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int | None = None) -> "ParallelDims":
        """`dp_shard = -1` (the default) takes the ranks left over by dp_replicate and cp."""
        ws = dist.get_world_size() if world_size is None else world_size
        rest = parallel.dp_replicate * parallel.cp
        if ws % rest:
            raise ValueError(f"trainer.parallel: dp_replicate x cp ({rest}) does not divide the world size ({ws})")
        dp_shard = ws // rest if parallel.dp_shard == -1 else parallel.dp_shard
        return cls(parallel.dp_replicate, dp_shard, parallel.cp, parallel.ep, ws)

    @classmethod
    def from_world(cls, world_size: int | None = None) -> "ParallelDims":
        ws = dist.get_world_size() if world_size is None else world_size
        return cls(dp_replicate=1, dp_shard=ws, cp=1, ep=1, world_size=ws)

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled or self.cp_enabled or self.dp_replicate_enabled

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (a CP group shares its rows)."""
        return self.dp_replicate * self.dp_shard

    @property
    def loss_scale(self) -> int:
        """What a rank's loss (over its own tokens) is multiplied by so that FSDP2's gradient average over all
        `dp_replicate x dp_shard x cp` ranks gives the gradient of the global token mean."""
        return self.world_size

    def build_meshes(self, device_type: str) -> "Meshes":
        """The device meshes every transform uses (device_type "cpu" puts them on gloo)."""
        r, s, c = self.dp_replicate, self.dp_shard, self.cp
        main = init_device_mesh(device_type, (r, s, c), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        fsdp = init_device_mesh(device_type, (r, s * c), mesh_dim_names=("dp_replicate", "dp_shard_cp"))
        # EP groups are runs of consecutive ranks in the flattened dp_shard x cp order; "efsdp" indexes the
        # replicas of each expert shard inside one dp_replicate group.
        experts = init_device_mesh(
            device_type, (r, s * c // self.ep, self.ep), mesh_dim_names=("dp_replicate", "efsdp", "ep")
        )
        return Meshes(
            fsdp=fsdp if r > 1 else fsdp["dp_shard_cp"],
            cp=main["cp"],
            ep=experts["ep"],
            expert_replicas=experts["dp_replicate", "efsdp"]._flatten("expert_replicas")
            if r * s * c > self.ep
            else None,
        )


@dataclasses.dataclass
class Meshes:
    fsdp: DeviceMesh
    """FSDP2 (1-D over dp_shard x cp, or 2-D HSDP with dp_replicate)."""
    cp: DeviceMesh
    ep: DeviceMesh
    expert_replicas: "DeviceMesh | None"
    """Ranks holding the same expert shard (their expert gradients are averaged); None when ep is the world."""


def parallelize(
    model: nn.Module, parallel_dims: ParallelDims, config: TrainerConfig, device_type: str = "cpu"
) -> ParallelState:
    """Applies the model transforms in a fixed order (the model changes in place) and returns the
    `ParallelState` whatever runs the model is handed (arbor.trainer.parallel_state).

    Order: FP8 swap -> LoRA -> AC -> EP -> CP -> FSDP2, as torchtitan's llama3/qwen3 (whose float8 model converter
    also runs before `parallelize`):
    0. the FP8 swap (`model.fp8 = "block"`) turns eligible nn.Linear layers into FP8Linear by changing their class
       in place: it must come first because every later transform captures or wraps modules and parameters
       (AC wraps the layer forward that calls them, FSDP2 registers hooks on the modules and swaps their
       parameters for DTensors); the swap keeps parameter identity and names, so none of them notices;
    0b. LoRA (`model.lora`) adds the adapters the same way (a class swap wrapping the FP8 forward, new
       `lora_*` parameters) and freezes the rest, so FSDP2 and EP below see which parameters train;
    1. activation checkpointing wraps each decoder layer's forward; it must wrap the plain layer so that FSDP2's
       pre/post-forward hooks (all-gather, reshard) stay outside the recomputed region;
    2. expert parallel turns expert weights into ep-sharded DTensors and installs the all-to-all dispatcher: it
       must run before FSDP2, which then leaves those parameters alone (`ignored_params`);
    3. context parallel installs the CP attention in every attention module (no parameters change);
    4. FSDP2 last: it replaces the remaining parameters with DTensors sharded over dp_shard x cp (HSDP with
       dp_replicate) and registers its hooks around the already-rewritten modules.
    With one rank nothing is sharded and the model stays a plain module. The state records
    `trainer.logprob_chunk_tokens` and the tokenizer's `vocab_size` (the ids the policy spans, fewer than the
    head's rows when the head is padded) for the chunked logprobs (arbor.trainer.logprobs), the context-parallel
    state and the expert replicas.
    """
    pc = config.parallel
    meshes = parallel_dims.build_meshes(device_type) if parallel_dims.world_size > 1 else None
    apply_fp8(model, config.model)
    if config.model.lora is not None:  # after the FP8 swap: the adapter wraps the FP8 forward
        apply_lora(model, config.model.lora, config.model.init_seed)
        if config.model.lora.path is not None:
            load_adapter_into(model, load_adapter(config.model.lora.path)[1], config.model.lora.path)
    if pc.activation_checkpointing:
        apply_ac(model)
    ignored: set[nn.Parameter] = set()
    expert_replicas = None
    if parallel_dims.ep_enabled:
        if not getattr(model.args, "is_moe", False):
            raise ValueError(
                f"trainer.parallel.ep = {parallel_dims.ep} needs an MoE model; {config.model.name} is dense"
            )
        apply_ep(model, meshes.ep, pc.ep_backend, pc.ep_max_tokens_per_rank)
        ignored = set(expert_params(model))
        expert_replicas = meshes.expert_replicas
    cp = None
    if parallel_dims.cp_enabled:
        style = resolve_cp_style(pc.cp_style, model)
        cp = apply_dsa_cp(model, meshes.cp) if style == "dsa" else apply_cp(model, meshes.cp, style)
    if parallel_dims.fsdp_enabled:
        apply_fsdp(model, meshes.fsdp, compute_dtype(config), ignored)
    return ParallelState(
        logprob_chunk=config.logprob_chunk_tokens,
        vocab=build_tokenizer(config.model).vocab_size,
        cp=cp,
        expert_replicas=expert_replicas,
    )


def apply_ac(model: nn.Module) -> None:
    """Full activation checkpointing per decoder layer: only the layer inputs are kept, everything inside is
    recomputed in backward. torchtitan's `apply_ac` wraps layers in `CheckpointWrapper`, which renames
    parameters (`_checkpoint_wrapped_module.`); replacing `forward` keeps Hugging Face names for publishing."""
    for layer in model.model.layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def compute_dtype(config: TrainerConfig) -> torch.dtype:
    return getattr(torch, config.model.dtype)


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, ignored: set[nn.Parameter] | None = None
) -> None:
    """FSDP2: one group per decoder layer, then the root (embeddings, final norm, head).

    Tied embeddings stay tied because `embed_tokens` and `lm_head` both live in the root group, whose single
    FSDPParam is registered on both modules. Master weights stay fp32; a lower `model.dtype` becomes the
    all-gather/compute dtype with fp32 gradient reduction. `ignored` parameters (ep-sharded experts) are left
    as they are.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # DTensor and sympy: see clip_grad_norm

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    ignored = ignored or None
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again first in backward: keep them gathered.
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)


def reshard(model: nn.Module) -> None:
    """Frees the full parameters a forward left gathered (FSDP2 keeps the root's and the last layer's after a
    forward, `reshard_after_forward=False`), so that what follows (the optimizer) sees the sharded ones."""
    from torch.distributed.fsdp import FSDPModule  # see apply_fsdp

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def clip_grad_norm(model: nn.Module, max_norm: float, expert_replicas: DeviceMesh | None = None) -> torch.Tensor:
    """Clips by the global gradient norm over parameters that may be DTensors on different meshes (FSDP2 over
    dp_shard x cp, experts over ep), which `torch.nn.utils.clip_grad_norm_` rejects. Each parameter's squared
    norm is its local shard's, summed over the mesh dimensions it is sharded on; replicated dimensions count once.
    Expert gradients are first averaged over their `expert_replicas` (`ParallelState.expert_replicas`, see
    arbor.trainer.expert_parallel)."""
    # torch.distributed.tensor imports sympy (seconds): loaded after start-up, when the trainer is already
    # waiting for (and heartbeating about) its first rollouts.
    from torch.distributed.tensor import DTensor, Shard  # sympy: after start-up, see above

    if expert_replicas is not None:
        sync_expert_grads(model, expert_replicas.get_group())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sums: dict[tuple, torch.Tensor] = {}  # (mesh id, sharded mesh dims) -> local sum of squares
    meshes: dict[tuple, DeviceMesh] = {}
    plain: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            key = (id(g.device_mesh), tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Shard)))
            sq = g.to_local().float().pow(2).sum()
            sums[key] = sums[key] + sq if key in sums else sq
            meshes[key] = g.device_mesh
        else:
            plain.append(g.float().pow(2).sum())
    parts = plain
    for key, value in sums.items():
        for d in key[1]:
            dist.all_reduce(value, group=meshes[key].get_group(d))
        parts.append(value)
    device = parts[0].device
    total = torch.stack([p.to(device) for p in parts]).sum()
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
    return norm


def forward_context(
    parallel_dims: ParallelDims, config: TrainerConfig, device_type: str
) -> contextlib.AbstractContextManager:
    """Lower-precision compute for an unsharded model (FSDP2's MixedPrecisionPolicy covers the sharded case)."""
    dtype = compute_dtype(config)
    if parallel_dims.fsdp_enabled or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
