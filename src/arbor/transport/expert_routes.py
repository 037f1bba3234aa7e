"""Router-replay payloads on the wire: the experts every token was routed to, `[tokens, moe_layers, top_k]`.

The inference server encodes them into its completion choices (`routed_experts`); the orchestrator's client
decodes them into the batch the trainer replays. numpy only: neither side needs torch for it.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def encode_routes(routes: np.ndarray) -> dict[str, Any]:
    """Router-replay payload for JSON: `{"dtype", "shape", "data": base64 of the raw bytes}` (no per-element work)."""
    return {
        "dtype": str(routes.dtype),
        "shape": list(routes.shape),
        "data": base64.b64encode(routes.tobytes()).decode(),
    }


def decode_routes(payload: dict[str, Any] | list) -> np.ndarray:
    """Inverse of `encode_routes`; raises ValueError naming the field on a malformed payload.

    A plain nested list `[tokens][layers][top_k]` (how a vLLM server returns routed experts) is accepted too."""
    if isinstance(payload, list):
        arr = np.asarray(payload)
        if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"routed_experts: expected a [tokens, layers, top_k] integer array, got shape {arr.shape}")
        return arr.astype(np.int16 if arr.max(initial=0) > 255 else np.uint8)
    try:
        dtype = np.dtype(payload["dtype"])
        if dtype not in (np.uint8, np.int16):
            raise ValueError(f"dtype {dtype} is not uint8 or int16")
        arr = np.frombuffer(base64.b64decode(payload["data"]), dtype=dtype)
        return arr.reshape([int(n) for n in payload["shape"]])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"routed_experts payload is malformed: {e}") from None
