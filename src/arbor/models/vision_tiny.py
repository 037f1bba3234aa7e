"""A tiny random Qwen2.5-VL checkpoint with its processor, written locally (no download): the vision-language
path's test model and the CPU example's policy (examples/vision). The processor is a real Hugging Face one, saved
beside the weights, so anything that loads a model directory (arbor's processes, vLLM) reads it: Qwen2-VL's image
processor (8-pixel patches, 2x2 merge: a 32x32 image is 4 placeholder tokens) and arbor's byte-level tokenizer
with Qwen2.5-VL's vision special tokens and a ChatML template that renders OpenAI-style image parts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

from arbor.models.tokenizer import byte_tokenizer_files

VL_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""The byte tokenizer's specials (ids 256..258) and Qwen2.5-VL's vision tokens (259..262)."""

VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML whose content may be a list of OpenAI-style parts; each image is Qwen2.5-VL's placeholder (one
`<|image_pad|>` the processor expands to the image's token count)."""

PATCH = 8
"""Pixels per patch side (the image processor's and the vision tower's)."""
MAX_PIXELS = 64 * 64
"""The processor's largest image (larger ones are resized down to it)."""


VLLM_SHAPE = {"hidden_size": 64, "num_attention_heads": 2}
"""`tiny_vl_config`'s decoder shape with 32-wide attention heads, a head size vLLM's CPU build serves
(arbor.inference.vllm.launch.CPU_HEAD_SIZES; the default's 8 is not): the shape of examples/vision's checkpoint
(`main`, ~128k parameters), so that the vLLM tests serve the checkpoint the example trains."""


def mrope_section(head_dim: int) -> list[int]:
    """Qwen-VL's split of a head's rotary frequencies (head_dim / 2) over time, height and width."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_vl_config(
    vocab_size: int = 256 + len(VL_SPECIALS), hidden_size: int = 32, num_attention_heads: int = 4
) -> transformers.PretrainedConfig:
    """Qwen2.5-VL with a 2-layer decoder (32 wide, 4 heads of 8 by default; `VLLM_SHAPE` for vLLM) and a 2-block,
    16-wide vision tower."""
    ids = {tok: 256 + i for i, tok in enumerate(VL_SPECIALS)}
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=max(1, num_attention_heads // 2),
        max_position_embeddings=1024,
        rope_scaling={"type": "mrope", "mrope_section": mrope_section(hidden_size // num_attention_heads)},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=hidden_size,
        patch_size=PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=16,
        fullatt_block_indexes=[1],
        in_channels=3,
    )
    config = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=text,
        vision_config=vision,
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def write_tiny_processor(path: Path) -> None:
    """The byte-level tokenizer with the vision specials and `VL_TEMPLATE`, and Qwen2-VL's image processor."""
    path.mkdir(parents=True, exist_ok=True)
    files = byte_tokenizer_files(VL_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>")
    files["tokenizer_config.json"]["chat_template"] = VL_TEMPLATE
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, ensure_ascii=False))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    image = Qwen2VLImageProcessor(
        patch_size=PATCH, merge_size=2, temporal_patch_size=2, min_pixels=4 * PATCH * PATCH, max_pixels=MAX_PIXELS
    )
    video = Qwen2VLVideoProcessor(patch_size=PATCH, merge_size=2, temporal_patch_size=2)
    processor = transformers.Qwen2_5_VLProcessor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=VL_TEMPLATE
    )
    processor.save_pretrained(str(path))


def write_tiny_vl(path: str | Path, seed: int = 0, **shape: int) -> Path:
    """A random tiny Qwen2.5-VL (fp32, transformers' own initialisation from `seed`; `shape`: `tiny_vl_config`'s
    decoder keywords, e.g. `VLLM_SHAPE`) and its processor at `path`."""
    path = Path(path)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_vl_config(**shape))
    model.save_pretrained(path)
    write_tiny_processor(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m arbor.models.vision_tiny DIR`: writes examples/vision's tiny checkpoint (`VLLM_SHAPE`) at DIR
    unless one is there."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m arbor.models.vision_tiny DIR", file=sys.stderr)
        return 2
    path = Path(args[0])
    if (path / "config.json").exists():
        print(f"{path}: a checkpoint is there already")
        return 0
    write_tiny_vl(path, **VLLM_SHAPE)
    print(f"{path}: tiny Qwen2.5-VL written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
