"""The model directory the vLLM backend serves (arbor.inference.vllm_adapter): a checkpoint or hub name as it
is, a preset materialised once as a Hugging Face directory with its tokenizer's export, or with `model.fp8 =
"block"` a DeepSeek-format block-FP8 checkpoint; and the tokenizer's id count when the head has more rows (the
padding mask's bound, arbor.inference.vllm_logits)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from arbor.config.inference import InferenceConfig
from arbor.inference.vllm_launch import materialized_path
from arbor.models import PRESETS, build_model, build_tokenizer, model_args
from arbor.models.hf import save_checkpoint_dir
from arbor.models.hub import resolve_dir

log = logging.getLogger("arbor.inference.vllm")


def model_dir(cfg: InferenceConfig) -> tuple[str, bool]:
    """A directory (or hub name) vLLM can load, and whether it lacks a HF tokenizer. Presets are materialized
    (with the byte tokenizer's Hugging Face export); with `model.fp8 = "block"` the directory is a
    DeepSeek-format FP8 checkpoint (`fp8_model_dir`)."""
    name = cfg.model.name
    if name not in PRESETS:
        path = Path(name)
        no_tok = path.is_dir() and not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        return (fp8_model_dir(cfg) if cfg.model.fp8 == "block" else name), no_tok
    return fp8_model_dir(cfg) if cfg.model.fp8 == "block" else _materialize(cfg, fp8=False), False


def _materialize(cfg: InferenceConfig, fp8: bool) -> str:
    """Writes the model `build_model` makes (a preset, or a checkpoint re-saved) as a HF directory, once."""
    out = materialized_path(cfg, fp8)
    # A directory written before tokenizers were exported lacks tokenizer_config.json: rewrite it.
    if not (out / "config.json").exists() or not (out / "tokenizer_config.json").exists():
        model = build_model(cfg.model)
        save_checkpoint_dir(model.state_dict(), model.args, out, build_tokenizer(cfg.model), fp8=fp8)
    return str(out)


def fp8_model_dir(cfg: InferenceConfig) -> str:
    """The checkpoint in DeepSeek's FP8 format (float8 weights + `weight_scale_inv`, `quantization_config` with
    `weight_block_size [128, 128]`), which vLLM serves with its block-FP8 linear method (DeepGEMM/CUTLASS on
    Hopper) and which the trainer publishes after every step. A checkpoint already in that format is used as
    is; any other is quantised once into a temporary directory. Routed MoE experts are not FP8 in arbor, but
    vLLM's fp8 method would quantise its fused experts too, so MoE models are refused here."""
    if model_args(cfg.model).is_moe:
        raise ValueError(f"model.fp8 = 'block' with inference.backend = 'vllm' supports dense models only; "
                         f"{cfg.model.name} is an MoE model (use the local engine or model.fp8 = 'none')")
    path = Path(cfg.model.name)
    if (path / "config.json").exists():
        quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        if quant.get("quant_method") == "fp8" and quant.get("weight_block_size") == [128, 128]:
            return str(path)
    return _materialize(cfg, fp8=True)


def padding_bound(cfg: InferenceConfig, skip_tokenizer: bool) -> int | None:
    """The tokenizer's id count when the model's head has more rows (vLLM is then kept off the rest by
    `arbor.inference.vllm_logits`), else None. A directory served on ids only (`skip_tokenizer`) with no
    `model.tokenizer` has no tokenizer to bound it: every row is an id. Under speculative decoding vLLM 0.32
    refuses custom logits processors (its engine fails to start), so there is no mask either: the padding rows
    stay sampleable, as in plain vLLM (negligible for a trained checkpoint, whose padding logits sit far below)."""
    if skip_tokenizer and cfg.model.tokenizer is None:
        return None
    vocab, rows = build_tokenizer(cfg.model).vocab_size, head_rows(cfg)
    if vocab >= rows:
        return None
    if cfg.speculative.enabled:
        log.warning("inference.speculative with vLLM: no padding mask (vLLM 0.32 refuses custom logits processors "
                    "under speculative decoding), so ids %d..%d of the head stay sampleable", vocab, rows - 1)
        return None
    return vocab


def head_rows(cfg: InferenceConfig) -> int:
    """Rows of the model's head: a preset's, else its checkpoint config's `vocab_size` (read from config.json, so
    that any architecture vLLM serves is measured, not only those arbor builds)."""
    if cfg.model.name in PRESETS:
        return PRESETS[cfg.model.name].vocab_size
    conf = json.loads((resolve_dir(cfg.model.name) / "config.json").read_text())
    return int(conf.get("vocab_size") or conf.get("text_config", {})["vocab_size"])
