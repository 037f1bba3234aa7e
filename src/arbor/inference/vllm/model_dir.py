"""The model directory the vLLM backend serves (arbor.inference.vllm.server): a checkpoint or hub name as it
is, a preset materialised once as a Hugging Face directory with its tokenizer's export, with `model.fp8 =
"block"` a DeepSeek-format block-FP8 checkpoint, and a quantised checkpoint otherwise (gpt-oss's MXFP4, a
Qwen3-*-FP8) as a dequantised copy: the trainer publishes unquantised weights, which vLLM's quantised layers
would take as quantised values (a frozen teacher's is served as published on the CUDA build)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from arbor.config.inference import InferenceConfig
from arbor.inference.vllm.launch import materialized_path, serves_as_published, vllm_build
from arbor.models import PRESETS, build_model, build_tokenizer, model_args
from arbor.models.family import read_config
from arbor.models.fp8 import high_precision_modules
from arbor.models.hf import save_checkpoint_dir, write_dequantized
from arbor.models.hub import resolve_dir
from arbor.models.quantization import is_quantized


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
    """A quantised checkpoint's dequantised copy in the model's dtype (arbor.models.hf.write_dequantized), written
    once beside the materialised presets; None for an unquantised checkpoint, or one a frozen server serves as
    published (`serves_as_published`)."""
    source = resolve_dir(cfg.model.name)
    if serves_as_published(cfg, vllm_build()) or not is_quantized(read_config(source)):
        return None
    out = materialized_path(cfg, fp8=False, dequantized=True)
    if not (out / "config.json").exists():  # config.json last: a copy cut short is written again
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_dequantized(source, partial, getattr(torch, cfg.model.dtype))
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return str(out)


def _materialize(cfg: InferenceConfig, fp8: bool) -> str:
    """Writes the model `build_model` makes (a preset, or a checkpoint re-saved) as a HF directory, once."""
    out = materialized_path(cfg, fp8)
    tokenizer = build_tokenizer(cfg.model)
    # A directory written before tokenizers were exported lacks tokenizer_config.json: rewrite it.
    if not (out / "config.json").exists() or not (out / "tokenizer_config.json").exists():
        model = build_model(cfg.model)
        save_checkpoint_dir(model.state_dict(), model.args, out, tokenizer, fp8=fp8)
    else:  # kept from an earlier run, perhaps of an older arbor: its tokenizer export (chat template) refreshed
        tokenizer.save(out)
    return str(out)


def fp8_model_dir(cfg: InferenceConfig) -> str:
    """The checkpoint in DeepSeek's FP8 format (float8 weights + `weight_scale_inv`, `quantization_config` with
    `weight_block_size [128, 128]`), which vLLM serves with its block-FP8 linear method (DeepGEMM/CUTLASS on
    Hopper) and which the trainer publishes after every step. A checkpoint already in that format is used as
    is; any other is quantised once into a temporary directory. Routed MoE experts and routers stay in high
    precision, as arbor trains them: the checkpoint lists them in `modules_to_not_convert`, which vLLM's fp8 method
    serves unquantised (arbor.models.fp8.high_precision_modules)."""
    path = Path(cfg.model.name)
    if (path / "config.json").exists():
        quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        kept = set(quant.get("modules_to_not_convert") or quant.get("ignored_layers") or [])
        block_fp8 = quant.get("quant_method") == "fp8" and quant.get("weight_block_size") == [128, 128]
        if block_fp8 and kept >= set(high_precision_modules(model_args(cfg.model))):
            return str(path)
    return _materialize(cfg, fp8=True)


def served_head_dim(cfg: InferenceConfig) -> int | None:
    """The model's attention head size where arbor reads the model; None for what only vLLM loads (a DeepSeek-V3
    checkpoint, say), whose kernels are then vLLM's to check."""
    try:
        return getattr(model_args(cfg.model), "head_dim", None)
    except (ValueError, KeyError, OSError):
        return None
