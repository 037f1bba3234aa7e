"""A Qwen3-MoE-architecture decoder: Qwen3 attention with a sparse mixture-of-experts MLP.

Follows Hugging Face's `Qwen3MoeForCausalLM` (transformers 5): a top-k router over `softmax(x W_g^T)` (logits
and softmax in fp32), optionally renormalising the top-k weights (`norm_topk_prob`), experts stored as 3-D
tensors `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj [E, H, I]` (transformers' in-memory names; `hf.py`
converts to and from the per-expert `experts.{e}.gate_proj.weight` names its checkpoints use on disk), and the
Switch-Transformer load-balancing loss. Departures:

- an optional Qwen2-MoE-style shared expert (`shared_expert_intermediate_size > 0`: a dense SwiGLU MLP gated by
  `sigmoid(shared_expert_gate(x))`), which Qwen3-MoE itself does not have;
- router replay (R3): `forward(..., routed_experts=...)` takes the experts the inference engine chose
  (`[B, T, moe_layers, top_k]`) and uses them instead of the router's top-k, gathering their (differentiable)
  scores; every forward records the experts it used in `last_routed_experts` for the engine to return;
- token dispatch is a pluggable `dispatcher` (local sort-by-expert here; all-to-all expert parallel in
  `arbor.trainer.expert_parallel`), and expert matmuls are grouped (`grouped_mm`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce

from arbor.models.args import ModelArgs
from arbor.models.attention import KVCache
from arbor.models.qwen3 import MLP, Attention, HeadFn, Qwen3Backbone, Qwen3ForCausalLM, RMSNorm, embed, lm_logits


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of an expert-parallel DTensor parameter (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`x [M, in]` whose rows are grouped by expert (`counts [E]` rows each) times `w [E, out, in]`^T per group.

    On CUDA in bf16 with sm90+ this is one `torch._grouped_mm` kernel; elsewhere (CPU, fp32) a loop over the
    non-empty groups, which computes the same thing. The weights are cast to the activations' dtype: expert-parallel
    experts stay outside FSDP2 (arbor.trainer.parallel), so its mixed-precision policy never casts their fp32 master
    weights; this cast is that policy for them (bf16 compute, fp32 gradients into the masters).
    """
    w = w.to(x.dtype)
    if (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    ):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = x[start : start + n] @ w[e].T
        start += n
    return out


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as 3-D weights; under expert parallelism the weights are DTensors sharded on
    dim 0 and each rank computes with its local experts."""

    grad_scale = 1.0
    """What the experts' weight gradients are multiplied by: 1 / ep under expert parallelism
    (arbor.trainer.expert_parallel). Part of the forward rather than a hook on the parameters, which a model built
    on the meta device replaces when it allocates them (arbor.models.materialize)."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def local(self, name: str) -> torch.Tensor:
        """This rank's experts of the weight `name` (all of them without expert parallelism), `grad_scale` applied
        to its gradient."""
        t = _local(getattr(self, name))
        return t if self.grad_scale == 1.0 or not t.requires_grad else _ScaleGrad.apply(t, self.grad_scale)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of `x` grouped by local expert, `counts[e]` rows for local expert e."""
        gate, up = grouped_mm(x, self.local("gate_up_proj"), counts).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.local("down_proj"), counts)


class TopKRouter(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(args.num_experts, args.hidden_size))

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits `[N, E]`, top-k weights `[N, k]`, expert ids `[N, k]`) for tokens `x [N, H]`; with
        `replay [N, k]` those experts are used and their scores gathered (router replay)."""
        # fp32 router logits whatever the compute dtype: the trainer and the local engine run this same code, and
        # bf16 logits flip near-tied top-k choices between them, a known source of growing MoE mismatch. An
        # enclosing autocast (the SFT warm-up, a one-rank bf16 trainer) would run the matmul in bf16 all the same.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        probs = torch.softmax(logits, dim=-1)
        if replay is None:
            top, idx = torch.topk(probs, self.top_k, dim=-1)
        else:
            idx = replay.to(device=x.device, dtype=torch.long)
            top = probs.gather(-1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(x.dtype), idx


class Dispatcher(Protocol):
    """Sends each token to its top-k experts, runs them, and returns the weighted sum `[N, H]`."""

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor: ...


def sort_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order of the flattened (token, k) pairs sorted by expert, token of each sorted pair, counts `[E]`)."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // indices.shape[-1], counts


def combine(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, token: torch.Tensor):
    out = out * weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add(0, token, out.to(x.dtype))


def local_dispatch(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: GroupedExperts):
    """All experts on this rank: sort the (token, k) pairs by expert, one grouped matmul, weighted scatter-add."""
    order, token, counts = sort_by_expert(indices, experts.num_experts)
    return combine(x, experts(x[token], counts), weights, order, token)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = TopKRouter(args)
        self.experts = GroupedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        self.dispatcher: Dispatcher = local_dispatch
        self.shared_expert: MLP | None = None
        if args.shared_expert_intermediate_size:
            self.shared_expert = MLP(args, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output `[B, T, H]`, router logits `[B*T, E]`, chosen experts `[B*T, k]`)."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        logits, weights, idx = self.gate(flat, None if replay is None else replay.reshape(B * T, -1))
        y = self.dispatcher(flat, weights, idx, self.experts)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y.reshape(B, T, H), logits, idx


class MoEDecoderLayer(nn.Module):
    moe_cls: type[nn.Module] = MoE
    """The sparse block of its MoE layers: `forward(h, replay)` -> (output, router logits for the auxiliary loss
    or None, chosen experts)."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.is_moe = args.is_moe_layer(layer_idx)
        self.mlp = self.moe_cls(args) if self.is_moe else MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, rope, position_ids, attn_mask, kv_cache, cache_slots, replay=None):
        """(hidden states, router logits or None, chosen experts or None)."""
        x = x + self.self_attn(self.input_layernorm(x), rope, position_ids, attn_mask, kv_cache, cache_slots)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), None, None
        y, logits, idx = self.mlp(h, replay)
        return x + y, logits, idx


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Same forward contract as the dense model, plus `routed_experts` (router replay). After each forward,
    `last_routed_experts [B, T, moe_layers, k]` holds the experts used and `aux_loss` the load-balancing loss
    (already multiplied by `router_aux_loss_coef`; a scalar tensor with gradient; None for routers without one)."""

    layer_cls: type[nn.Module] = MoEDecoderLayer

    def __init__(self, args: ModelArgs) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.model = Qwen3Backbone(args, layer_cls=self.layer_cls)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList()  # MTP draft modules are dense-only (ModelArgs.mtp_depth)
        self.last_routed_experts: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        # Set by context parallelism (arbor.trainer.context_parallel): which local tokens count in the aux loss
        # (not the row's cp padding) and the group whose statistics it sums. Prefix-tree merged rows set per-token
        # counts instead (how many samples share each node, arbor.trainer.forward.tree_logprobs).
        self.aux_valid: torch.Tensor | None = None
        self.aux_group = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_slots: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        routed_experts: torch.Tensor | None = None,
        head_fn: HeadFn | None = None,
    ) -> torch.Tensor:
        B, T = input_ids.shape
        n_moe = len(self.args.moe_layers)
        if routed_experts is not None and tuple(routed_experts.shape) != (B, T, n_moe, self.args.num_experts_per_tok):
            raise ValueError(
                f"routed_experts has shape {tuple(routed_experts.shape)}, expected "
                f"{(B, T, n_moe, self.args.num_experts_per_tok)} (tokens, MoE layers, top_k)"
            )
        x, rope, position_ids = embed(self.model, input_ids, position_ids)
        all_logits, all_idx = [], []
        for layer in self.model.layers:
            replay = None
            if routed_experts is not None and layer.is_moe:
                replay = routed_experts[:, :, len(all_idx)]
            x, logits, idx = layer(x, rope, position_ids, attn_mask, kv_cache, cache_slots, replay)
            if idx is not None:
                all_idx.append(idx)
            if logits is not None:
                all_logits.append(logits)
        self.last_routed_experts = torch.stack(all_idx, dim=1).reshape(B, T, n_moe, -1).detach() if all_idx else None
        self.aux_loss = None
        if self.training and all_logits:
            self.aux_loss = load_balancing_loss(all_logits, all_idx, self.args, self.aux_valid, self.aux_group)
        return lm_logits(self, x, logits_to_keep, head_fn)


def load_balancing_loss(
    logits: list[torch.Tensor],
    indices: list[torch.Tensor],
    args: ModelArgs,
    valid: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """Switch Transformer's loss as transformers computes it for Qwen3-MoE: `E * sum_e f_e * P_e` over all MoE
    layers' tokens, f_e = top-k assignments to expert e per token, P_e = mean router probability; times the
    coefficient. Counts this rank's tokens (padding included, as transformers does without a mask) except
    where `valid [N]` is False (or counts each token `valid[t]` times when it holds counts: a merged trie node
    stands for that many sample tokens); with `group` (context parallel) the counts and probability sums are
    summed over the group first, so every rank gets the loss of the whole row (the sum's backward all-reduces
    gradients, matching how the CP trainer treats its duplicated policy loss)."""
    E, k = args.num_experts, args.num_experts_per_tok
    probs = torch.cat([torch.softmax(lg.float(), dim=-1) for lg in logits])
    chosen = torch.cat([i.reshape(-1) for i in indices])
    w = probs.new_ones(logits[0].shape[0]) if valid is None else valid.to(probs.dtype).reshape(-1)
    w = w.repeat(len(logits))
    counts = torch.zeros(E, dtype=probs.dtype, device=probs.device).index_add(0, chosen, w.repeat_interleave(k))
    psum = (probs * w[:, None]).sum(0)
    n = w.sum()
    if group is not None:
        stats = torch.cat([counts, n[None]]).detach()
        dist.all_reduce(stats, group=group)
        counts, n = stats[:E], stats[E]
        psum = all_reduce(psum, group=group)
    return args.router_aux_loss_coef * E * ((counts / n) * (psum / n)).sum()
