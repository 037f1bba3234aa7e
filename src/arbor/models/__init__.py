"""Model definitions, tiny presets, tokenizers and Hugging Face checkpoint loading.

`build_model(cfg)` is the one way every process gets its model: a preset name builds a tiny model initialised
deterministically from `cfg.init_seed` (identical in trainer and inference), a directory or a Hugging Face hub
id (resolved to its cached snapshot, downloaded when missing: arbor.models.hub) loads a Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from arbor.models.args import DSAArgs, ModelArgs
from arbor.models.family import family_of
from arbor.models.hub import resolve_dir
from arbor.models.presets import PRESETS
from arbor.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from arbor.registry import MODEL_FAMILIES

if TYPE_CHECKING:  # an annotation only: importing the model class would load torch
    from torch import nn

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ModelSpec(Protocol):
    """What building a model reads of its config (`[model]`, arbor.config.model.ModelConfig, satisfies it): the
    models package sits below the config package and imports nothing of it."""

    @property
    def name(self) -> str:
        """A preset (arbor.models.presets), a checkpoint directory or a Hugging Face hub id."""
        ...

    @property
    def tokenizer(self) -> str | None:
        """A tokenizer directory or hub id, "byte", or None for the model's own."""
        ...

    @property
    def dtype(self) -> str:
        """ "float32", "bfloat16" or "float16"."""
        ...

    @property
    def init_seed(self) -> int:
        """A preset's initial weights."""
        ...

    @property
    def mtp_depth(self) -> int | None:
        """MTP draft modules to build (None: the checkpoint's or preset's own)."""
        ...

    @property
    def impl(self) -> str:
        """ "auto", "native" or "transformers" (arbor.models.family.choose_family)."""
        ...


def model_args(cfg: ModelSpec) -> ModelArgs | DSAArgs:
    """The preset's args, or the checkpoint's `config.json` read by its family (arbor.models.family), with
    `cfg.mtp_depth` MTP modules where it sets them."""
    args = PRESETS[cfg.name] if cfg.name in PRESETS else ModelArgs.from_dir(resolve_dir(cfg.name), cfg.impl)
    if cfg.mtp_depth is None or cfg.mtp_depth == getattr(args, "mtp_depth", 0):
        return args
    if not family_of(args).supports_mtp:
        mtp = [a for a in MODEL_FAMILIES.names() if MODEL_FAMILIES.load(a).supports_mtp]
        raise ValueError(
            f"model.mtp_depth: {cfg.name!r} is a {args.architecture} model; arbor builds MTP draft modules for "
            f"{', '.join(mtp)} models only"
        )
    return dataclasses.replace(args, mtp_depth=cfg.mtp_depth)


def build_tokenizer(cfg: ModelSpec) -> Tokenizer:
    if cfg.tokenizer is not None:
        return load_tokenizer(
            cfg.tokenizer if cfg.tokenizer == "byte" else resolve_dir(cfg.tokenizer, "model.tokenizer")
        )
    if cfg.name in PRESETS:
        return ByteTokenizer()
    return load_tokenizer(resolve_dir(cfg.name))


def build_model(cfg: ModelSpec, device: str = "cpu", load: bool = True) -> "nn.Module":
    """The model its family builds (arbor.models.family: dense or MoE Qwen3, DeepSeek sparse attention, ...) on
    `device` in `cfg.dtype`; `load=False` skips weights (meta-device init for FSDP callers)."""
    # Building loads torch; the package itself stays without it for the launcher and config checks (presets, args).
    import torch

    from arbor.models.hf import load_weights  # safetensors and torch: as above

    args = model_args(cfg)
    model = family_of(args).build(args)
    if load:
        if cfg.name in PRESETS:
            model.init_weights(cfg.init_seed)
        else:
            load_weights(model, resolve_dir(cfg.name))
    if hasattr(model, "set_vision_tower"):  # a vision-language model (arbor.models.hf_vision)
        model.set_vision_tower(getattr(cfg, "vision_tower", "frozen"))
    model = model.to(device=device, dtype=getattr(torch, cfg.dtype))
    if load and hasattr(model, "check_attention"):  # the transformers path: refuse what it cannot mask, now
        model.check_attention()
    return model


__all__ = [
    "ModelArgs",
    "ModelSpec",
    "PRESETS",
    "Tokenizer",
    "build_model",
    "build_tokenizer",
    "load_tokenizer",
    "model_args",
    "resolve_dir",
]
