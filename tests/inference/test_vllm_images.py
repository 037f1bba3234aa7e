"""The vLLM proxy's image path without a server (arbor.inference.vllm.images): a completions request with `images`
becomes vLLM's token-in request (placeholder ranges, per-image hashes salted with the policy version, sampling
fields), fields it cannot serve and mismatched placeholders are refused naming the field, vLLM's generate chunks
read back as completions chunks, and a vision-language checkpoint gets the flags the route needs."""

from __future__ import annotations

import numpy as np
import pytest

from arbor.config.inference import InferenceConfig
from arbor.inference.vllm.images import (
    VISION_ARGS,
    VisionLayout,
    completion_chunk,
    generate_request,
    image_hashes,
)
from arbor.inference.vllm.launch import serve_argv
from arbor.models.vision_tiny import VLLM_SHAPE, tiny_vl_config, write_tiny_processor
from arbor.transport.http import BadRequest
from arbor.transport.images import encode_images

LAYOUT = VisionLayout(image_token_id=9, merge=2)
GRID = np.array([[1, 2, 4], [1, 4, 4]])  # 2 and 4 placeholder tokens
PIXELS = np.arange(24 * 6, dtype=np.float32).reshape(24, 6)
IDS = [1, 8, 9, 9, 7, 2, 8, 9, 9, 9, 9, 7, 3]


def _body(**kw) -> dict:
    return {"prompt": IDS, "images": encode_images(PIXELS, GRID), "max_tokens": 5, "n": 2, "seed": 4, **kw}


def _fake_items(pixel_values: np.ndarray, grid: np.ndarray) -> list[str]:
    return [f"item{i}:{tuple(g)}" for i, g in enumerate(grid.tolist())]


def test_a_completion_with_images_becomes_a_token_in_request() -> None:
    out = generate_request(_body(temperature=0.7, logprobs=0), LAYOUT, "m", "policy-3", items=_fake_items)
    assert out["token_ids"] == IDS and out["model"] == "m" and out["cache_salt"] == "policy-3"
    features = out["features"]
    assert features["mm_placeholders"] == {"image": [{"offset": 2, "length": 2}, {"offset": 7, "length": 4}]}
    assert features["kwargs_data"] == {"image": ["item0:(1, 2, 4)", "item1:(1, 4, 4)"]}
    assert len(set(features["mm_hashes"]["image"])) == 2
    assert out["sampling_params"] == {"max_tokens": 5, "n": 2, "seed": 4, "temperature": 0.7, "logprobs": 0}
    assert out["stream"] and out["output_mode"] == "text" and out["return_token_ids"]
    served = generate_request(_body(), LAYOUT, "m", "policy-3", "policy-3/v4", items=_fake_items)
    assert served["cache_salt"] == "policy-3"  # the client's salt for the prefix cache, the served version in hashes
    assert served["features"]["mm_hashes"] != features["mm_hashes"]


def test_image_hashes_change_with_pixels_grid_and_policy_version() -> None:
    base = image_hashes(PIXELS, GRID, "policy-0")
    assert base == image_hashes(PIXELS.copy(), GRID, "policy-0")
    assert base[0] != image_hashes(PIXELS, GRID, "policy-1")[0]  # new weights: no cached image embedding reused
    moved = PIXELS.copy()
    moved[20, 0] += 1  # a patch of the second image
    assert image_hashes(moved, GRID, "policy-0") == [base[0], image_hashes(moved, GRID, "policy-0")[1]]
    assert image_hashes(moved, GRID, "policy-0")[1] != base[1]


@pytest.mark.parametrize(
    ("body", "layout", "field"),
    [
        (_body(prompt=[1, 9, 9, 9, 2]), LAYOUT, "images"),  # runs of 3, grids need 2 and 4
        (_body(prompt="text"), LAYOUT, "prompt"),
        (_body(images={"pixel_values": {"shape": [2, 2], "data": "!"}}), LAYOUT, "images"),
        (_body(echo=True), LAYOUT, "echo"),
        (_body(prompt_logprobs=1), LAYOUT, "prompt_logprobs"),
        (_body(use_beam_search=True), LAYOUT, "use_beam_search"),
        (_body(), None, "images"),  # a text-only model
    ],
)
def test_bad_image_requests_are_one_line_naming_the_field(body: dict, layout, field: str) -> None:
    with pytest.raises(BadRequest) as e:
        generate_request(body, layout, "m", "policy-0", items=_fake_items)
    assert e.value.param == field and "\n" not in e.value.message


def test_generate_chunks_read_as_completion_chunks() -> None:
    chunk = {
        "request_id": "r",
        "choices": [
            {
                "index": 1,
                "text": "ab",
                "token_ids": [97, 98],
                "finish_reason": "length",
                "stop_reason": None,
                "logprobs": {
                    "content": [
                        {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]},
                        {"token": "b", "logprob": -1.5, "top_logprobs": [{"token": "b", "logprob": -1.5}]},
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    out = completion_chunk(chunk, [5, 6, 7])
    (c,) = out["choices"]
    assert c["index"] == 1 and c["text"] == "ab" and c["token_ids"] == [97, 98] and c["prompt_token_ids"] == [5, 6, 7]
    assert c["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -1.5],
        "top_logprobs": [{"a": -0.5}, {"b": -1.5}],
    }
    assert c["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 2
    error = {"error": {"message": "boom", "code": 400}}
    assert completion_chunk(error, []) is error


def test_a_vision_language_checkpoint_gets_the_token_in_route(tmp_path) -> None:
    config = tiny_vl_config(**VLLM_SHAPE)
    config.save_pretrained(tmp_path)
    write_tiny_processor(tmp_path)
    layout = VisionLayout.of(tmp_path)
    assert layout == VisionLayout(image_token_id=config.image_token_id, merge=2)
    assert config.text_config.hidden_size // config.text_config.num_attention_heads == 32  # vLLM CPU serves it
    cfg = InferenceConfig(model={"name": str(tmp_path)})
    argv = serve_argv(cfg, str(tmp_path), 1234, cpu=True, vision=True)
    assert argv[-len(VISION_ARGS) :] == VISION_ARGS
    assert not set(VISION_ARGS) & set(serve_argv(cfg, str(tmp_path), 1234, cpu=True))
    (tmp_path / "text").mkdir()
    assert VisionLayout.of(tmp_path / "text") is None
