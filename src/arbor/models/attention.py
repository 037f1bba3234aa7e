"""Attention masks and the slot KV cache shared by the trainer's packed forward and the inference engine.

One mask convention everywhere: a boolean tensor `[B, 1, Tq, Tk]`, True where a query may attend to a key. The
trainer packs several samples into one row and attends block-diagonally (`packed_causal_mask`); the inference
engine keeps one cache slot per sequence and attends to every cached position at or before the query's own
position (`cache_mask`), which is plain causal attention because a slot holds exactly one sequence.

Tree rows (prefix-tree merging, arbor.orchestrator.prefix_tree) and packed rows share one encoding: per token j
of the row, `subtree_end[j]`, the end of j's subtree in DFS order; token i may attend to j iff
`j <= i < subtree_end[j]`, i.e. iff j is an ancestor of i (or i itself). A packed row is the special case of
chains: `subtree_end[j]` is the end of j's sample, and a padding token's is `j + 1` (it sees only itself). On
CUDA `tree_block_mask` gives a FlexAttention block mask from the same predicate (`tree_mask_mod`), so masked-out
blocks are never computed. On CPU (FlexAttention has no CPU backward) the trainer cuts the row where no attention
crosses, into chunks of whole samples or trees (`segment_mask`), and runs SDPA on the chunks as a batch, each
under its own slice of the tree mask: a 512-token row of 40-token samples costs a tenth of the dense [T, T]
attention; a row that does not cut well gets the dense mask (`tree_mask`). Every layer shares the row's mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._triton import has_triton


def packed_causal_mask(seq_lens: torch.Tensor | list[int], total_len: int | None = None) -> torch.Tensor:
    """Block-diagonal causal mask `[1, 1, T, T]` for samples of lengths `seq_lens` packed into one row.

    Positions past `sum(seq_lens)` (padding up to `total_len`) attend only to themselves so that softmax stays
    finite; their outputs are ignored by the loss mask.
    """
    return tree_mask(subtree_end_for(seq_lens, total_len))


def subtree_end_for(seq_lens: torch.Tensor | list[int], total_len: int | None = None) -> torch.Tensor:
    """`subtree_end [T]` (int64) of a packed row: each token's sample end; padding tokens end at themselves + 1."""
    lens = torch.as_tensor(seq_lens, dtype=torch.long)
    used = int(lens.sum())
    T = used if total_len is None else total_len
    if T < used:
        raise ValueError(f"total_len {T} is shorter than the packed samples ({used} tokens)")
    ends = torch.repeat_interleave(torch.cumsum(lens, 0), lens)
    return torch.cat([ends, torch.arange(used + 1, T + 1)])


def tree_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """Dense boolean mask `[1, 1, T, T]` of a row given `subtree_end [T]`: query i sees key j iff j <= i < end[j]."""
    end = subtree_end.to(torch.long)
    idx = torch.arange(end.shape[0], device=end.device)
    return ((idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :]))[None, None]


def tree_mask_mod(subtree_end: torch.Tensor):
    """FlexAttention `mask_mod(b, h, q, kv)` of the same predicate as `tree_mask` (on `subtree_end`'s device)."""
    end = subtree_end.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    return mask_mod


def tree_block_mask(subtree_end: torch.Tensor):
    """FlexAttention `BlockMask` of a row (CUDA): blocks wholly outside the tree mask are skipped."""
    T = subtree_end.shape[0]
    return create_block_mask(tree_mask_mod(subtree_end), None, None, T, T, device=subtree_end.device)


def row_attention_mask(
    subtree_end: torch.Tensor, device: torch.device | str, block_mask: bool = True, segments: bool | None = None
):
    """What the model's attention takes for one row: a FlexAttention block mask on CUDA when `block_mask` (the
    model's attention goes through `attend`); else, when `segments` (default: `block_mask`), a `SegmentMask` where
    the row cuts well; else the dense mask."""
    end = subtree_end.to(device, non_blocking=True)
    if block_mask and end.is_cuda:
        return tree_block_mask(end)
    if block_mask if segments is None else segments:
        return segment_mask(end)
    return tree_mask(end)


@dataclass(frozen=True)
class SegmentMask:
    """A row's tree mask as S chunks of at most C tokens, each holding every key its tokens attend
    (`segment_mask`; a tree's shared root may sit in several).

    `index [S, C]`: the row position of each chunk slot, in row order (slots past a chunk's end repeat its last
    token); `mask [S, 1, C, C]`: the tree mask within each chunk (a slot past the end sees only itself, so its
    softmax stays finite; it is never read back); `gather [T]`: where row token t's output is read in the
    flattened `[S * C]` slots (a root token's first copy)."""

    index: torch.Tensor
    mask: torch.Tensor
    gather: torch.Tensor

    def chunks(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, h, T, ...]` (heads first: q, k, v) -> `[B * S, h, C, ...]`, the chunks as a batch."""
        S, C = self.index.shape
        y = x[:, :, self.index]  # [B, h, S, C, ...]
        return y.transpose(1, 2).reshape(x.shape[0] * S, x.shape[1], C, *x.shape[3:])

    def masks(self, batch: int) -> torch.Tensor:
        """The chunks' masks `[B * S, 1, C, C]` for a batch of `batch` rows."""
        return self.mask.repeat(batch, 1, 1, 1) if batch > 1 else self.mask

    def rows(self, out: torch.Tensor, batch: int) -> torch.Tensor:
        """The chunks' outputs `[B * S, h, C, D]` back in row order `[B, h, T, D]`."""
        S, C = self.index.shape
        h, D = out.shape[1], out.shape[3]
        flat = out.reshape(batch, S, h, C, D).transpose(1, 2).reshape(batch, h, S * C, D)
        return flat[:, :, self.gather]


SEGMENT_GAIN = 2.0
"""`segment_mask` cuts a row only when its chunks' attention area S x C^2 is at most T^2 / SEGMENT_GAIN: below
that the gathers cost more than the masked-out work saved."""

Piece = tuple[int, int, int, int]
"""A run of tokens a chunk holds: (prefix start, prefix length, body start, body length); the prefix is the shared
root of a prefix tree whose body is one of its children (length 0 for a whole segment)."""


def segment_mask(subtree_end: torch.Tensor) -> "SegmentMask | torch.Tensor":
    """The row's mask as chunks that no attention leaves, packed greedily in row order into chunks of at most C
    tokens; the dense `tree_mask` where that saves too little. A chunk holds whole segments (a span no attention
    enters or leaves: one packed sample, one prefix tree, one padding token) or, cascaded, a prefix tree's shared
    root with some of the children it branches into (each child attends the root and itself, so a row of groups
    that share the chat template's first tokens, one tree, still cuts by group): the root's keys are read by each
    such chunk and its outputs taken from the first. Of the two packings the smaller area wins."""
    end = subtree_end.to(torch.long)
    T = end.shape[0]
    if T < 2:  # nothing to cut (an empty row too)
        return tree_mask(end)
    ends = end.tolist()
    segments = list(zip(*_segments(end, 0, T)))
    best = min((_pack(_pieces(end, ends, segments, cascade)) for cascade in (False, True)), key=_area)
    if _area(best) * SEGMENT_GAIN > T * T:
        return tree_mask(end)
    return _segment_tensors(end, *best)


def _segments(end: torch.Tensor, lo: int, hi: int) -> tuple[list[int], list[int]]:
    """Starts and lengths of the spans of [lo, hi) that no attention enters or leaves: a token starts one when
    every earlier token's subtree ends at or before it."""
    reach = torch.cummax(end[lo:hi], 0).values  # reach[j]: the furthest token that tokens lo..lo+j attend from
    cut = torch.nonzero(torch.arange(lo + 1, hi, device=end.device) >= reach[:-1])[:, 0] + lo + 1
    starts = [lo, *cut.tolist()]
    return starts, [b - a for a, b in zip(starts, [*starts[1:], hi])]


def _pieces(end: torch.Tensor, ends: list[int], segments: list[tuple[int, int]], cascade: bool) -> list[Piece]:
    """The row's segments as pieces; `cascade` splits each prefix tree into its shared root (the leading tokens
    whose subtree is the whole segment) and the children that follow it."""
    pieces = []
    for s, n in segments:
        root = 0
        while cascade and root < n and ends[s + root] == s + n:
            root += 1
        if root in (0, n):  # one sample (every token's subtree ends with it), or no cascade
            pieces.append((s, 0, s, n))
        else:
            pieces.extend((s, root, c, m) for c, m in zip(*_segments(end, s + root, s + n)))
    return pieces


def _pack(pieces: list[Piece]) -> tuple[list[list[Piece]], int]:
    """Pieces packed greedily in row order into chunks of at most C tokens, C the longest piece with its root;
    pieces of one root in one chunk share its copy."""
    C = max(p + m for _, p, _, m in pieces)
    chunks: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        ps, p, _, m = piece
        if chunks:
            last = chunks[-1][-1]
            grow = m if (last[0], last[1]) == (ps, p) else p + m
            if size + grow <= C:
                chunks[-1].append(piece)
                size += grow
                continue
        chunks.append([piece])
        size = p + m
    return chunks, C


def _area(packing: tuple[list[list[Piece]], int]) -> int:
    chunks, C = packing
    return len(chunks) * C * C


def _segment_tensors(end: torch.Tensor, chunks: list[list[Piece]], C: int) -> "SegmentMask":
    """The `SegmentMask` of packed chunks: each chunk's row positions (padded with its last one), the tree mask
    among them, and for every row token its slot in the first chunk that holds it."""
    rows, lengths = [], []
    for chunk in chunks:
        spans, root = [], None
        for ps, p, bs, m in chunk:
            if p and (ps, p) != root:
                spans.append(range(ps, ps + p))
            root = (ps, p)
            spans.append(range(bs, bs + m))
        tokens = [t for span in spans for t in span]
        rows.append(tokens + [tokens[-1]] * (C - len(tokens)))
        lengths.append(len(tokens))
    index = torch.tensor(rows, dtype=torch.long, device=end.device)  # [S, C]
    length = torch.tensor(lengths, device=end.device)
    slot = torch.arange(C, device=end.device)
    valid = slot[None] < length[:, None]  # [S, C]
    # A chunk lists its tokens in row order, so "key at or before the query" is a slot comparison, and a valid
    # query's earlier slots are valid: only "the query is inside the key's subtree" needs the row positions.
    causal = slot[None, :] <= slot[:, None]  # [C, C]
    inside = causal & (index[:, :, None] < end[index][:, None, :]) & valid[:, :, None]
    mask = inside | ((slot[:, None] == slot[None, :]) & ~valid[:, :, None])
    flat = torch.arange(len(chunks) * C, device=end.device).view(-1, C)
    gather = torch.full((end.shape[0],), len(chunks) * C, dtype=torch.long, device=end.device)
    gather = gather.scatter_reduce(0, index[valid], flat[valid], "amin")  # a root's first copy
    return SegmentMask(index=index, mask=mask[:, None], gather=gather)


def _segment_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: SegmentMask, gqa: bool) -> torch.Tensor:
    """`attend` over a `SegmentMask`: the chunks attended as a batch under their masks, back in row order."""
    B = q.shape[0]
    out = F.scaled_dot_product_attention(
        seg.chunks(q), seg.chunks(k), seg.chunks(v), attn_mask=seg.masks(B), enable_gqa=gqa
    )
    return seg.rows(out, B)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    """Attention `[B, H, T, D]` under `mask`: None (plain causal), a boolean tensor (SDPA), a `SegmentMask` (SDPA
    over the row's chunks) or a FlexAttention `BlockMask` (flex_attention, compiled where Triton is available,
    eager otherwise)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if isinstance(mask, SegmentMask):
        return _segment_attend(q, k, v, mask, gqa)
    # "AUTO" picks the flex-decoding kernel for rows under 128 tokens, which has no training variant: on an H100
    # (torch 2.11) a 73-token row then failed to compile ("No choices to select"); the standard Triton kernel
    # serves every length, with no recompile when the length changes.
    return _flex()(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=_FLEX_KERNEL)


_FLEX_KERNEL = {"BACKEND": "TRITON"}


_FLEX = None


def _flex():
    global _FLEX
    if _FLEX is None:
        # Compiled, flex_attention runs fused Triton kernels; eager it materialises the scores (correct, slow).
        _FLEX = torch.compile(flex_attention, dynamic=True) if has_triton() else flex_attention
    return _FLEX


def position_ids_for(seq_lens: torch.Tensor | list[int], total_len: int | None = None) -> torch.Tensor:
    """Positions `[1, T]` restarting at 0 for each packed sample (padding continues from 0 too)."""
    lens = [int(n) for n in seq_lens]
    used = sum(lens)
    T = used if total_len is None else total_len
    pos = [torch.arange(n) for n in lens] + ([torch.zeros(T - used, dtype=torch.long)] if T > used else [])
    return torch.cat(pos)[None] if pos else torch.zeros(1, 0, dtype=torch.long)


class KVCache:
    """Per-layer key/value storage `[num_slots, kv_heads, max_len, head_dim]`; one slot holds one sequence.

    Tokens are written at their position, so a slot's valid length is implied by the positions written so far;
    the engine tracks it. Copying a prompt's slot into others (`copy_slot`) lets `n` samples share one prefill.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    def write_and_read(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store `k, v` `[B, Hkv, T, D]` at `positions` `[B, T]` of `slots` `[B]`; return the keys, values
        `[B, Hkv, L, D]` covering positions `[0, L)` with `L = max(positions) + 1`, and the mask `[B, 1, T, L]`."""
        B, T = positions.shape
        L = int(positions.max()) + 1
        if L > self.max_len:
            raise ValueError(f"position {L - 1} exceeds the KV cache length {self.max_len}")
        rows = slots[:, None].expand(B, T)
        self.k[layer][rows, :, positions] = k.transpose(1, 2)
        self.v[layer][rows, :, positions] = v.transpose(1, 2)
        # index_select, not advanced indexing: the same rows at a third of the cost on CPU (a quarter of a small
        # model's decode step went to this gather)
        keys = self.k[layer][:, :, :L].index_select(0, slots)
        values = self.v[layer][:, :, :L].index_select(0, slots)
        return keys, values, cache_mask(positions, L)

    def copy_slot(self, src: int, dst: torch.Tensor | list[int], length: int, layers: list[int] | None = None) -> None:
        """Copies positions `[0, length)` of slot `src` into the slots `dst`, in every layer or in `layers`."""
        for kv in (self.k, self.v):
            for i, t in enumerate(kv):
                if layers is None or i in layers:
                    t[dst, :, :length] = t[src, :, :length]


def cache_mask(positions: torch.Tensor, L: int) -> torch.Tensor:
    keys = torch.arange(L, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]
