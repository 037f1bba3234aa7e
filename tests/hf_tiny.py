"""Tiny random checkpoints of transformers architectures, written locally (no download) for the transformers
path's tests: one config per family, small enough that a forward takes milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tiny_chat_tokenizer import build_turn_tokenizer
from transformers import AutoConfig

from arbor.models.presets import BYTE_VOCAB, PRESETS
from arbor.models.tokenizer import ByteTokenizer

_BASE = dict(
    vocab_size=BYTE_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

TINY_HF: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("llama", {}),
    "Qwen2ForCausalLM": ("qwen2", {"tie_word_embeddings": True}),
    "MistralForCausalLM": ("mistral", {"sliding_window": 5}),
    "Gemma3ForCausalLM": (
        "gemma3_text",
        {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True},
    ),
    "Olmo2ForCausalLM": ("olmo2", {}),
    "Phi3ForCausalLM": ("phi3", {}),
    "Qwen3_5ForCausalLM": (
        "qwen3_5_text",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
        },
    ),
    "GptOssForCausalLM": (
        "gpt_oss",
        {"num_local_experts": 4, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], **_MOE},
    ),
    "Glm4MoeForCausalLM": (
        "glm4_moe",
        {"n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, **_MOE},
    ),
    "MiniMaxM2ForCausalLM": ("minimax_m2", {"num_local_experts": 4, **_MOE}),
}
"""architecture -> (model_type, what differs from the shared tiny shape)."""

MORE_HF: dict[str, tuple[str, dict]] = {
    "GPTNeoXForCausalLM": ("gpt_neox", {}),  # Pythia: layers at `gpt_neox.layers`, head `embed_out`
    "GPTBigCodeForCausalLM": ("gpt_bigcode", {}),  # StarCoder: `transformer.h`, multi-query attention
    "OPTForCausalLM": ("opt", {}),  # `model.decoder.layers`, learned positions
    "StableLmForCausalLM": ("stablelm", {}),  # its layers do not pass their keywords on to attention
    "SeedOssForCausalLM": ("seed_oss", {}),  # attention and residual dropout 0.1 in its config
    "PhimoeForCausalLM": ("phimoe", {"num_local_experts": 4, "num_experts_per_tok": 2}),  # routes sampled in training
    "FalconH1ForCausalLM": ("falcon_h1", {}),  # a Mamba mixer beside attention in every layer
    "NemotronHForCausalLM": ("nemotron_h", {}),  # layer kinds in `layers_block_type`
    "Gemma2ForCausalLM": (  # logits soft-capped (30 in the real models; 0.3 bites on tiny random weights)
        "gemma2",
        {"sliding_window": 5, "tie_word_embeddings": True, "final_logit_softcapping": 0.3},
    ),
    "GraniteForCausalLM": ("granite", {"logits_scaling": 4.0}),  # logits divided by logits_scaling
    "CohereForCausalLM": ("cohere", {}),  # logits times logit_scale (0.0625)
    "RecurrentGemmaForCausalLM": (  # layer kinds in `block_types`; logits soft-capped as `logits_soft_cap`
        "recurrent_gemma",
        {"num_hidden_layers": 3, "logits_soft_cap": 0.3, "attention_window_size": 5},
    ),
}
"""The transformers path's second ring: families whose layout or training-mode forward differs from Llama's
(logprobs and engine decoding checked in tests/models/test_hf_causal.py)."""

REFUSED_HF: dict[str, tuple[str, dict]] = {
    "BloomForCausalLM": ("bloom", {}),  # ALiBi attention of its own
    "MambaForCausalLM": ("mamba", {}),  # no attention at all
    "DiffLlamaForCausalLM": ("diffllama", {}),  # two attention calls per layer
    "GPTJForCausalLM": ("gptj", {}),  # picks its attention class from its own table
    "MptForCausalLM": ("mpt", {}),  # reads the causal mask transformers would build
    "ModernBertDecoderForCausalLM": ("modernbert-decoder", {}),  # a dense + norm head before the vocabulary
    "MoshiForCausalLM": ("moshi", {}),  # its decoder calls its layers without their keywords
    "HYV4ForCausalLM": ("hy_v4", {}),  # its sparse-attention indexer reads the causal mask transformers builds
}
"""Causal LMs the transformers path cannot train, each refused in one line when built (its two-token forward)."""


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    model_type, extra = {**TINY_HF, **MORE_HF, **REFUSED_HF}[arch]
    config = AutoConfig.for_model(model_type, **{**_BASE, **extra})
    config.architectures = [arch]
    return config


def write_tiny(arch: str, path: Path, seed: int = 0) -> Path:
    """A random `arch` checkpoint (fp32, transformers' own initialisation from `seed`) saved at `path`, with arbor's
    byte tokenizer (its ids are the vocabulary's)."""
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(tiny_config(arch))
    model.save_pretrained(path)
    ByteTokenizer().save(path)
    return path


def write_llama_of_preset(path: Path, preset: str = "qwen3-tiny", seed: int = 0, chat_template: bool = True) -> Path:
    """A `LlamaForCausalLM` of arbor preset `preset`'s shape (`write_llama`)."""
    p = PRESETS[preset]
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    shape = {k: getattr(p, k) for k in (*names, "head_dim", "rope_theta", "max_position_embeddings")}
    return write_llama(path, seed, chat_template, **shape)


SMALL_LLAMA = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4)
"""A Llama of 132k parameters (with the byte vocabulary): a quarter of qwen3-tiny's width, half its depth."""


BIG = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151_936,
)
"""A user's model of a few billion parameters, as its config.json says (`write_big_config`)."""


def write_big_config(path: Path, model_type: str, arch: str, **extra) -> Path:
    """The config.json alone (no weights) of a multi-billion-parameter `arch`, as transformers writes it: what a
    twin, a planner or preflight reads of a user's checkpoint."""
    config = AutoConfig.for_model(model_type, **{**BIG, **extra})
    config.architectures = [arch]
    config.save_pretrained(path)
    return path


def write_llama(path: Path, seed: int = 0, chat_template: bool = True, **shape) -> Path:
    """A `LlamaForCausalLM` of `shape` (LlamaConfig fields) over the byte vocabulary, as a user brings one:
    transformers' `LlamaConfig` (its defaults: untied head, no q/k norm, its own initialisation from `seed`),
    `save_pretrained`, and the byte tokenizer (arbor's, or with `chat_template=False` only its Hugging Face export
    without the template: a base model's tokenizer)."""
    config = transformers.LlamaConfig(
        **{"num_key_value_heads": 2, "max_position_embeddings": 512, **shape},
        vocab_size=BYTE_VOCAB,
        pad_token_id=ByteTokenizer().pad_token_id,
        eos_token_id=ByteTokenizer().eos_token_id,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    ByteTokenizer().save(path)
    if not chat_template:
        (path / "arbor_tokenizer.json").unlink()
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        del tokenizer_config["chat_template"]
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


_E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's published MXFP4 storage of an expert tensor `w [E, in, out]` (in % 32 == 0), per the OCP
    Microscaling spec, written here independently of arbor: blocks of 32 along `in`, each with the E8M0 exponent
    floor(log2(amax)) - 2 (E2M1's largest exponent) biased by 127, its elements rounded to the nearest E2M1 value
    (clamped at 6) and packed two a byte, the earlier element in the low nibble; stored transposed, `blocks [E,
    out, in / 32, 16]` and `scales [E, out, in / 32]`, both uint8."""
    x = w.transpose(1, 2).float()
    groups = x.reshape(*x.shape[:2], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-120))) - 2
    scaled = groups / torch.exp2(exponent)[..., None]
    code = (scaled.abs()[..., None] - _E2M1_MAGNITUDES).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8).reshape(*groups.shape[:3], 16)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4_gpt_oss(path: Path, seed: int = 0) -> Path:
    """A tiny `GptOssForCausalLM` stored as OpenAI publishes gpt-oss: its experts' `gate_up_proj` and `down_proj`
    as MXFP4 `*_blocks` + `*_scales` (`quantize_mxfp4`), everything else as saved, and the `quantization_config`
    of gpt-oss's config.json. transformers reads it (`Mxfp4Config(dequantize=True)` on a CPU)."""
    from safetensors.torch import load_file, save_file

    write_tiny("GptOssForCausalLM", path, seed)
    state = load_file(str(path / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor)
        else:
            out[name] = tensor
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_gemma_chat(path: Path, seed: int = 0) -> Path:
    """A tiny random `Gemma3ForCausalLM` with a Gemma-like chat tokenizer (tests/tiny_chat_tokenizer.py: turns
    closed by `<end_of_turn>`, id 4, which is not the tokenizer's eos `<eos>`, id 1) and, as Gemma's chat models
    publish it, both ids as the model's eos in config.json and generation_config.json."""
    build_turn_tokenizer(path)
    config = tiny_config("Gemma3ForCausalLM")
    config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id = 400, 0, 2, [1, 4]
    torch.manual_seed(seed)
    transformers.Gemma3ForCausalLM(config).save_pretrained(path)
    return path
