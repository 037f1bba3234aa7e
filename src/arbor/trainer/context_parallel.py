"""Context parallelism for packed variable-length rows: each of `cp` ranks holds a slice of every row's tokens.

Two attention implementations, chosen by `trainer.parallel.cp_style`, both exact (same result as attention over
the whole row with its block-diagonal causal mask) in forward and backward:

- Ulysses (DeepSpeed-Ulysses): an all-to-all turns sequence sharding into head sharding, each rank attends over
  the full row for `heads / cp` heads, and a second all-to-all turns it back. Rows are split contiguously.
- Ring: key/value chunks travel around the ranks (`cp - 1` hops); each rank attends its queries to every chunk
  and merges the partial results with an online softmax (running log-sum-exp), masking by document and causal
  order on global token indices. Rows are split zig-zag (rank r holds chunks r and 2cp-1-r of 2cp), which
  balances causal work; chunks entirely in a query chunk's future are skipped.

Departures from torchtitan/PyTorch's `context_parallel` (which shards SDPA through DTensor and supports only
plain causal masks, CUDA kernels and contiguous buffers): we need document masks on packed rows and gloo, so
the collectives are `all_to_all_single` through `torch.distributed.nn.functional` (autograd sends gradients
back along the reverse route) and the block math is plain PyTorch. Padding: rows are padded to a multiple of
2 x cp with single-token documents whose outputs the loss mask ignores.

The trainer computes each local token's next-token logprob (vocabulary-chunked, arbor.trainer.logprobs) and
all-gathers them (differentiably), so every cp rank sees the full row's logprobs and the loss is unchanged; see
`packed_logprobs_cp`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import _AlltoAllSingle

from arbor.trainer.logprobs import chunked_token_logprobs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return _AlltoAllSingle.apply(group, out, out_splits, in_splits, x.contiguous())


def shard_indices(T: int, cp: int, style: str) -> list[torch.Tensor]:
    """Global token indices each rank holds for a row of `T` tokens (T a multiple of 2 x cp)."""
    if style == "ulysses":
        n = T // cp
        return [torch.arange(r * n, (r + 1) * n) for r in range(cp)]
    n = T // (2 * cp)
    return [
        torch.cat([torch.arange(r * n, (r + 1) * n), torch.arange((2 * cp - 1 - r) * n, (2 * cp - r) * n)])
        for r in range(cp)
    ]


def document_ids(seq_lens: list[int], T: int) -> torch.Tensor:
    """Document of every position of a packed row; padding positions are single-token documents."""
    lens = torch.as_tensor(seq_lens, dtype=torch.long)
    used = int(lens.sum())
    doc = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return torch.cat([doc, torch.arange(len(lens), len(lens) + T - used)])


class ContextParallel:
    """Per-model CP state: the group, the style, and the current row's layout (set by `set_row`)."""

    def __init__(self, group, style: str) -> None:
        if style not in ("ulysses", "ring"):
            raise ValueError(f"trainer.parallel.cp_style: unknown style {style!r} (ulysses | ring)")
        self.group, self.style = group, style
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.indices: list[torch.Tensor] = []
        self.doc = torch.zeros(0, dtype=torch.long)
        self.T = 0

    def padded_len(self, T: int) -> int:
        m = 2 * self.cp
        return -(-T // m) * m

    def set_row(self, seq_lens: list[int], T: int, device: torch.device) -> int:
        """Lays out a row of `T` tokens (padded to `padded_len(T)`, returned) for the next forward."""
        self.T = self.padded_len(T)
        self.indices = [i.to(device) for i in shard_indices(self.T, self.cp, self.style)]
        self.doc = document_ids([int(n) for n in seq_lens], self.T).to(device)
        return self.T

    @property
    def local_indices(self) -> torch.Tensor:
        return self.indices[self.rank]

    def mask(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        return (self.doc[q_idx][:, None] == self.doc[k_idx][None, :]) & (k_idx[None, :] <= q_idx[:, None])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`q [1, H, Tl, D]`, `k, v [1, Hkv, Tl, D]` of this rank's tokens -> attention output `[1, H, Tl, D]`."""
        if q.shape[0] != 1:
            raise ValueError("context parallel attention takes one packed row at a time")
        if self.style == "ulysses":
            return self._ulysses(q, k, v)
        return self._ring(q, k, v)

    # -- Ulysses -----------------------------------------------------------------------------------------
    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[H, Tl, D]` sequence-sharded -> `[H/cp, T, D]` head-sharded (tokens in rank order)."""
        H, Tl, D = x.shape
        P = self.cp
        rows = x.reshape(P, H // P * Tl * D)
        got = _a2a(rows, [1] * P, [1] * P, self.group).reshape(P, H // P, Tl, D)
        return got.permute(1, 0, 2, 3).reshape(H // P, P * Tl, D)

    def _heads_to_seq(self, x: torch.Tensor, Tl: int) -> torch.Tensor:
        Hp, T, D = x.shape
        P = self.cp
        rows = x.reshape(Hp, P, Tl, D).permute(1, 0, 2, 3).reshape(P, Hp * Tl * D)
        got = _a2a(rows, [1] * P, [1] * P, self.group).reshape(P * Hp, Tl, D)
        return got

    def _ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        H, Hkv, P = q.shape[1], k.shape[1], self.cp
        if H % P:
            raise ValueError(
                f"Ulysses needs num_attention_heads ({H}) divisible by parallel.cp ({P}); use cp_style = 'ring'"
            )
        if Hkv % P:  # replicate kv heads so that each rank gets whole groups
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            Hkv = H
        Tl = q.shape[2]
        qh, kh, vh = (self._seq_to_heads(t[0]) for t in (q, k, v))
        gidx = torch.cat(self.indices)
        mask = self.mask(gidx, gidx)
        out = F.scaled_dot_product_attention(
            qh[None], kh[None], vh[None], attn_mask=mask[None, None], enable_gqa=H != Hkv
        )
        return self._heads_to_seq(out[0], Tl)[None]

    # -- Ring --------------------------------------------------------------------------------------------
    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        H, Hkv, Tl, D = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
        P, r = self.cp, self.rank
        scale = 1.0 / math.sqrt(D)
        q_idx = self.indices[r]
        kv = torch.cat([k[0], v[0]], dim=0).transpose(0, 1).reshape(Tl, 2 * Hkv * D)  # rows = tokens
        out = lse = None
        for step in range(P):
            src = (r - step) % P
            if step:
                send = [Tl if j == (r + 1) % P else 0 for j in range(P)]
                recv = [Tl if j == (r - 1) % P else 0 for j in range(P)]
                kv = _a2a(kv, recv, send, self.group)
            mask = self.mask(q_idx, self.indices[src])
            if not bool(mask.any()):
                continue  # this chunk is entirely in every query's future or other documents
            kk, vv = kv.reshape(Tl, 2 * Hkv, D).transpose(0, 1).split(Hkv, dim=0)
            if Hkv != H:
                kk, vv = kk.repeat_interleave(H // Hkv, dim=0), vv.repeat_interleave(H // Hkv, dim=0)
            b_out, b_lse = _block_attention(q[0], kk, vv, mask, scale)
            if out is None:
                out, lse = b_out, b_lse
            else:
                new = torch.logaddexp(lse, b_lse)
                out = out * torch.exp(lse - new)[..., None] + b_out * torch.exp(b_lse - new)[..., None]
                lse = new
        return out[None]


_NEG = -1e30  # log-sum-exp of a row with no key in a block: finite, so merges and their gradients stay finite


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """Softmax attention of `q [H, Tq, D]` over one key block; (normalised output, log-sum-exp `[H, Tq]`)."""
    s = torch.einsum("hqd,hkd->hqk", q.float(), k.float()) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    m = s.amax(-1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m[..., None])
    denom = e.sum(-1)
    empty = denom == 0
    safe = torch.where(empty, torch.ones_like(denom), denom)
    out = torch.einsum("hqk,hkd->hqd", e / safe[..., None], v.float()).to(q.dtype)
    lse = torch.where(empty, torch.full_like(denom, _NEG), torch.log(safe) + m)
    return out, lse


def apply_cp(model: nn.Module, cp_mesh: "DeviceMesh", style: str) -> ContextParallel:
    """Installs context-parallel attention in every attention module and returns its state, which the trainer
    keeps (`ParallelState.cp`) to lay out each row."""
    ctx = ContextParallel(cp_mesh.get_group(), style)
    H = model.args.num_attention_heads
    if style == "ulysses" and H % ctx.cp:
        raise ValueError(
            f"trainer.parallel.cp_style = 'ulysses' needs num_attention_heads ({H}) divisible by "
            f"trainer.parallel.cp ({ctx.cp}); use cp_style = 'ring'"
        )
    for layer in model.model.layers:
        layer.self_attn.cp = ctx
    return ctx


class _AllGatherRows(torch.autograd.Function):
    """Concatenating all-gather along dim 0 whose backward all-reduces and keeps this rank's rows (gloo has no
    reduce-scatter, and torch.distributed.nn's all_gather falls back to a list all-to-all gloo lacks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n : (r + 1) * ctx.n], None


def gather_tokens(ctx: ContextParallel, local: torch.Tensor) -> torch.Tensor:
    """Per-token values `[Tl, ...]` of every rank -> `[T, ...]` in global order (differentiable)."""
    full = _AllGatherRows.apply(local, ctx.group)
    inverse = torch.argsort(torch.cat(ctx.indices))
    return full[inverse]


def packed_logprobs_cp(
    model: nn.Module,
    ctx: ContextParallel,
    chunk: int,
    vocab: int,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    seq_lens,
    temperature: float,
    device: torch.device,
    with_entropy: bool = True,
    routed_experts: torch.Tensor | None = None,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`packed_logprobs` under context parallelism: this rank forwards its slice of the row; each local token
    scores the token after it; the per-token results are all-gathered so every cp rank returns the whole row's
    (logprobs, entropy) `[T]`, identical to the single-rank result. `ctx` is the model's context-parallel state,
    `chunk` and `vocab` its chunked logprobs' (arbor.trainer.parallel_state.ParallelState)."""
    T = input_ids.shape[0]
    Tp = ctx.set_row([int(n) for n in seq_lens], T, device)
    ids = F.pad(input_ids.to(device), (0, Tp - T))
    pos = F.pad(position_ids.to(device), (0, Tp - T))
    idx = ctx.local_indices
    kwargs = {}
    if routed_experts is not None:
        re = routed_experts.to(device)
        re = torch.cat([re, re.new_zeros((Tp - T, *re.shape[1:]))]) if Tp > T else re
        kwargs["routed_experts"] = re[idx][None]
    if hasattr(model, "aux_valid"):  # MoE: the load-balancing loss of the whole row, cp padding excluded
        model.aux_valid, model.aux_group = idx < T, ctx.group
    nxt = ids[(idx + 1).clamp(max=Tp - 1)]
    rows = torch.arange(idx.shape[0], device=device)

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return chunked_token_logprobs(hidden[0], weight, rows, nxt, temperature, with_entropy, chunk, top_p, vocab)

    picked, ent = model(ids[idx][None], pos[idx][None], None, head_fn=head, **kwargs)
    full = gather_tokens(ctx, picked)  # full[t] = logprob of token t+1
    logprobs = torch.cat([full.new_zeros(1), full[: T - 1]])
    entropy = None
    if ent is not None:
        with torch.no_grad():
            ent = gather_tokens(ctx, ent)
            entropy = torch.cat([ent.new_zeros(1), ent[: T - 1]])
    return logprobs, entropy
