"""Context parallelism for packed variable-length rows: each of `cp` ranks holds a slice of every row's tokens.

Two attention implementations, chosen by `trainer.parallel.cp_style`, both exact (same result as attention over
the whole row with its block-diagonal causal mask) in forward and backward:

- Ulysses (DeepSpeed-Ulysses): an all-to-all turns sequence sharding into head sharding, each rank attends over
  the full row for `heads / cp` heads, and a second all-to-all turns it back. Rows are split contiguously.
- Ring: key/value chunks travel around the ranks (`cp - 1` hops); each rank attends its queries to every chunk
  and merges the partial results with an online softmax (running log-sum-exp), masking by document and causal
  order on global token indices. Rows are split zig-zag (rank r holds chunks r and 2cp-1-r of 2cp), which
  balances causal work; chunks entirely in a query chunk's future are skipped.

No mask quadratic in the row's length exists on either path: Ulysses runs causal attention one document at
a time (a flash kernel, no mask), and ring attention scores `QUERY_BLOCK` queries at a time against a key
chunk, building the mask of that block from document ids and global indices, and recomputes the block in the
backward (`_BlockAttention`): what stays alive is linear in the row (`benchmarks/cp_memory.py`).

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
        self.block = QUERY_BLOCK
        """Queries per block of ring attention's scores (tests set it small to cross block edges)."""

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
        """`[len(q_idx), len(k_idx)]`: same document, causal order (callers pass blocks, never the whole row)."""
        return (self.doc[q_idx][:, None] == self.doc[k_idx][None, :]) & (k_idx[None, :] <= q_idx[:, None])

    def sees_any(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        """`[len(q_idx)]`: whether each query sees at least one of the keys (its document's first key among
        them comes no later than it), in memory linear in the row."""
        first = torch.full((self.T,), self.T, dtype=torch.long, device=k_idx.device)
        first = first.scatter_reduce(0, self.doc[k_idx], k_idx, "amin")
        return first[self.doc[q_idx]] <= q_idx

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
        if Hkv != H:  # whole groups per rank; expanded so that SDPA keeps its flash kernel
            kh, vh = kh.repeat_interleave(H // Hkv, dim=0), vh.repeat_interleave(H // Hkv, dim=0)
        # Rows are split contiguously, so the gathered tokens are in row order and each document is one run.
        sizes = torch.unique_consecutive(self.doc, return_counts=True)[1].tolist()
        parts = [
            F.scaled_dot_product_attention(qd[None], kd[None], vd[None], is_causal=True)[0] if n > 1 else vd
            for n, qd, kd, vd in zip(sizes, qh.split(sizes, 1), kh.split(sizes, 1), vh.split(sizes, 1))
        ]  # a one-token document (padding, or a sample of one token) attends to itself: its value
        return self._heads_to_seq(torch.cat(parts, dim=1), Tl)[None]

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
            k_idx = self.indices[src]
            if not bool(self.sees_any(q_idx, k_idx).any()):
                continue  # this chunk is entirely in every query's future or other documents
            kk, vv = kv.reshape(Tl, 2 * Hkv, D).transpose(0, 1).split(Hkv, dim=0)
            if Hkv != H:
                kk, vv = kk.repeat_interleave(H // Hkv, dim=0), vv.repeat_interleave(H // Hkv, dim=0)
            b_out, b_lse = _BlockAttention.apply(q[0], kk, vv, self, k_idx, scale)
            if out is None:
                out, lse = b_out, b_lse
            else:
                new = torch.logaddexp(lse, b_lse)
                out = out * torch.exp(lse - new)[..., None] + b_out * torch.exp(b_lse - new)[..., None]
                lse = new
        return out.to(q.dtype)[None]


QUERY_BLOCK = 512
"""Queries per block in ring attention: a block's fp32 scores are `[H, QUERY_BLOCK, Tl]`, linear in the row."""

_NEG = -1e30  # log-sum-exp of a row with no key in a block: finite, so merges and their gradients stay finite


def _block_scores(ctx: ContextParallel, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx, scale: float):
    """Scaled fp32 scores `[H, b, Tk]` of a query block against a key chunk, -inf where the mask forbids."""
    s = torch.einsum("hqd,hkd->hqk", q.float(), k.float()) * scale
    return s.masked_fill_(~ctx.mask(q_idx, k_idx)[None], float("-inf"))


class _BlockAttention(torch.autograd.Function):
    """Softmax attention of `q [H, Tq, D]` over one key chunk `k, v [H, Tk, D]` under the context's document +
    causal mask: (output normalised within the chunk, log-sum-exp `[H, Tq]`), both differentiable, the
    log-sum-exp being what the ring's online-softmax merge weighs chunks by. Scores exist one block of
    `ctx.block` queries at a time, and the backward recomputes them from the saved output and log-sum-exp (as
    flash attention does), so memory is linear in the row. Both results are fp32 whatever the input dtype. A
    query that sees no key of the chunk gets output 0 and log-sum-exp `_NEG`."""

    @staticmethod
    def forward(fctx, q, k, v, ctx: ContextParallel, k_idx: torch.Tensor, scale: float):
        H, Tq, _ = q.shape
        q_idx = ctx.indices[ctx.rank]
        out = q.new_zeros((H, Tq, v.shape[-1]), dtype=torch.float32)
        lse = q.new_full((H, Tq), _NEG, dtype=torch.float32)
        vf = v.float()
        for s in range(0, Tq, ctx.block):
            e = min(s + ctx.block, Tq)
            if not bool(ctx.sees_any(q_idx[s:e], k_idx).any()):
                continue
            sc = _block_scores(ctx, q[:, s:e], k, q_idx[s:e], k_idx, scale)
            m = sc.amax(-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp(sc - m)
            denom = p.sum(-1)
            safe = torch.where(denom == 0, torch.ones_like(denom), denom)
            out[:, s:e] = torch.einsum("hqk,hkd->hqd", p / safe[..., None], vf)
            lse[:, s:e] = torch.where(denom == 0, torch.full_like(denom, _NEG), torch.log(safe) + m[..., 0])
        fctx.save_for_backward(q, k, v, k_idx, out, lse)
        fctx.ctx, fctx.scale = ctx, scale
        return out, lse  # fp32: the ring merges blocks in fp32 and casts once

    @staticmethod
    def backward(fctx, d_out, d_lse):
        q, k, v, k_idx, out, lse = fctx.saved_tensors
        ctx, scale = fctx.ctx, fctx.scale
        q_idx = ctx.indices[ctx.rank]
        kf, vf = k.float(), v.float()
        dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(kf), torch.zeros_like(vf)
        d_out = torch.zeros_like(out) if d_out is None else d_out.float()
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse.float()
        for s in range(0, q.shape[1], ctx.block):
            e = min(s + ctx.block, q.shape[1])
            if not bool(ctx.sees_any(q_idx[s:e], k_idx).any()):
                continue
            sc = _block_scores(ctx, q[:, s:e], k, q_idx[s:e], k_idx, scale)
            p = torch.exp(sc - lse[:, s:e, None])  # the block's softmax: 0 where masked
            do = d_out[:, s:e]
            dv += torch.einsum("hqk,hqd->hkd", p, do)
            dp = torch.einsum("hqd,hkd->hqk", do, vf)
            # d lse / d score = p, so the log-sum-exp's gradient joins the softmax's: dS = p (dP - D + d_lse)
            delta = (do * out[:, s:e]).sum(-1) - d_lse[:, s:e]
            ds = p * (dp - delta[..., None]) * scale
            dq[:, s:e] = torch.einsum("hqk,hkd->hqd", ds, kf)
            dk += torch.einsum("hqk,hqd->hkd", ds, q[:, s:e].float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


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
