"""Loading a Hugging Face checkpoint a layer at a time (arbor.models.hf.load_weights): names and shapes are checked
from the safetensors headers before any tensor is read, so a checkpoint that does not fit leaves the model as it
was and says which tensor is at fault; the groups it reads keep each layer (its experts, FP8 scales and fused
projections) together."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import write_tiny
from safetensors.torch import load_file, save_file

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.models.hf import checkpoint_groups, checkpoint_layout, load_weights


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def test_the_layout_comes_from_the_headers_alone(llama):
    state = load_file(str(llama / "model.safetensors"))
    layout = checkpoint_layout(llama)
    assert layout.keys() == state.keys()
    for name, (file, meta) in layout.items():
        assert file == "model.safetensors" and meta.is_meta
        assert (meta.dtype, meta.shape) == (state[name].dtype, state[name].shape), name


@pytest.mark.parametrize("damage", ["reshaped", "missing", "unexpected"])
def test_a_checkpoint_that_does_not_fit_is_refused_before_any_tensor_is_copied(llama, tmp_path, damage):
    model = build_model(ModelConfig(name=str(llama), tokenizer="byte"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v + 1 for k, v in load_file(str(llama / "model.safetensors")).items()}  # every tensor differs
    name = "model.layers.1.mlp.down_proj.weight"  # the last layer: read after every other, were it not checked first
    if damage == "reshaped":
        state[name] = state[name][:, :-1].contiguous()
    elif damage == "missing":
        del state[name]
    else:
        state["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path}.*(down_proj|extra)") as e:
        load_weights(model, tmp_path)
    assert "\n" not in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_layer_is_read_with_its_experts_scales_and_fused_parts():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "lm_head.weight",
        "lm_head.weight_scale_inv",
        "model.visual.blocks.3.attn.qkv.weight",
        "model.norm.weight",
    ]
    assert checkpoint_groups(names) == [
        ["model.embed_tokens.weight"],
        names[1:5],
        ["model.layers.1.mlp.experts.0.gate_proj.weight"],
        ["lm_head.weight", "lm_head.weight_scale_inv"],
        ["model.visual.blocks.3.attn.qkv.weight"],
        ["model.norm.weight"],
    ]
