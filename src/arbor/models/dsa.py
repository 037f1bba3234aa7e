"""DeepSeek sparse attention (DSA) kernels in plain PyTorch: the lightning indexer, top-k key selection, and
multi-head latent attention (MLA) over the selected keys only; plus the latent KV slot cache the inference
engine uses for DSA models.

Shapes follow one convention: a batch of `B` rows, `Tq` queries, `Tk` keys, and a boolean mask `[B, Tq, Tk]`
(True = the query may see the key: causal order and, for packed rows, the same document). The same functions
serve the single-rank trainer forward, context parallelism (local queries against the all-gathered global
keys, see `arbor.trainer.dsa_cp`) and cached decoding, so all three select the same keys and compute alike.

Departures from DeepSeek-V3.2-Exp's reference (`inference/model.py`):

- no FP8 quantisation and no Hadamard rotation of the indexer activations (both exist for FP8 kernels; the
  rotation is orthogonal, so it leaves the bf16/fp32 dot products unchanged up to rounding);
- top-k is not differentiable, so the selection itself runs without gradient and the RL loss never reaches the
  indexer; with `trainer.indexer.train` the indexer is trained as DeepSeek does, by a separate KL loss to the
  main attention over the selected keys (arbor.models.dsa_indexer_loss: `sparse_mla` hands it each query
  chunk's attention probabilities); without it the indexer keeps its loaded weights;
- attention over the selected keys uses the "absorbed" MLA form everywhere (queries projected into the
  `kv_lora_rank` latent space, one shared latent key/value per token, output projected back per head), which the
  reference uses for decoding only; it gathers `k` latent rows per query instead of expanding per-head keys, so
  the cost is O(T x k) and never materialises a dense `[T, T]` attention matrix. The indexer's scores are
  O(T^2) work per layer, as in DSA itself (cheap: few heads, small head dim), computed in query chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from arbor.models.attention import cache_mask

QUERY_CHUNK = 128
"""Queries per block in the indexer and the sparse attention: bounds the `[chunk, Tk]` score and
`[chunk, k, kv_lora_rank]` gathered-latent buffers."""


@torch.no_grad()
def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Lightning indexer: `sum_h w[q, h] * relu(q[q, h] . k[t])` `[B, Tq, Tk]` (fp32), -inf where `mask` is False.

    `q [B, Tq, Hi, Di]` index queries, `w [B, Tq, Hi]` per-head weights (already scaled), `k [B, Tk, Di]` index
    keys (shared by the heads)."""
    B, Tq, Hi, Di = q.shape
    with torch.autocast(q.device.type, enabled=False):  # fp32 under an enclosing bf16 autocast too (SFT, one rank)
        kt = k.float().transpose(1, 2)  # [B, Di, Tk]
        logits = torch.bmm(q.float().reshape(B, Tq * Hi, Di), kt).relu_()
        score = torch.einsum("bqhk,bqh->bqk", logits.view(B, Tq, Hi, -1), w.float())
    return score.masked_fill_(~mask, float("-inf"))


MaskRows = Callable[[int, int], torch.Tensor]
"""Rows `[s, e)` of a `[B, Tq, Tk]` mask, built when asked: context parallelism passes one, so that no
`[Tq, Tk]` mask of the whole row exists (arbor.trainer.dsa_cp)."""


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | MaskRows, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_topk(index_scores(...))` one block of queries at a time, so the `[Tq, Tk]` scores (and, with a
    `MaskRows`, the mask) are never all in memory: (indices, valid) `[B, Tq, min(topk, Tk)]`."""

    def rows(s: int) -> torch.Tensor:
        e = min(s + QUERY_CHUNK, q.shape[1])
        return mask(s, e) if callable(mask) else mask[:, s:e]

    parts = [
        select_topk(index_scores(q[:, s : s + QUERY_CHUNK], w[:, s : s + QUERY_CHUNK], k, rows(s)), topk)
        for s in range(0, q.shape[1], QUERY_CHUNK)
    ]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


@torch.no_grad()
def select_topk(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `min(topk, Tk)` best keys per query: (indices `[B, Tq, k]`, valid `[B, Tq, k]`); a query with fewer
    visible keys than `k` gets masked keys too, marked invalid.

    Equal scores are common (a key whose ReLU logits are zero in every head scores exactly 0) and `topk` breaks
    such ties by memory layout, which differs between a packed row, a lone sequence, a cp shard and the cache.
    So ties go to the later key: in float64 each score gets `key index x 2^-100` added, far below the gap between
    distinct float32 scores, which makes every visible score distinct and the selection layout-independent."""
    Tk = scores.shape[-1]
    tie = torch.arange(Tk, device=scores.device, dtype=torch.float64) * 2.0**-100
    vals, idx = (scores.double() + tie).topk(min(topk, Tk), dim=-1, sorted=True)
    return idx, vals > float("-inf")


def sparse_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor,
    v_head_dim: int,
    scale: float,
    on_probs: Callable[[int, int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Attention of each query over its selected keys only, in MLA's absorbed form; output `[B, Tq, H, Dv]`.

    `q_nope [B, Tq, H, Dn]`, `q_pe [B, Tq, H, Dr]` (rotated), `c_kv [B, Tk, R]` normalised latent, `k_pe
    [B, Tk, Dr]` rotated shared rope key, `kv_b [H * (Dn + Dv), R]` the up-projection weight (`kv_b_proj`),
    `idx, valid [B, Tq, k]` from `select_topk`. The score of key t is `q_nope W_uk c_t + q_pe k_pe_t`, the value
    `W_uv c_t`, exactly as with per-head keys and values. `on_probs(s, e, p)`, when given, receives each chunk's
    attention probabilities `p [B, e - s, H, k]` (fp32, detached) of queries `[s, e)` over their selection: the
    indexer loss's target (arbor.models.dsa_indexer_loss), with no `[Tq, k]` copy kept."""
    B, Tq, H, Dn = q_nope.shape
    Tk, R = c_kv.shape[1], c_kv.shape[2]
    w = kv_b.view(H, Dn + v_head_dim, R)
    q_lat = torch.einsum("bqhd,hdr->bqhr", q_nope, w[:, :Dn])
    flat_c, flat_pe = c_kv.reshape(B * Tk, R), k_pe.reshape(B * Tk, -1)
    base = (torch.arange(B, device=idx.device) * Tk)[:, None, None]
    outs = []
    for s in range(0, Tq, QUERY_CHUNK):
        e = min(s + QUERY_CHUNK, Tq)
        rows = (idx[:, s:e] + base).reshape(-1)
        c_sel = flat_c[rows].view(B, e - s, -1, R)
        pe_sel = flat_pe[rows].view(B, e - s, -1, flat_pe.shape[-1])
        logits = torch.einsum("bqhr,bqkr->bqhk", q_lat[:, s:e], c_sel)
        logits = logits + torch.einsum("bqhd,bqkd->bqhk", q_pe[:, s:e], pe_sel)
        logits = (logits.float() * scale).masked_fill(~valid[:, s:e, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1)
        if on_probs is not None:
            on_probs(s, e, p.detach())
        p = p.to(c_sel.dtype)
        outs.append(torch.einsum("bqhk,bqkr->bqhr", p, c_sel))
    o_lat = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return torch.einsum("bqhr,hvr->bqhv", o_lat, w[:, Dn:])


def dense_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b: torch.Tensor,
    mask: torch.Tensor | None,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Dense MLA over every visible key (per-head keys and values expanded, SDPA; `mask None` = causal): the
    reference sparse attention must equal when `k` covers every key, and the baseline of `benchmarks/dsa.py`."""
    B, Tq, H, Dn = q_nope.shape
    Tk = c_kv.shape[1]
    kv = F.linear(c_kv, kv_b).view(B, Tk, H, Dn + v_head_dim)
    k_nope, v = kv.split([Dn, v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None].expand(B, Tk, H, k_pe.shape[-1])], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None],
        is_causal=mask is None,
        scale=scale,
    )
    return out.transpose(1, 2)


def mla_scale(qk_head_dim: int) -> float:
    return 1.0 / math.sqrt(qk_head_dim)


def causal_mask(T: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(T, device=device)
    return (i[None, :] <= i[:, None])[None]


class DSACache:
    """Per-layer latent KV storage `[num_slots, max_len, kv_lora_rank + qk_rope_head_dim + index_head_dim]`:
    the normalised latent, the rotated rope key and the rotated index key of every cached token (what MLA
    decoding and the indexer need; ~1/10 of a per-head KV cache at DeepSeek's sizes). Same slot protocol as
    `arbor.models.attention.KVCache`: tokens are written at their positions, `copy_slot` shares a prefill."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        width: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rows = [torch.zeros(num_slots, max_len, width, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len

    def write_and_read(
        self, layer: int, kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `kv [B, T, width]` at `positions [B, T]` of `slots [B]`; return the cached rows `[B, L, width]`
        for positions `[0, L)`, `L = max(positions) + 1`, and the mask `[B, T, L]`."""
        B, T = positions.shape
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds the KV cache length {self.max_len}")
        self.rows[layer][slots[:, None].expand(B, T), positions] = kv.to(self.rows[layer].dtype)
        L = int(positions.max()) + 1
        return self.rows[layer][:, :L].index_select(0, slots), cache_mask(positions, L)[:, 0]

    def copy_slot(self, src: int, dst: torch.Tensor | list[int], length: int) -> None:
        for t in self.rows:
            t[dst, :length] = t[src, :length]
