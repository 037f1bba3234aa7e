"""Model definitions, tiny presets, tokenizers and Hugging Face checkpoint loading.

`build_model(cfg)` is the one way every process gets its model: a preset name builds a tiny model initialised
deterministically from `cfg.init_seed` (identical in trainer and inference), a directory or a Hugging Face hub
id (resolved to its cached snapshot, downloaded when missing: arbor.models.hub) loads a Hugging Face checkpoint,
a layer at a time into a model built without weights. The trainer builds its sharded model from the two halves
(`build_empty`, then `load_initial_weights` after sharding: arbor.trainer.loop.build_sharded).
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


def build_model(cfg: ModelSpec, device: str = "cpu") -> "nn.Module":
    """The model its family builds (arbor.models.family: dense or MoE Qwen3, DeepSeek sparse attention, ...) on
    `device` in `cfg.dtype`, with its weights: a preset's drawn from `cfg.init_seed`, a checkpoint's read layer
    by layer straight into the model on `device` (it is built without weights first: no second copy)."""
    # Building loads torch; the package itself stays without it for the launcher and config checks (presets, args).
    import torch

    from arbor.models.materialize import materialize  # torch: as above

    if cfg.name in PRESETS:
        model = family_of(model_args(cfg)).build(model_args(cfg))
        model.init_weights(cfg.init_seed)
        _set_vision_tower(model, cfg)
        return model.to(device=device, dtype=getattr(torch, cfg.dtype))
    model = build_empty(cfg).to(dtype=getattr(torch, cfg.dtype))
    materialize(model, device)
    load_initial_weights(model, cfg)
    return model


def build_empty(cfg: ModelSpec) -> "nn.Module":
    """The model without its weights (parameters on the meta device, fp32; computed buffers real): what a
    trainer shards before any rank allocates its part (arbor.models.materialize), and `load_initial_weights`
    fills."""
    from arbor.models.materialize import params_on_meta  # torch: see build_model

    args = model_args(cfg)
    with params_on_meta():
        model = family_of(args).build(args)
    _set_vision_tower(model, cfg)
    return model


def load_initial_weights(model: "nn.Module", cfg: ModelSpec) -> None:
    """Fills a materialised `build_empty` model (sharded or not) with its initial weights: a preset's, drawn on the
    host from `cfg.init_seed` (presets are small) and written part by part; a checkpoint's, read one layer at a
    time (arbor.models.hf.load_weights). The transformers path then runs its two-token check (a collective under
    FSDP2, as every forward), so a model it cannot mask is refused now, in one line."""
    from arbor.models.hf import copy_model_state, load_weights  # safetensors and torch: see build_model

    if cfg.name in PRESETS:
        host = family_of(model.args).build(model.args)
        host.init_weights(cfg.init_seed)
        copy_model_state(model, host.state_dict(), f"preset {cfg.name}")
    else:
        load_weights(model, resolve_dir(cfg.name))
    if hasattr(model, "check_attention"):  # the transformers path: refuse what it cannot mask, now
        model.check_attention()


def _set_vision_tower(model: "nn.Module", cfg: ModelSpec) -> None:
    if hasattr(model, "set_vision_tower"):  # a vision-language model (arbor.models.hf_vision)
        model.set_vision_tower(getattr(cfg, "vision_tower", "frozen"))


__all__ = [
    "ModelArgs",
    "ModelSpec",
    "PRESETS",
    "Tokenizer",
    "build_empty",
    "build_model",
    "build_tokenizer",
    "load_initial_weights",
    "load_tokenizer",
    "model_args",
    "resolve_dir",
]
