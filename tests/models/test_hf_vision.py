"""Vision-language models on the transformers path (arbor.models.hf_vision, arbor.models.vision): messages with
images rendered by the model's processor, packed rows with images, and the trainer's logprobs, over a tiny random
Qwen2.5-VL written locally (arbor.models.vision_tiny, no download).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open
from safetensors.numpy import save_file
from safetensors.torch import load_file

from arbor.config.model import ModelConfig
from arbor.models import build_model, vision
from arbor.models.attention import position_ids_for
from arbor.models.image_parts import ImageRefused, refuse_images_for_text_model
from arbor.models.vision import VisionProcessor, data_url
from arbor.models.vision_tiny import write_tiny_vl
from arbor.trainer.step import micro_batch_logprobs
from arbor.transport.batch import MicroBatch, StepBatch

CPU = torch.device("cpu")
IMAGE_PAD = 261


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return str(write_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl"))


@pytest.fixture(scope="module")
def processor(vl_dir) -> VisionProcessor:
    return VisionProcessor(vl_dir, max_images=4, max_image_pixels=128 * 128)


def _chat(*images, answer: str | None = None) -> list[dict]:
    msgs = [{"role": "user", "content": [*images, {"type": "text", "text": "how many?"}]}]
    return msgs + ([{"role": "assistant", "content": answer}] if answer else [])


def test_image_parts_render_with_placeholders_and_pixels(processor, tmp_path) -> None:
    red = Image.new("RGB", (32, 32), "red")
    path = tmp_path / "blue.png"
    Image.new("RGB", (48, 32), "blue").save(path)
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(red)}},
        {"type": "image_url", "image_url": {"url": f"file://{path}"}},
        {"type": "image", "image": red},
    ]
    prompt = processor.render(_chat(*parts))
    # 8-pixel patches merged 2x2: a 32x32 image is 4 tokens, 48x32 is 6
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6], [1, 4, 4]]
    assert prompt.ids.count(IMAGE_PAD) == 4 + 6 + 4
    assert prompt.pixel_values.shape[0] == int(prompt.image_grid_thw.prod(-1).sum())
    # a later turn extends the ids and the images exactly
    later = processor.render(
        _chat(*parts, answer="3") + [{"role": "user", "content": [parts[0], {"type": "text", "text": "now?"}]}]
    )
    assert later.num_images == 4 and later.extends(processor.render(_chat(*parts, answer="3"), False))
    assert not later.extends(processor.render(_chat(parts[1], answer="3"), False))


def test_a_reply_extends_an_image_prompt_as_the_template_renders_it_without_reading_the_images_again(
    processor, tmp_path, monkeypatch
) -> None:
    """`with_reply` (a chat turn's view: its prompt's ids, then the reply as the template renders it) equals the
    whole conversation rendered again, for replies that start, end or consist of whitespace and special text,
    and reads no image: the gateway used to process every image of a call twice."""
    path = tmp_path / "green.png"
    Image.new("RGB", (48, 32), "green").save(path)
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (32, 32), "red"))}},
        {"type": "image_url", "image_url": {"url": f"file://{path}"}},
    ]
    messages = [{"role": "system", "content": "Count."}, *_chat(*parts)]
    prompt = processor.render(messages)
    loads = []
    real = vision.load_image
    monkeypatch.setattr(vision, "load_image", lambda part: loads.append(part) or real(part))
    replies = ["2", "\n\ntwo\n", " 2 ", "", "<|im_end|> literal", "<tool_call>{}</tool_call>"]
    for text in replies:
        reply = {"role": "assistant", "content": text}
        got = processor.with_reply(prompt.ids, messages, reply)
        assert loads == []
        assert got == processor.render([*messages, reply], False).ids, text
        loads.clear()


def test_images_beyond_limits_and_text_models_are_one_line(processor) -> None:
    small = {"type": "image", "image": Image.new("RGB", (32, 32))}
    with pytest.raises(ImageRefused, match="5 images, more than the limit of 4"):
        processor.render(_chat(*[small] * 5))
    with pytest.raises(ImageRefused, match="256x256 pixels exceeds the limit"):
        processor.render(_chat({"type": "image", "image": Image.new("RGB", (256, 256))}))
    with pytest.raises(ImageRefused, match="no downloads"):
        processor.render(_chat({"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}))
    with pytest.raises(ImageRefused, match="text-only model"):
        refuse_images_for_text_model(_chat(small), "qwen3-tiny")


def _samples(processor) -> list:
    colours = ("red", "green")
    return [
        processor.render(
            _chat(
                *[{"type": "image", "image": Image.new("RGB", (32 + 8 * i, 32), c)}] * (i + 1), answer="ab" * (i + 1)
            ),
            False,
        )
        for i, c in enumerate(colours)
    ]


def test_trainer_logprobs_equal_transformers_with_images(vl_dir, processor, tmp_path) -> None:
    """A packed row of two samples with their images, through the batch file (safetensors) and the trainer's
    chunked logprobs, equals transformers' own forward of each sample alone (<= 1e-4)."""
    samples = _samples(processor)
    lens = [len(s.ids) for s in samples]
    ids = torch.tensor([t for s in samples for t in s.ids])
    mb = MicroBatch(
        input_ids=ids,
        position_ids=position_ids_for(lens)[0],
        loss_mask=ids != IMAGE_PAD,
        advantages=torch.zeros(len(ids)),
        inference_logprobs=torch.zeros(len(ids)),
        policy_versions=torch.zeros(len(ids), dtype=torch.int32),
        seq_lens=torch.tensor(lens),
        pixel_values=torch.cat([s.pixel_values for s in samples]),
        image_grid_thw=torch.cat([s.image_grid_thw for s in samples]),
    )
    tensors, meta = StepBatch(0, [mb], 1, 2, 1.0).to_tensors()
    path = tmp_path / "rank_0.safetensors"
    save_file(tensors, path, metadata=meta)
    with safe_open(path, "pt") as f:
        mb = StepBatch.from_tensors(load_file(path), f.metadata()).micro_batches[0]
    model = build_model(ModelConfig(name=vl_dir, impl="transformers")).eval()
    with torch.no_grad():
        ours, _ = micro_batch_logprobs(model, mb, 1.0, CPU, with_entropy=False)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    expected = []
    for s in samples:
        with torch.no_grad():
            logits = ref(
                input_ids=torch.tensor([s.ids]),
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
                mm_token_type_ids=(torch.tensor([s.ids]) == IMAGE_PAD).int(),
            ).logits[0]
        lp = logits[:-1].log_softmax(-1).gather(-1, torch.tensor(s.ids[1:])[:, None])[:, 0]
        expected.append(torch.cat([lp.new_zeros(1), lp]))
    first = torch.tensor([0, lens[0]])  # a sample's first token is predicted by nothing of its own
    keep = torch.ones(len(ids), dtype=torch.bool).index_fill(0, first, False)
    assert (ours - torch.cat(expected))[keep].abs().max() <= 1e-4


def test_vision_tower_frozen_or_trainable(vl_dir) -> None:
    model = build_model(ModelConfig(name=vl_dir, impl="transformers"))  # frozen by default
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    model = build_model(ModelConfig(name=vl_dir, impl="transformers", vision_tower="trainable"))
    assert all(p.requires_grad for p in model.model.visual.parameters())
    with pytest.raises(ValueError, match="model.vision_tower"):
        model.set_vision_tower("lora")


def test_batch_refuses_images_in_merged_rows_and_bad_grids() -> None:
    base = dict(
        input_ids=torch.zeros(4, dtype=torch.long),
        position_ids=torch.arange(4),
        loss_mask=torch.ones(4, dtype=torch.bool),
        advantages=torch.zeros(4),
        inference_logprobs=torch.zeros(4),
        policy_versions=torch.zeros(4, dtype=torch.int32),
        seq_lens=torch.tensor([4]),
    )
    with pytest.raises(ValueError, match="covers 16 patches, pixel_values holds 8"):
        MicroBatch(**base, pixel_values=torch.zeros(8, 3), image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="one of pixel_values and image_grid_thw"):
        MicroBatch(**base, pixel_values=torch.zeros(8, 3))
    merged = dict(
        base, subtree_end=torch.full((4,), 4, dtype=torch.int32), token_nodes=torch.arange(4, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="prefix_merge = false"):
        MicroBatch(**merged, pixel_values=torch.zeros(16, 3), image_grid_thw=torch.tensor([[1, 4, 4]]))


def test_sampled_image_tokens_are_text(vl_dir, processor) -> None:
    """Placeholders are the runs after a vision-start token that match the row's grids, in order: image tokens a
    policy sampled in its completion match none and stay text (as the engine decoded them)."""
    (sample,) = _samples(processor)[:1]
    model = build_model(ModelConfig(name=vl_dir, impl="transformers"))
    ids = torch.tensor(sample.ids + [259, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 97])
    types, grids = model.placeholders(ids, torch.arange(len(ids)), sample.image_grid_thw)
    assert int(types.sum()) == 4 and int(types[len(sample.ids) :].sum()) == 0
    assert torch.equal(grids[0], sample.image_grid_thw)
    with pytest.raises(ValueError, match="carries 2 images but only 1 match"):
        model.placeholders(ids, torch.arange(len(ids)), torch.cat([sample.image_grid_thw, torch.tensor([[1, 4, 6]])]))
