"""arbor's attention inside transformers' modules: the `"arbor"` entry of transformers' attention-function and
mask registries, and the engine's caches for transformers models (arbor.models.hf_causal).

transformers calls `arbor_attention(module, q, k, v, ...)` from every attention layer with the layer's own
scaling, sliding window, sinks (gpt-oss) and soft-capping; arbor's mask, positions and cache reach it as the
`arbor` keyword the decoder forwards to every layer (`ArborAttention`; a keyword, not a global, so activation
checkpointing's recomputation sees it too). A layer that does not pass its keywords on to its attention
(StableLM, Nemotron) gets them there by `carry_to_attention`, which holds the layer's `arbor` for the length of
its own forward (and of that forward's recomputation). transformers' own mask building is skipped (the mask function
returns None): the mask is arbor's, dense or a packed row's chunks (`SegmentMask`: each chunk attended alone), and
combined here with the layer's sliding window by position.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from arbor.models.attention import KVCache, SegmentMask

ATTN_IMPLEMENTATION = "arbor"
_LAYER_CONTEXT: contextvars.ContextVar["ArborAttention | None"] = contextvars.ContextVar("arbor_layer", default=None)


@dataclasses.dataclass
class ArborAttention:
    """What one forward's attention layers read: the mask `[B, 1, T, T]` or a `SegmentMask` (None: causal),
    positions `[B, T]`, and in the engine the slot KV cache and each row's slot."""

    mask: torch.Tensor | SegmentMask | None
    positions: torch.Tensor
    kv_cache: KVCache | None
    slots: torch.Tensor | None
    counter: "CallCounter" = dataclasses.field(default_factory=lambda: CallCounter())
    """Attention layers that ran through `arbor_attention` in this forward (checked against the model's
    attention layers: a layer that attends by itself would ignore arbor's mask)."""

    @property
    def calls(self) -> int:
        return self.counter.calls


class CallCounter:
    """A plain object, so the copies FSDP2's input casting makes of `ArborAttention` (dataclasses, lists and
    dicts are rebuilt on the way into each layer) all count into the one the forward checks."""

    def __init__(self) -> None:
        self.calls = 0


def arbor_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    arbor: ArborAttention | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention `[B, T, H, D]` of `query [B, H, T, D]` against `key, value [B, Hkv, S, D]` under arbor's mask."""
    arbor = arbor if arbor is not None else _LAYER_CONTEXT.get()
    if arbor is None:
        raise ValueError(
            f"the 'arbor' attention implementation runs inside arbor's model forward only, and "
            f"{type(module).__name__} was called without the `arbor` context (its decoder does not pass it on)"
        )
    arbor.counter.calls += 1
    pos_q = arbor.positions
    layer = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap, sinks=s_aux)
    if arbor.kv_cache is not None:
        key, value, mask = arbor.kv_cache.write_and_read(module.layer_idx, key, value, arbor.slots, pos_q)
        pos_k = torch.arange(key.shape[2], device=key.device)[None]
    elif isinstance(arbor.mask, SegmentMask):  # a packed row cut into chunks (arbor.models.attention)
        seg, B = arbor.mask, query.shape[0]
        pos = seg.chunks(pos_q[:, None])[:, 0]
        out = _attend(seg.chunks(query), seg.chunks(key), seg.chunks(value), seg.masks(B), pos, pos, **layer)
        return seg.rows(out, B).transpose(1, 2).contiguous(), None
    else:
        mask, pos_k = arbor.mask, pos_q
    return _attend(query, key, value, mask, pos_q, pos_k, **layer).transpose(1, 2).contiguous(), None


_CARRYING: dict[type, type] = {}


def carry_to_attention(layer: torch.nn.Module) -> None:
    """Makes the `arbor` keyword of `layer`'s forward reach its attention even where the layer does not pass it on:
    the layer's class becomes a subclass (same name) whose forward holds the keyword for its length. A class, not
    an instance attribute, so a deep copy of the model runs its own layers; activation checkpointing wraps this
    forward (arbor.trainer.parallel.apply_ac), so the recomputation in backward runs through it again."""
    cls = type(layer)
    if cls not in _CARRYING:

        def forward(self, *args, **kwargs):
            token = _LAYER_CONTEXT.set(kwargs.get("arbor"))
            try:
                return cls.forward(self, *args, **kwargs)
            finally:
                _LAYER_CONTEXT.reset(token)

        attrs = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _CARRYING[cls] = type(cls.__name__, (cls,), attrs)
    layer.__class__ = _CARRYING[cls]


def _attend(q, k, v, mask, pos_q, pos_k, dropout, scaling, sliding_window, softcap, sinks) -> torch.Tensor:
    """`[B, H, T, D]` under `mask` (None: causal) narrowed to the layer's sliding window by position, with the
    layer's scaling, soft-capping and sinks."""
    if mask is None and (sliding_window or softcap or sinks is not None):
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]
    if sliding_window and mask is not None:
        mask = mask & ((pos_q[:, None, :, None] - pos_k[:, None, None, :]) < sliding_window)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return _explicit(q, k, v, mask, scaling, softcap, sinks, dropout)


def _explicit(q, k, v, mask, scaling, softcap, sinks, dropout) -> torch.Tensor:
    """Attention with soft-capped scores and/or per-head sink logits (gpt-oss), as transformers' eager path."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=scores.dtype)
    return F.dropout(probs, p=dropout) @ v


def _no_mask(*args, **kwargs) -> None:
    """transformers' mask building, skipped: arbor's attention function applies arbor's mask."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, arbor_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


class SlotCache(KVCache):
    """arbor's slot KV cache with each layer allocated on its first write, at that layer's key and value shapes
    (transformers models may differ per layer, and recurrent layers have none)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, dtype: torch.dtype, device) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.num_slots, self.max_len, self.dtype, self.device = num_slots, max_len, dtype, device

    def write_and_read(self, layer, k, v, slots, positions):
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(self.num_slots, k.shape[1], self.max_len, k.shape[3])
            self.v[layer] = v.new_zeros(self.num_slots, v.shape[1], self.max_len, v.shape[3])
        return super().write_and_read(layer, k, v, slots, positions)

    def copy_slot(self, src: int, dst, length: int, layers: list[int] | None = None) -> None:
        for kv in (self.k, self.v):
            for i, t in enumerate(kv):
                if t is not None and (layers is None or i in layers):
                    t[dst, :, :length] = t[src, :, :length]


class TokenCache:
    """A recurrent model's engine cache: each slot's token ids, by position. A forward writes its tokens and
    recomputes every row's sequence from position 0 (no recurrent state is kept between forwards: exact, at
    the cost of a full forward per step, which the CPU path's tiny models afford)."""

    def __init__(self, num_slots: int, max_len: int, device) -> None:
        self.tokens = torch.zeros(num_slots, max_len, dtype=torch.long, device=device)
        self.num_slots, self.max_len = num_slots, max_len

    def forward(
        self, backbone: Callable, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states `[B, T, H]` at `positions` once `input_ids` are written there; each row's sequence is
        positions `[0, its last column's position]` (left padding's later positions are never read)."""
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds the KV cache length {self.max_len}")
        B, T = input_ids.shape
        self.tokens[slots[:, None].expand(B, T), positions] = input_ids
        rows = []
        for b in range(B):
            n = int(positions[b, -1]) + 1
            pos = torch.arange(n, device=input_ids.device)[None]
            h = backbone(self.tokens[slots[b], :n][None], pos, ArborAttention(None, pos, None, None))
            rows.append(h[0, positions[b].clamp(max=n - 1)])
        return torch.stack(rows)

    def copy_slot(self, src: int, dst, length: int, layers: list[int] | None = None) -> None:
        self.tokens[dst, :length] = self.tokens[src, :length]
