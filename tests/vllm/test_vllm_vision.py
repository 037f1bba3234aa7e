"""vLLM serves arbor's tiny Qwen2.5-VL (arbor.models.vision_tiny with 32-wide heads, which vLLM's CPU build runs):
token prompts rendered by the model's processor travel with their pixel inputs through arbor's proxy (vLLM's
token-in route, arbor.inference.vllm.images), and vLLM's logprobs of its own samples agree with the trainer's
forward of the same prompt, images and tokens (mismatch KL per token < 1e-3) before and after a weight update that
moves the vision tower too (its names as vLLM maps them); a chat request with an `image_url` part is rendered and
answered by vLLM itself through the same proxy; and a sync-mode `rl` run of examples/vision on vLLM trains on what
vLLM sampled."""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_vllm_backend import KL_TARGET, mismatch_kl, perturbed
from vllm_server import post_json, vllm_server

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.vision import VisionProcessor, VisionPrompt, data_url
from arbor.models.vision_tiny import VLLM_SHAPE, write_tiny_vl
from arbor.monitor.metrics import read_jsonl
from arbor.orchestrator.client import InferenceClient
from arbor.run_dir import rollout_rank_file as rank_file
from arbor.trainer.step import shifted_logprobs
from arbor.transport.files import read_step
from arbor.weights.transport import FilesystemTransport

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COLOURS = ("red", "green", "blue")


def _prompts(vl_dir: Path) -> list[VisionPrompt]:
    """Two one-image prompts of different sizes, a two-image prompt and a text-only one."""
    processor = VisionProcessor(vl_dir)

    def image(colour: str, size: tuple[int, int]) -> dict:
        return {"type": "image", "image": Image.new("RGB", size, colour)}

    conversations = [
        [image("red", (48, 32)), {"type": "text", "text": "colour?"}],
        [image("green", (32, 32)), {"type": "text", "text": "which colour is this"}],
        [image("blue", (32, 48)), {"type": "text", "text": "and"}, image("red", (40, 40))],
        "no image here",
    ]
    return [processor.render([{"role": "user", "content": c}]) for c in conversations]


def _images(prompt: VisionPrompt) -> dict | None:
    if not prompt.num_images:
        return None
    return {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}


def _trainer_logprobs(model: torch.nn.Module, prompt: VisionPrompt, completion: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt.ids + completion)
    with torch.no_grad():
        logits = model(ids[None], **(_images(prompt) or {}))[0]
        lp, _ = shifted_logprobs(logits, ids, temperature=1.0, with_entropy=False)
    return lp[len(prompt.ids) :]


async def _sample(url: str, prompts: list[VisionPrompt], version: int) -> list[list]:
    async with InferenceClient([url], timeout=600, max_retries=0) as client:
        return await asyncio.gather(
            *(
                client.generate(p.ids, 2, 12, 1.0, 1.0, 10 * version + i, images=_images(p))
                for i, p in enumerate(prompts)
            )
        )


def _kl(model: torch.nn.Module, prompts: list[VisionPrompt], outs: list[list], version: int) -> float:
    kls = []
    for prompt, completions in zip(prompts, outs, strict=True):
        for c in completions:
            assert c.token_ids and c.policy_versions == [version] * len(c.token_ids)
            kls.append(mismatch_kl(_trainer_logprobs(model, prompt, c.token_ids), torch.tensor(c.logprobs)))
    return float(torch.cat(kls).mean())


def test_vllm_serves_image_prompts_like_the_trainer_before_and_after_an_update(tmp_path: Path) -> None:
    vl_dir = write_tiny_vl(tmp_path / "tiny-vl", **VLLM_SHAPE)
    prompts = _prompts(vl_dir)
    model = build_model(ModelConfig(name=str(vl_dir), impl="transformers"))
    with vllm_server(tmp_path, vl_dir, 256) as url:
        before = _kl(model, prompts, asyncio.run(_sample(url, prompts, 0)), 0)
        tower = {k: v.clone() for k, v in model.state_dict().items() if ".visual." in k}
        assert tower
        perturbed(model, 1)  # the tower moves with the rest
        path = FilesystemTransport().publish(tmp_path / "run", 1, model.state_dict(), model.args)
        assert post_json(url, "/update_weights", {"path": str(path), "version": 1}) == {"policy_version": 1}
        outs = asyncio.run(_sample(url, prompts, 1))
        after = _kl(model, prompts, outs, 1)
        old_tower = copy.deepcopy(model)
        old_tower.load_state_dict(tower, strict=False)
        stale = _kl(old_tower, prompts, outs, 1)  # the same samples under the new decoder with the old tower
        chat = post_json(
            url,
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (32, 32), "red"))}},
                            {"type": "text", "text": "colour?"},
                        ],
                    }
                ],
                "max_tokens": 4,
                "temperature": 1.0,
                "seed": 0,
            },
        )
    print(f"vision mismatch KL per token: before {before:.2e}, after the update {after:.2e}, old tower {stale:.2e}")
    assert before < KL_TARGET and after < KL_TARGET, (before, after)
    # The tower's tensors reached vLLM's tower: its samples fit the new tower far better than the old one (measured
    # on CPU, fp32: 2e-14 against 2e-4; a tower left behind would score the old tower's KL itself).
    assert stale > 1e-5 and stale > 100 * after, (stale, after)
    (choice,) = chat["choices"]
    assert choice["token_ids"] and choice["policy_versions"] == [1] * len(choice["token_ids"])


def test_a_sync_rl_run_on_vllm_with_images_scores_what_vllm_sampled(tmp_path: Path) -> None:
    """examples/vision with `inference.backend = "vllm"` (the tiny checkpoint in vLLM's shape) in sync mode: the run
    finishes, its batches carry the images, and the trainer's logprobs equal vLLM's (mismatch KL < 1e-3 every step;
    measured ~5e-14)."""
    model = write_tiny_vl(tmp_path / "tiny-vl", **VLLM_SHAPE)
    out = tmp_path / "run"
    flags = {
        "--output-dir": str(out),
        "--model.name": str(model),
        "--inference.backend": "vllm",
        "--orchestrator.scheduler.mode": "sync",
        "--max-steps": "2",
        "--sft.steps": "2",
        "--orchestrator.batch-size": "16",
        "--inference.max-batch-size": "16",
        "--orchestrator.environment.args": '{ num_tasks = 32, kinds = ["colour"] }',
    }
    argv = [sys.executable, "-m", "arbor.launch.rl", "@", "examples/vision/rl.toml"]
    proc = subprocess.run(argv + [x for kv in flags.items() for x in kv], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    print("sync mismatch KL per step:", [r["mismatch_kl"] for r in rows])
    assert [r["step"] for r in rows] == [0, 1] and all(r["mismatch_kl"] < KL_TARGET for r in rows)
    batch = read_step(rank_file(out, 1, 0))
    assert any(mb.pixel_values is not None for mb in batch.micro_batches)
