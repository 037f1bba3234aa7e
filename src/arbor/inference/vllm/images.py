"""A token prompt's images through the vLLM backend: arbor's `images` extension of `/v1/completions` (the ids with
each image's placeholder tokens expanded, the pixel inputs beside them: arbor.transport.images) served by vLLM.

vLLM's OpenAI completions take no image inputs, and its chat route renders messages itself (not arbor's token-exact
ids). Its token-in route, `/inference/v1/generate` (on with `--enable-scale-out`), takes token ids with
already-processed multimodal `features`: per image a hash, its placeholder range in the ids and its model inputs
(`pixel_values` patches and `image_grid_thw`) serialized as vLLM's `MultiModalKwargsItem`. The proxy sends exactly
the pixel values the orchestrator rendered, which are the ones the trainer trains on; vLLM then runs the vision
tower on them (with `--no-mm-device-do-normalize`, so that it takes them as the processor normalised them, as
transformers' model does) and computes the rotary positions from the grids. The answer streams back in vLLM's
generate shape (`output_mode = "text"`) and is rewritten to completions chunks (`completion_chunk`) for the proxy's
reassembler.

An image's hash names its pixels, its grid and the policy version the proxy serves: vLLM keys its encoder cache and
the prefix cache's image blocks by it, so no image embedding computed with older weights is reused after an update
(the proxy also resets vLLM's encoder cache after each weight load: arbor.inference.vllm.proxy).

Serializing the features needs vLLM's own classes: `item_payloads` imports them (the proxy runs where vLLM is
installed); everything else here is plain Python.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from arbor.transport import fields
from arbor.transport.errors import BadRequest
from arbor.transport.fields import COMPLETIONS
from arbor.transport.images import decode_images

GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in route (`--enable-scale-out`)."""
VISION_ARGS = ["--enable-scale-out", "--no-mm-device-do-normalize"]
"""vLLM flags for a vision-language model: the token-in route, and pixel inputs taken as already normalised."""

SAMPLING = {
    "n": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "logprobs": "logprobs",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "skip_special_tokens": "skip_special_tokens",
}
"""Completions fields -> vLLM `SamplingParams` fields, as vLLM's completions route maps them."""
PASSED_OVER = frozenset({"prompt", "images", "model", "user", "request_id", "cache_salt", "return_token_ids", "stream"})
"""Completions fields the image path reads itself or that change nothing in the answer."""
EXTRA_SAMPLING = ("include_stop_str_in_output", "spaces_between_special_tokens")
"""vLLM sampling fields outside arbor's schema, passed on when present (as vLLM's completions route takes them)."""


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """What the proxy needs of a vision-language checkpoint to place images: the image placeholder token and the
    vision tower's spatial merge (placeholder tokens per image = patches / merge**2)."""

    image_token_id: int
    merge: int

    @staticmethod
    def of(model_dir: str | Path) -> VisionLayout | None:
        """The layout from a checkpoint directory's `config.json`; None for a text-only model (no
        `vision_config`) or a directory without one."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            return None
        conf = json.loads(path.read_text())
        vision = conf.get("vision_config")
        if not isinstance(vision, dict) or "image_token_id" not in conf:
            return None
        return VisionLayout(int(conf["image_token_id"]), int(vision.get("spatial_merge_size", 1)))

    def placeholders(self, ids: list[int], grid: np.ndarray) -> list[tuple[int, int]]:
        """Each image's (offset, length) in `ids`: the runs of the image token, in order, each as long as its
        grid's token count. A 400 naming `images` when they do not match."""
        counts = [int(n) // (self.merge * self.merge) for n in grid.prod(-1)]
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == self.image_token_id:
                j = i
                while j < len(ids) and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if [n for _, n in runs] != counts:
            raise BadRequest(
                f"images: the prompt's image placeholder runs have {[n for _, n in runs]} tokens, the images' grids "
                f"need {counts} (render the prompt with the model's processor)",
                "images",
            )
        return runs


def item_payloads(pixel_values: np.ndarray, grid: np.ndarray) -> list[str]:
    """Each image's `pixel_values` patches and `image_grid_thw` as vLLM's serialized `MultiModalKwargsItem`
    (the layout of its Qwen-VL processors: patches flat by image, grids batched and kept on the CPU)."""
    # vLLM's multimodal classes: the proxy's image path runs beside vLLM (module docstring).
    import torch  # noqa: PLC0415 - with vLLM, see above
    from transformers import BatchFeature  # noqa: PLC0415 - see above
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item  # noqa: PLC0415
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems  # noqa: PLC0415

    grid_t = torch.as_tensor(grid, dtype=torch.int64)
    config = {
        "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid_t.prod(-1)),
        "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
    }
    inputs = BatchFeature({"pixel_values": torch.from_numpy(np.array(pixel_values)), "image_grid_thw": grid_t})
    return [encode_mm_kwargs_item(item) for item in MultiModalKwargsItems.from_hf_inputs(inputs, config)["image"]]


def image_hashes(pixel_values: np.ndarray, grid: np.ndarray, salt: str) -> list[str]:
    """One hash per image over its patches, its grid and `salt` (the policy version: the module docstring)."""
    out, at = [], 0
    for thw in grid:
        n = int(np.prod(thw))
        h = hashlib.sha256(salt.encode())
        h.update(np.asarray(thw, np.int64).tobytes())
        h.update(np.ascontiguousarray(pixel_values[at : at + n]).tobytes())
        out.append(h.hexdigest())
        at += n
    return out


def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM `SamplingParams` of a completions request; a field the image path cannot serve as asked (echo, beam
    search, structured output, prompt logprobs...) is a 400 naming it."""
    fields.refuse_unsupported(body, COMPLETIONS, frozenset(SAMPLING) | PASSED_OVER, "the vLLM backend with images")
    params = {SAMPLING[k]: v for k, v in body.items() if k in SAMPLING and v is not None}
    params.update({k: body[k] for k in EXTRA_SAMPLING if body.get(k) is not None})
    return params


def generate_request(
    body: dict[str, Any],
    layout: VisionLayout | None,
    model: str,
    cache_salt: str,
    hash_salt: str | None = None,
    items=item_payloads,
) -> dict[str, Any]:
    """The `/inference/v1/generate` body of a completions request with `images` (streamed, text and logprobs as
    the completions route gives them). The images' hashes are salted with `hash_salt` (the weights' version the
    proxy knows; `cache_salt` when None). `items` serializes the images (vLLM's `item_payloads`; a test's fake)."""
    if layout is None:
        raise BadRequest("images: the served model is text-only (its config has no vision_config)", "images")
    ids = body.get("prompt")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise BadRequest("images come with one token prompt (prompt: a list of token ids)", "prompt")
    try:
        pixel_values, grid = decode_images(body["images"])
    except ValueError as e:
        raise BadRequest(str(e), "images") from None
    ranges = layout.placeholders(ids, grid)
    return {
        "token_ids": ids,
        "features": {
            "mm_hashes": {"image": image_hashes(pixel_values, grid, hash_salt or cache_salt)},
            "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in ranges]},
            "kwargs_data": {"image": items(pixel_values, grid)},
        },
        "sampling_params": sampling_params(body),
        "model": model,
        "output_mode": "text",
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "cache_salt": cache_salt,
    }


def completion_chunk(chunk: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """A generate stream chunk (text mode) as the completions stream chunk vLLM's completions route would send:
    text, token ids, logprobs as `tokens` / `token_logprobs` / `top_logprobs`, the prompt's ids on each choice."""
    if chunk.get("error"):
        return chunk
    choices = []
    for c in chunk.get("choices") or []:
        content = (c.get("logprobs") or {}).get("content")
        logprobs = None
        if content is not None:
            logprobs = {
                "tokens": [e["token"] for e in content],
                "token_logprobs": [e.get("logprob") for e in content],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in content],
            }
        choices.append(
            {
                "index": c["index"],
                "text": c.get("text") or "",
                "token_ids": c.get("token_ids") or [],
                "logprobs": logprobs,
                "finish_reason": c.get("finish_reason"),
                "stop_reason": c.get("stop_reason"),
                "prompt_token_ids": prompt_ids,
            }
        )
    out: dict[str, Any] = {"id": chunk.get("request_id"), "model": chunk.get("model"), "choices": choices}
    if chunk.get("usage"):
        out["usage"] = chunk["usage"]
    return out
