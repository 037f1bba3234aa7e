"""Attention masks and the slot KV cache shared by the trainer's packed forward and the inference engine.

One mask convention everywhere: a boolean tensor `[B, 1, Tq, Tk]`, True where a query may attend to a key. The
trainer packs several samples into one row and attends block-diagonally (`packed_causal_mask`); the inference
engine keeps one cache slot per sequence and attends to every cached position at or before the query's own
position (`cache_mask`), which is plain causal attention because a slot holds exactly one sequence.
"""

from __future__ import annotations

import torch


def packed_causal_mask(seq_lens: torch.Tensor | list[int], total_len: int | None = None) -> torch.Tensor:
    """Block-diagonal causal mask `[1, 1, T, T]` for samples of lengths `seq_lens` packed into one row.

    Positions past `sum(seq_lens)` (padding up to `total_len`) attend only to themselves so that softmax stays
    finite; their outputs are ignored by the loss mask.
    """
    lens = torch.as_tensor(seq_lens, dtype=torch.long)
    used = int(lens.sum())
    T = used if total_len is None else total_len
    if T < used:
        raise ValueError(f"total_len {T} is shorter than the packed samples ({used} tokens)")
    doc = torch.repeat_interleave(torch.arange(len(lens)), lens)
    if T > used:  # every padding token is its own document
        doc = torch.cat([doc, torch.arange(len(lens), len(lens) + T - used)])
    idx = torch.arange(T)
    mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None]


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
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds the KV cache length {self.max_len}")
        rows = slots[:, None].expand(B, T)
        self.k[layer][rows, :, positions] = k.transpose(1, 2)
        self.v[layer][rows, :, positions] = v.transpose(1, 2)
        L = int(positions.max()) + 1
        keys = self.k[layer][slots, :, :L]
        values = self.v[layer][slots, :, :L]
        return keys, values, cache_mask(positions, L)

    def copy_slot(self, src: int, dst: torch.Tensor | list[int], length: int) -> None:
        for kv in (self.k, self.v):
            for t in kv:
                t[dst, :, :length] = t[src, :, :length]


def cache_mask(positions: torch.Tensor, L: int) -> torch.Tensor:
    keys = torch.arange(L, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]
