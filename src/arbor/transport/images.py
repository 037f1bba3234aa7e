"""A token prompt's image inputs on the wire: the arbor extension `images` of `/v1/completions`.

A vision-language prompt sent as token ids (the orchestrator's calls: ids with each image's placeholder tokens
already expanded) carries its pixel inputs beside them, exactly as the trainer will see them:
`{"pixel_values": {"shape": [P, D], "data": base64 of float32}, "image_grid_thw": [[t, h, w], ...]}`. The client
encodes what arbor.models.vision rendered; the local inference server decodes it for the engine. numpy only.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def encode_images(pixel_values: Any, image_grid_thw: Any) -> dict[str, Any]:
    """The `images` payload of `pixel_values [P, D]` and `image_grid_thw [I, 3]` (arrays or tensors)."""
    pix = np.ascontiguousarray(np.asarray(pixel_values, dtype=np.float32))
    return {
        "pixel_values": {"shape": list(pix.shape), "data": base64.b64encode(pix.tobytes()).decode()},
        "image_grid_thw": np.asarray(image_grid_thw, dtype=np.int64).tolist(),
    }


def decode_images(payload: Any) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `encode_images`: (pixel_values float32 `[P, D]`, image_grid_thw int64 `[I, 3]`); ValueError
    naming the field on a malformed or inconsistent payload."""
    try:
        pix = payload["pixel_values"]
        shape = [int(n) for n in pix["shape"]]
        values = np.frombuffer(base64.b64decode(pix["data"], validate=True), dtype=np.float32).reshape(shape)
        grid = np.asarray(payload["image_grid_thw"], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"images payload is malformed: {e}") from None
    if values.ndim != 2 or grid.ndim != 2 or grid.shape[1] != 3 or (grid < 1).any():
        raise ValueError(f"images: pixel_values {values.shape} and image_grid_thw {grid.shape} are not [P, D], [I, 3]")
    if int(grid.prod(-1).sum()) != values.shape[0]:
        raise ValueError(
            f"images: image_grid_thw covers {int(grid.prod(-1).sum())} patches, pixel_values has {values.shape[0]}"
        )
    return values, grid
