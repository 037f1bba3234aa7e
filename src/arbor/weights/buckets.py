"""Buckets of tensors for streamed weight updates: planning, flattening into one byte buffer, and back.

A weight update moves the model a bucket at a time (`weights.bucket_mb`), so no rank ever holds more than one
bucket beyond its own shards. Both the sender and every receiver derive the same layout from the same
(name, dtype, shape) list, so one flat byte buffer per bucket crosses the wire and the receiver turns it back into
tensors that view that buffer (no copy). A tensor larger than a bucket travels alone in its own bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

ALIGN = 16  # bytes: every tensor starts on a boundary any dtype may view
TensorSpec = tuple[str, torch.dtype, list[int]]
"""(name, dtype, shape) of one tensor of an update."""

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
    )
}


def nbytes(spec: TensorSpec) -> int:
    numel = 1
    for d in spec[2]:
        numel *= d
    return numel * spec[1].itemsize


def spec_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [(k, t.dtype, list(t.shape)) for k, t in tensors.items()]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups of item indices, each at most `bucket_bytes` unless one item alone is larger."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(sizes):
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets if buckets[0] else []


def _offsets(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for s in specs:
        at += -at % ALIGN
        offsets.append(at)
        at += nbytes(s)
    return offsets, at


def flat_size(specs: Sequence[TensorSpec]) -> int:
    return _offsets(specs)[1]


def flatten(tensors: Iterable[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """One uint8 buffer holding every tensor's bytes at the offsets `unflatten` expects."""
    tensors = list(tensors)
    specs = [("", t.dtype, list(t.shape)) for t in tensors]
    offsets, total = _offsets(specs)
    device = device if device is not None else (tensors[0].device if tensors else "cpu")
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for t, at in zip(tensors, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[at : at + raw.numel()].copy_(raw, non_blocking=True)
    return buf


def unflatten(buf: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs viewing `buf`, in `specs` order."""
    offsets, total = _offsets(specs)
    if buf.numel() != total:
        raise ValueError(f"a bucket of {buf.numel()} bytes cannot hold {len(specs)} tensors of {total} bytes")
    return [
        (name, buf[at : at + nbytes((name, dtype, shape))].view(dtype).reshape(shape))
        for (name, dtype, shape), at in zip(specs, offsets)
    ]


def encode_specs(buckets: Sequence[Sequence[TensorSpec]]) -> list[list[list]]:
    """JSON-ready form of a bucket layout (dtype names without the `torch.` prefix)."""
    return [[[n, str(d).removeprefix("torch."), list(s)] for n, d, s in b] for b in buckets]


def decode_specs(raw: Sequence[Sequence[Sequence]]) -> list[list[TensorSpec]]:
    return [[(n, _DTYPES[d], list(s)) for n, d, s in b] for b in raw]
