"""Model definitions, tiny presets, tokenizers and Hugging Face checkpoint loading.

`build_model(cfg)` is the one way every process gets its model: a preset name builds a tiny model initialised
deterministically from `cfg.init_seed` (identical in trainer and inference), a directory or a Hugging Face hub
id (resolved to its cached snapshot, downloaded when missing: arbor.models.hub) loads a Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from arbor.config.model import ModelConfig
from arbor.models.args import ModelArgs
from arbor.models.hub import resolve_dir
from arbor.models.presets import PRESETS
from arbor.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

if TYPE_CHECKING:  # an annotation only: importing the model class would load torch
    from arbor.models.qwen3 import Qwen3ForCausalLM

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def model_args(cfg: ModelConfig) -> ModelArgs:
    args = PRESETS[cfg.name] if cfg.name in PRESETS else ModelArgs.from_dir(resolve_dir(cfg.name))
    if cfg.mtp_depth is None or cfg.mtp_depth == getattr(args, "mtp_depth", 0):
        return args
    if not isinstance(args, ModelArgs):
        raise ValueError(
            f"model.mtp_depth: {cfg.name!r} is a DeepSeek sparse attention model; arbor builds MTP "
            "draft modules for dense Qwen3 models only"
        )
    return dataclasses.replace(args, mtp_depth=cfg.mtp_depth)


def build_tokenizer(cfg: ModelConfig) -> Tokenizer:
    if cfg.tokenizer is not None:
        return load_tokenizer(
            cfg.tokenizer if cfg.tokenizer == "byte" else resolve_dir(cfg.tokenizer, "model.tokenizer")
        )
    if cfg.name in PRESETS:
        return ByteTokenizer()
    return load_tokenizer(resolve_dir(cfg.name))


def build_model(cfg: ModelConfig, device: str = "cpu", load: bool = True) -> "Qwen3ForCausalLM":
    """The dense or MoE (a Qwen3ForCausalLM subclass) or DeepSeek sparse attention (DeepseekV32ForCausalLM) model on
    `device` in `cfg.dtype`; `load=False` skips weights (meta-device init for FSDP callers)."""
    # Building loads torch; the package itself stays without it for the launcher and config checks (presets, args).
    import torch

    from arbor.models.deepseek_v32 import DeepseekV32ForCausalLM
    from arbor.models.hf import load_weights
    from arbor.models.qwen3 import Qwen3ForCausalLM
    from arbor.models.qwen3_moe import Qwen3MoeForCausalLM

    args = model_args(cfg)
    # Dispatch on the architecture (config.json's `architectures[0]`, or the preset's).
    if getattr(args, "is_dsa", False):
        model = DeepseekV32ForCausalLM(args)
    else:
        model = Qwen3MoeForCausalLM(args) if args.is_moe else Qwen3ForCausalLM(args)
    if load:
        if cfg.name in PRESETS:
            model.init_weights(cfg.init_seed)
        else:
            load_weights(model, resolve_dir(cfg.name))
    return model.to(device=device, dtype=getattr(torch, cfg.dtype))


__all__ = [
    "ModelArgs",
    "PRESETS",
    "Tokenizer",
    "build_model",
    "build_tokenizer",
    "load_tokenizer",
    "model_args",
    "resolve_dir",
]
