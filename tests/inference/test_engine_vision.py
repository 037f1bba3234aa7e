"""The local engine serving a vision-language model (arbor.models.hf_vision through arbor.inference.engine): a
prompt's images go in with its ids, the image encoder runs in its prefill, and every sampled token's logprob
equals transformers' own forward of the prompt, its images and the tokens before it; text prompts decode in the
same batch. Tiny random Qwen2.5-VL written locally (arbor.models.vision_tiny)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers
from PIL import Image

from arbor.config.model import ModelConfig
from arbor.inference.engine.core import Engine
from arbor.inference.engine.params import InvalidRequest, SamplingParams
from arbor.inference.server import BackgroundServer
from arbor.models import build_model
from arbor.models.tokenizer import load_tokenizer
from arbor.models.vision import VisionProcessor, data_url
from arbor.models.vision_tiny import write_tiny_vl
from arbor.orchestrator.client import InferenceClient, InferenceError


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return str(write_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl"))


def _reference_logprobs(ref, prompt, tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt.ids + tokens])
    kwargs = {}
    if prompt.num_images:
        kwargs = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    with torch.no_grad():
        logits = ref(input_ids=ids, mm_token_type_ids=(ids == ref.config.image_token_id).int(), **kwargs).logits[0]
    lp = logits.float().log_softmax(-1)
    n = len(prompt.ids)
    return [float(lp[n - 1 + i, t]) for i, t in enumerate(tokens)]


def test_engine_generates_with_images_token_exactly(vl_dir) -> None:
    processor = VisionProcessor(vl_dir)
    image = {"type": "image", "image": Image.new("RGB", (48, 32), "red")}
    with_image = processor.render([{"role": "user", "content": [image, {"type": "text", "text": "colour?"}]}])
    text_only = processor.render([{"role": "user", "content": "hello"}])
    model = build_model(ModelConfig(name=vl_dir, impl="transformers"))
    engine = Engine(model, load_tokenizer(vl_dir), seq_len=128, max_batch_size=4, seed=0).start()
    try:
        params = SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3)
        images = {"pixel_values": with_image.pixel_values, "image_grid_thw": with_image.image_grid_thw}
        futures = [
            engine.submit(with_image.ids, params, images=images),
            engine.submit(text_only.ids, params),
        ]
        outputs = [f.result(timeout=120) for f in futures]
    finally:
        engine.stop()
    ref = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    for prompt, out in zip((with_image, text_only), outputs):
        for c in out.completions:
            assert c.token_ids
            expected = _reference_logprobs(ref, prompt, c.token_ids)
            assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= 1e-4


def test_images_travel_with_token_prompts_over_http(vl_dir) -> None:
    """The orchestrator's client sends a rendered prompt's ids with its pixel inputs (`images`); the server's
    engine samples from the prompt with its images: logprobs equal transformers' forward with them."""
    processor = VisionProcessor(vl_dir)
    image = {"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (48, 32), "green"))}}
    prompt = processor.render([{"role": "user", "content": [image, {"type": "text", "text": "colour?"}]}])
    images = {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
    model = build_model(ModelConfig(name=vl_dir, impl="transformers"))
    tok = load_tokenizer(vl_dir)
    engine = Engine(model, tok, seq_len=128, max_batch_size=4, seed=0).start()

    async def call(**kw):
        async with InferenceClient([server.url], timeout=60, max_retries=0) as client:
            return await client.generate(prompt.ids, 2, 5, 1.0, 1.0, seed=1, **kw)

    try:
        with BackgroundServer(engine, tok) as server:
            completions = asyncio.run(call(images=images))
            bad = {"pixel_values": prompt.pixel_values[:-1], "image_grid_thw": prompt.image_grid_thw}
            with pytest.raises(InferenceError, match="image_grid_thw covers 24 patches, pixel_values has 23"):
                asyncio.run(call(images=bad))
    finally:
        engine.stop()
    ref = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    for c in completions:
        expected = _reference_logprobs(ref, prompt, c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) <= 1e-4


def test_engine_refuses_images_for_a_text_model(tmp_path) -> None:
    model = build_model(ModelConfig(name="qwen3-test"))
    engine = Engine(model, load_tokenizer(None), seq_len=64, max_batch_size=2)
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(InvalidRequest, match="text-only"):
        engine.submit([1, 2, 3], SamplingParams(), images={"pixel_values": torch.zeros(16, 8), "image_grid_thw": grid})
