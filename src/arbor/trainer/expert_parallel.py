"""Expert parallelism: each rank of an `ep` group holds `num_experts / ep` experts; tokens travel to their
experts' rank and back.

Two dispatch backends behind the model's `Dispatcher` interface (`arbor.models.qwen3_moe`):

- `AllToAllDispatcher` ("all_to_all"): sort (token, k) pairs by expert, exchange per-expert counts, send rows
  with `all_to_all_single` (uneven splits; autograd through `torch.distributed.nn.functional`), regroup the
  received rows by local expert, run one grouped matmul, and send the outputs back the same way. Works on gloo
  (CPU) and NCCL. torchtitan 0.3's `AllToAllTokenDispatcher` is bound to its Configurable/spmd_types model
  stack (SPMD mesh annotations, its own MoE module and config), which our plain-PyTorch Qwen3-MoE does not
  use, hence a small dispatcher of our own with the same algorithm.
- `DeepEPDispatcher` ("deepep", CUDA only): torchtitan's DeepEP v2 wrapper (`dispatch_tokens`/`combine_tokens`);
  `deep_ep` is an optional install and selecting it without one fails at start-up with one line.

Expert weights become DTensors sharded on dim 0 over the ep mesh, so torch.distributed.checkpoint saves and
reshards them like any other parameter and a full state dict (weight publishing) gathers them.

Gradients: the all-to-all backward already sums every ep rank's contribution into the local experts' gradients,
and the trainer scales each rank's loss by dp_size so that FSDP's average gives the token mean; expert gradients
are therefore divided by `ep` (a tensor hook), and when the data-parallel world is larger than `ep` they are
averaged over the replicas (`sync_expert_grads`, called before clipping).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import _AlltoAllSingle

from arbor.models.qwen3_moe import GroupedExperts, MoE, combine, sort_by_expert

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return _AlltoAllSingle.apply(group, out, out_splits, in_splits, x.contiguous())


class AllToAllDispatcher:
    """Token dispatch/combine over an expert-parallel process group with `all_to_all_single`."""

    def __init__(self, group, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"trainer.parallel.ep ({self.ep}) must divide the model's num_experts ({num_experts})")
        self.num_experts = num_experts
        self.local = num_experts // self.ep

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: GroupedExperts):
        order, token, counts = sort_by_expert(indices, self.num_experts)
        # Rows sorted by global expert are also grouped by destination rank (experts are contiguous per rank).
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [ep * local]: per source, per expert
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv_matrix = recv_counts.view(self.ep, self.local)
        recv = recv_matrix.sum(1).tolist()
        received = _a2a(x[token], recv, send, self.group)
        # Received rows are ordered (source rank, local expert); the grouped matmul wants (local expert, source).
        seg = torch.repeat_interleave(
            torch.arange(self.ep * self.local, device=x.device), recv_matrix.reshape(-1).to(x.device)
        )
        expert_of_row = seg % self.local
        regroup = torch.argsort(expert_of_row * self.ep + seg // self.local, stable=True)
        out = experts(received[regroup], recv_matrix.sum(0))
        back = torch.empty_like(regroup)
        back[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        returned = _a2a(out[back], send, recv, self.group)
        return combine(x, returned, weights, order, token)


class DeepEPDispatcher:
    """DeepEP v2 (NVLink/RDMA kernels) through torchtitan's wrapper; CUDA only."""

    def __init__(self, group, num_experts: int, top_k: int, hidden: int, max_tokens_per_rank: int) -> None:
        try:  # optional: torchtitan is in the `gpu` extra, DeepEP (deep_ep) is installed on its own
            from torchtitan.distributed.deepep import deepep  # optional GPU extra, see above
        except ImportError as e:
            raise ImportError(
                "trainer.parallel.ep_backend = 'deepep' needs DeepEP v2 (deep_ep) and torchtitan (the "
                f"`gpu` extra): {e}"
            ) from None
        self._deepep = deepep
        self.group, self.num_experts = group, num_experts
        self.ep = dist.get_world_size(group)
        self.local = num_experts // self.ep
        self.top_k, self.hidden, self.max_tokens = top_k, hidden, max_tokens_per_rank

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: GroupedExperts):
        d = self._deepep
        d.get_buffer(self.group, hidden=self.hidden, num_max_tokens_per_rank=self.max_tokens, num_topk=self.top_k)
        n = torch.tensor([x.shape[0]], device=x.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)  # layout stride: the largest rank's tokens
        if int(n.item()) > self.max_tokens:  # a standalone trainer's batch: rl refuses such configs up front
            raise ValueError(
                f"a rank dispatches {int(n.item())} tokens, more than trainer.parallel.ep_max_tokens_per_rank "
                f"({self.max_tokens}), DeepEP's buffer: raise it or lower the micro-batch tokens"
            )
        routed, counts, state = d.dispatch_tokens(
            x, indices, weights, self.local, self.num_experts, num_tokens_per_rank=int(n.item())
        )
        out = d.combine_tokens(experts(routed, counts), state)
        d.sync_combine()
        return out


def apply_ep(model: nn.Module, ep_mesh: "DeviceMesh", backend: str = "all_to_all", max_tokens: int = 8192) -> None:
    """Shards every MoE layer's experts over `ep_mesh` (dim 0, DTensor) and installs the dispatcher."""
    from torch.distributed.tensor import Shard, distribute_tensor  # imports sympy (seconds): only EP runs pay

    group = ep_mesh.get_group()
    ep = ep_mesh.size()
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if backend == "deepep":
            a = model.args
            module.dispatcher = DeepEPDispatcher(
                group, experts.num_experts, a.num_experts_per_tok, a.hidden_size, max_tokens
            )
        elif backend == "all_to_all":
            module.dispatcher = AllToAllDispatcher(group, experts.num_experts)
        else:
            raise ValueError(f"trainer.parallel.ep_backend: unknown backend {backend!r} (all_to_all | deepep)")
        for name in expert_param_names(experts):
            full = getattr(experts, name)
            sharded = nn.Parameter(
                distribute_tensor(full.detach(), ep_mesh, [Shard(0)]), requires_grad=full.requires_grad
            )  # a LoRA base stays frozen
            setattr(experts, name, sharded)
        experts.grad_scale = 1.0 / ep


def expert_param_names(experts: GroupedExperts) -> list[str]:
    """The per-expert (dim 0) parameters of `experts`: its weights and, with LoRA, their adapters."""
    return ["gate_up_proj", "down_proj"] + [
        f"lora_{p}_{ab}" for p in getattr(experts, "lora_projs", ()) for ab in ("A", "B")
    ]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [getattr(m, n) for m in model.modules() if isinstance(m, GroupedExperts) for n in expert_param_names(m)]


def sync_expert_grads(model: nn.Module, replica_group) -> None:
    """Averages expert gradients over the ranks that hold the same experts (data-parallel replicas of EP)."""
    if replica_group is None or dist.get_world_size(replica_group) == 1:
        return
    for p in expert_params(model):
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=replica_group)  # gloo has no AVG
            g.div_(dist.get_world_size(replica_group))
