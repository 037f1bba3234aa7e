"""The local engine's sleep mode, the twin of vLLM's (`/sleep`, `/wake_up`): a colocated run (`inference.colocate`)
puts the engine to sleep while the trainer uses the device, and wakes it for the next generate phase.

Level 1 releases the KV cache and moves the weights to host memory (on a CPU engine they already are there, and
stay); level 2 releases the weights too, which then come back from the next `/update_weights` (a colocated run
always loads the freshly trained version on wake). Released means freed: the tensors are replaced by empty ones
of the same dtype and device, so the allocator gets their memory back (measured by `tests/launch/test_colocate`),
and `wake` allocates them again at their shapes (a zeroed cache: no sequence is running across a sleep).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Released:
    """What a sleep released, to be allocated again on wake: `(owner, attribute, index, shape, dtype, device)`
    per tensor (index None: the attribute itself; else its list's item)."""

    level: int
    cache: list[tuple[object, str, int | None, torch.Size, torch.dtype, torch.device]]
    weights: list[tuple[torch.nn.Parameter, torch.Size, torch.device]]
    held_bytes: int
    """Bytes of weights and cache the sleep released (or moved to the host)."""


def cache_tensors(cache: object) -> list[tuple[str, int | None, torch.Tensor]]:
    """The tensors a KV cache object holds: its tensor attributes and the tensors in its list attributes (every
    cache of arbor's families keeps them so: KVCache k/v, DSACache rows, TokenCache tokens)."""
    out: list[tuple[str, int | None, torch.Tensor]] = []
    for name, value in vars(cache).items():
        if isinstance(value, torch.Tensor):
            out.append((name, None, value))
        elif isinstance(value, list):
            out += [(name, i, t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return out


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def engine_bytes(model: torch.nn.Module, cache: object) -> int:
    """Bytes of weights and KV cache the engine holds on its device now (what a sleep releases)."""
    weights = sum(tensor_bytes(p) for p in model.parameters())
    return weights + sum(tensor_bytes(t) for _, _, t in cache_tensors(cache))


def release(model: torch.nn.Module, cache: object, level: int) -> Released:
    """Frees the cache's tensors and, at level 2, the weights' (level 1 on an accelerator: moved to the host)."""
    held = engine_bytes(model, cache)
    freed: list[tuple[object, str, int | None, torch.Size, torch.dtype, torch.device]] = []
    for name, index, t in cache_tensors(cache):
        freed.append((cache, name, index, t.shape, t.dtype, t.device))
        empty = t.new_empty(0)
        if index is None:
            setattr(cache, name, empty)
        else:
            getattr(cache, name)[index] = empty
    weights: list[tuple[torch.nn.Parameter, torch.Size, torch.device]] = []
    for p in model.parameters():  # deduplicated: tied embeddings are one parameter
        weights.append((p, p.shape, p.device))
        if level >= 2:
            p.data = p.data.new_empty(0)
        elif p.device.type != "cpu":
            p.data = p.data.to("cpu")
    return Released(level, freed, weights, held)


def restore(released: Released) -> None:
    """Allocates again what `release` freed: a zeroed cache, and the weights back on their device (level 2:
    allocated uninitialised, for the `/update_weights` that follows the wake to fill)."""
    for owner, name, index, shape, dtype, device in released.cache:
        t = torch.zeros(shape, dtype=dtype, device=device)
        if index is None:
            setattr(owner, name, t)
        else:
            getattr(owner, name)[index] = t
    for p, shape, device in released.weights:
        if released.level >= 2:
            p.data = torch.empty(shape, dtype=p.dtype, device=device)
        elif p.device != device:
            p.data = p.data.to(device)
