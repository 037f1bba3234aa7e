"""The model directory the vLLM backend serves (arbor.inference.vllm.server): a checkpoint or hub name as it
is, a preset materialised once as a Hugging Face directory with its tokenizer's export, with `model.fp8 =
"block"` a DeepSeek-format block-FP8 checkpoint, and a quantised checkpoint otherwise (gpt-oss's MXFP4, a
Qwen3-*-FP8) as a dequantised copy: the trainer publishes unquantised weights, which vLLM's quantised layers
would take as quantised values (a frozen teacher's is served as published on the CUDA build)."""

from __future__ import annotations

from pathlib import Path

import torch

from arbor.config.inference import InferenceConfig
from arbor.inference.vllm.launch import materialized_path, serves_as_published, vllm_build
from arbor.models import PRESETS, build_model, build_tokenizer, model_args
from arbor.models.checkpoint_copies import write_block_fp8, write_dequantized, write_once
from arbor.models.family import read_config
from arbor.models.hf import save_checkpoint_dir
from arbor.models.hub import resolve_dir
from arbor.models.quantization import is_quantized, is_served_block_fp8


def model_dir(cfg: InferenceConfig) -> tuple[str, bool]:
    """A directory (or hub name) vLLM can load, and whether it lacks a HF tokenizer. Presets are materialized
    (with the byte tokenizer's Hugging Face export); with `model.fp8 = "block"` the directory is a
    DeepSeek-format FP8 checkpoint (`fp8_model_dir`), else a quantised checkpoint's dequantised copy
    (`dequantized_model_dir`)."""
    name = cfg.model.name
    if name not in PRESETS:
        path = Path(name)
        no_tok = path.is_dir() and not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        if cfg.model.fp8 == "block":
            return fp8_model_dir(cfg), no_tok
        return dequantized_model_dir(cfg) or name, no_tok
    return fp8_model_dir(cfg) if cfg.model.fp8 == "block" else _materialize(cfg, fp8=False), False


def dequantized_model_dir(cfg: InferenceConfig) -> str | None:
    """A quantised checkpoint's dequantised copy in the model's dtype (arbor.models.checkpoint_copies), written
    once beside the materialised presets; None for an unquantised checkpoint, or one a frozen server serves as
    published (`serves_as_published`)."""
    source = resolve_dir(cfg.model.name)
    if serves_as_published(cfg, vllm_build()) or not is_quantized(read_config(source)):
        return None
    dtype = getattr(torch, cfg.model.dtype)
    out = materialized_path(cfg, fp8=False, dequantized=True)
    return str(write_once(out, lambda partial: write_dequantized(source, partial, dtype)))


def _materialize(cfg: InferenceConfig, fp8: bool) -> str:
    """Writes the model `build_model` makes (a preset) as a HF directory with its tokenizer's export, once."""
    tokenizer = build_tokenizer(cfg.model)

    def write(partial: Path) -> None:
        model = build_model(cfg.model)
        save_checkpoint_dir(model.state_dict(), model.args, partial, tokenizer, fp8=fp8)

    out = write_once(materialized_path(cfg, fp8), write)
    tokenizer.save(out)  # kept from an earlier run, perhaps of an older arbor: its tokenizer export refreshed
    return str(out)


def fp8_model_dir(cfg: InferenceConfig) -> str:
    """The checkpoint in DeepSeek's FP8 format (float8 weights + `weight_scale_inv`, `quantization_config` with
    `weight_block_size [128, 128]`), which vLLM serves with its block-FP8 linear method (DeepGEMM/CUTLASS on
    Hopper) and which the trainer publishes after every step. A checkpoint already in that format is used as
    is; any other is quantised once, one file at a time, into a temporary directory (`write_block_fp8`; a preset
    is built and written). Routed MoE experts and routers stay in high precision, as arbor trains them: the
    checkpoint lists them in `modules_to_not_convert`, which vLLM's fp8 method serves unquantised
    (arbor.models.quantization.high_precision_modules)."""
    if cfg.model.name in PRESETS:
        return _materialize(cfg, fp8=True)
    source, args = resolve_dir(cfg.model.name), model_args(cfg.model)
    if is_served_block_fp8(read_config(source), args):
        return str(source)
    dtype = getattr(torch, cfg.model.dtype)
    out = materialized_path(cfg, fp8=True)
    return str(write_once(out, lambda partial: write_block_fp8(source, partial, args, dtype)))


def served_head_dim(cfg: InferenceConfig) -> int | None:
    """The model's attention head size where arbor reads the model; None for what only vLLM loads (a DeepSeek-V3
    checkpoint, say), whose kernels are then vLLM's to check."""
    try:
        return getattr(model_args(cfg.model), "head_dim", None)
    except (ValueError, KeyError, OSError):
        return None
