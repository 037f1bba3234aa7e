"""Chat messages with images, rendered by a vision-language model's processor into token ids (each image's
placeholder expanded to its token count) and the pixel inputs beside them.

Environments and agents write OpenAI-style content parts: `{"type": "image_url", "image_url": {"url": ...}}`
with a `data:` URL, a `file://` URL or a local path, or `{"type": "image", "image": <PIL image or path>}` from
Python environments. `VisionPrompt` is what a trajectory keeps: the ids with their placeholder tokens and the
images' `pixel_values [P, D]` / `image_grid_thw [I, 3]`, in the order the images appear; a later turn renders
the whole conversation again and extends both (`extends`), as text turns extend their ids. Images the
processor cannot take (too many per prompt, too large before resizing) and image parts sent to a text-only model
are refused in one line (`ImageRefused`).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor

from arbor.models.image_parts import ImageRefused, image_parts
from arbor.models.tokenizer import HFTokenizer


def load_image(part: dict) -> Image.Image:
    """The RGB image of one content part (a data URL, a `file://` URL, a local path, or a PIL image)."""
    if part["type"] == "image":
        source = part.get("image", part.get("url"))  # arbor's Python form, or transformers' own
    else:
        url = part.get("image_url")
        source = url.get("url") if isinstance(url, dict) else url
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if not isinstance(source, str) or not source:
        raise ImageRefused(f"an {part['type']} part carries no image (a data URL, a local path or a PIL image)")
    if source.startswith("data:"):
        header, _, data = source.partition(",")
        if not header.endswith(";base64"):
            raise ImageRefused("an image data URL must be base64 (data:image/...;base64,...)")
        raw: Any = io.BytesIO(base64.b64decode(data))
    elif source.startswith(("http://", "https://")):
        raise ImageRefused(f"image URL {source[:60]!r}: arbor reads data URLs and local files only, no downloads")
    else:
        raw = Path(source.removeprefix("file://"))
        if not raw.is_file():
            raise ImageRefused(f"image file {raw} does not exist")
    try:
        return Image.open(raw).convert("RGB")
    except OSError as e:
        raise ImageRefused(f"image {str(source)[:60]!r} cannot be decoded: {e}") from None


def data_url(image: Image.Image) -> str:
    """`image` as a PNG data URL (what an agent sends in an `image_url` part)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclasses.dataclass
class VisionPrompt:
    """A rendered conversation: token ids with the images' placeholders, and the images' pixel inputs."""

    ids: list[int]
    pixel_values: torch.Tensor | None
    """`[P, D]` float32, every image's patches in order; None without images."""
    image_grid_thw: torch.Tensor | None
    """`[I, 3]` int64, each image's patch grid; None without images."""

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    def extends(self, prefix: VisionPrompt) -> bool:
        """Whether this prompt continues `prefix` exactly: its ids and its images are a prefix of ours."""
        if self.ids[: len(prefix.ids)] != prefix.ids or self.num_images < prefix.num_images:
            return False
        if prefix.num_images == 0:
            return True
        n = int(prefix.pixel_values.shape[0])
        return torch.equal(self.image_grid_thw[: prefix.num_images], prefix.image_grid_thw) and torch.equal(
            self.pixel_values[:n], prefix.pixel_values
        )


class VisionProcessor:
    """A vision-language model's Hugging Face processor (saved in its directory), with arbor's limits."""

    def __init__(self, path: str | Path, max_images: int = 8, max_image_pixels: int = 4096 * 4096) -> None:
        self.path = str(path)
        processor = AutoProcessor.from_pretrained(self.path)
        if not hasattr(processor, "image_processor"):
            raise ImageRefused(f"model {self.path} has no image processor: it is a text-only model, give it text")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_images, self.max_image_pixels = max_images, max_image_pixels

    def images(self, messages: list[dict]) -> list[Image.Image]:
        """The messages' images, checked against the limits."""
        parts = image_parts(messages)
        if len(parts) > self.max_images:
            raise ImageRefused(f"a prompt has {len(parts)} images, more than the limit of {self.max_images}")
        images = [load_image(p) for p in parts]
        for im in images:
            if im.width * im.height > self.max_image_pixels:
                raise ImageRefused(
                    f"an image of {im.width}x{im.height} pixels exceeds the limit of {self.max_image_pixels} pixels"
                )
        return images

    def text(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The chat template's text of `messages`, one placeholder per image (not expanded): no image is read."""
        # Copies: transformers rewrites each message's `image_url` parts in place (into its own "image" form)
        return self.processor.apply_chat_template(
            [dict(m) for m in messages],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> VisionPrompt:
        """Token ids (placeholders expanded) and pixel inputs of `messages` under the model's chat template."""
        images = self.images(messages)
        text = self.text(messages, add_generation_prompt, tools)
        out = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        if not images:
            return VisionPrompt(ids, None, None)
        return VisionPrompt(ids, out["pixel_values"].float(), out["image_grid_thw"].long())

    def with_reply(
        self, prompt_ids: list[int], messages: list[dict], reply: dict, tools: list[dict] | None = None
    ) -> list[int] | None:
        """The ids of `messages + [reply]` without a generation prompt, from `prompt_ids` (`render(messages)`'s,
        images expanded) and the template's text alone, so no image is read or processed again. The reply adds
        text only, and each image placeholder is a special token, which the tokenizer splits the text at and never
        merges with a neighbour: the tokens after the prompt are the same whatever a placeholder expands to. None
        when the text with the reply does not begin with the prompt's tokens (a template that rewrites earlier
        turns, or a reply that merges with the generation prompt's last token)."""
        before = self.tokenizer(self.text(messages, True, tools))["input_ids"]
        after = self.tokenizer(self.text([*messages, reply], False, tools))["input_ids"]
        if after[: len(before)] != before:
            return None
        return [*prompt_ids, *after[len(before) :]]


class VisionTokenizer(HFTokenizer):
    """A vision-language checkpoint's tokenizer (arbor's Tokenizer protocol) that also renders images:
    `render_images` gives the ids with expanded placeholders and the pixel inputs; `apply_chat_template` the ids
    alone (the same ids), so every caller that counts or compares tokens sees the model's real prompt."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.vision = VisionProcessor(path)

    def render_images(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> VisionPrompt:
        return self.vision.render(messages, add_generation_prompt, tools)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        return self.render_images(messages, add_generation_prompt, tools).ids

    def with_reply(
        self, prompt_ids: list[int], messages: list[dict], reply: dict, tools: list[dict] | None = None
    ) -> list[int] | None:
        """`apply_chat_template(messages + [reply], add_generation_prompt=False)` from the rendered prompt's ids,
        without processing its images again (VisionProcessor.with_reply); None where that cannot be exact."""
        return self.vision.with_reply(prompt_ids, messages, reply, tools)

    def save(self, path: str | Path) -> None:
        """The tokenizer and the processor (image processor, template): a saved checkpoint serves images too."""
        self.vision.processor.save_pretrained(str(path))
