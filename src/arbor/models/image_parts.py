"""Image content parts of chat messages, without torch: what a text-only path needs to refuse them in one line
(arbor.environments, preflight); rendering them is arbor.models.vision's job."""

from __future__ import annotations

import base64
import io
from pathlib import Path
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


def local_image_path(part: dict) -> str | None:
    """The local file an image part names (a path or a `file://` URL); None for a data URL, an http(s) URL (refused
    when rendered) or an in-memory image."""
    if part.get("type") == "image":
        source = part.get("image", part.get("url"))
    else:
        url = part.get("image_url")
        source = url.get("url") if isinstance(url, dict) else url
    if not isinstance(source, str) or not source or source.startswith(("data:", "http://", "https://")):
        return None
    return source.removeprefix("file://")


def refuse_local_images_outside(messages: list[dict], dirs: list[Path] | None) -> None:
    """One line when an image part names a local file outside `dirs` (resolved, symlinks followed: a link out of
    an allowed directory is outside it). None allows every file; [] refuses every local path."""
    if dirs is None:
        return
    for part in image_parts(messages):
        path = local_image_path(part)
        if path is None:
            continue
        real = Path(path).resolve()
        if not any(real.is_relative_to(d) for d in dirs):
            where = ", ".join(str(d) for d in dirs) if dirs else "none are allowed"
            raise ImageRefused(
                f"image file {path[:80]!r} is outside the gateway's image_dirs ({where}): send it as a data URL, "
                "or list its directory in [orchestrator.gateway] image_dirs"
            )
