"""Image content parts of chat messages, without torch: what a text-only path needs to refuse them in one line
(arbor.environments, preflight); rendering them is arbor.models.vision's job."""

from __future__ import annotations

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


def refuse_images_for_text_model(messages: list[dict], model: str) -> None:
    """One line when `messages` carry images but `model` renders text only."""
    if image_parts(messages):
        raise ImageRefused(
            f"model {model} is a text-only model and a prompt carries images: use a vision-language model "
            "(a checkpoint with a vision_config and an image processor) or send text"
        )
