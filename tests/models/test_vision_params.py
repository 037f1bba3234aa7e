"""`vision_tower_params` (arbor.models.vision_params) counts a Qwen-VL vision tower from its config exactly as
transformers builds it: Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers instantiated small and counted; a text-only
config has no tower."""

from __future__ import annotations

import pytest
import transformers
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from arbor.models.vision_params import vision_tower_params
from arbor.models.vision_tiny import tiny_vl_config

SMALL = dict(depth=3, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_qwen2_5_vl_tower() -> None:
    config = tiny_vl_config()
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    assert vision_tower_params(config.to_dict()) == _count(model.model.visual)


@pytest.mark.parametrize(
    ("model_type", "vision", "cls"),
    [
        ("qwen2_vl", dict(embed_dim=16, mlp_ratio=3, hidden_size=24), Qwen2VisionTransformerPretrainedModel),
        (
            "qwen3_vl",
            dict(
                hidden_size=16,
                intermediate_size=40,
                out_hidden_size=24,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0, 2],
            ),
            Qwen3VLVisionModel,
        ),
    ],
)
def test_qwen2_and_qwen3_vl_towers(model_type: str, vision: dict, cls) -> None:
    config = transformers.AutoConfig.for_model(model_type, vision_config={**SMALL, **vision})
    assert vision_tower_params(config.to_dict()) == _count(cls(config.vision_config))


def test_no_tower_without_a_vision_config() -> None:
    assert vision_tower_params({"model_type": "qwen3", "hidden_size": 8}) is None
    assert vision_tower_params({"model_type": "llava", "vision_config": {"hidden_size": 8}}) is None
