"""Image content parts of chat messages, without torch: what a text-only path needs to refuse them in one line
(arbor.environments, preflight); rendering them is arbor.models.vision's job."""

from __future__ import annotations

import base64
import io
from typing import Any

IMAGE_PART_TYPES = ("image_url", "image")
"""Content part types that carry an image."""


class ImageRefused(ValueError):
    """An image arbor cannot render for this model (one line naming the reason)."""


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of `messages`, in order."""
    return [
        part
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
    ]


def wire_parts(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content parts as an agent sends them over HTTP: `image` parts (a PIL image, or a path) become `image_url`
    parts (a PNG data URL, or the path), the others stay as they are."""
    out = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image":
            image = part.get("image")
            if not isinstance(image, str):  # a PIL image: saved as PNG, no PIL import needed here
                buf = io.BytesIO()
                image.save(buf, format="PNG")
                image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            part = {"type": "image_url", "image_url": {"url": image}}
        out.append(part)
    return out


def refuse_images_for_text_model(messages: list[dict], model: str) -> None:
    """One line when `messages` carry images but `model` renders text only."""
    if image_parts(messages):
        raise ImageRefused(
            f"model {model} is a text-only model and a prompt carries images: use a vision-language model "
            "(a checkpoint with a vision_config and an image processor) or send text"
        )
