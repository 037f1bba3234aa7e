"""Quantised checkpoints: which `quantization_config`s arbor reads (by dequantising as it loads), and the one line
that refuses the others when the config is read.

arbor trains and publishes unquantised weights (the model's dtype; block FP8 again with `model.fp8 = "block"`).
Two storage formats are dequantised on load: DeepSeek's block FP8 (`quant_method = "fp8"` with
`weight_block_size = [128, 128]`, e4m3 weights and float32 `weight_scale_inv`: DeepSeek-V3/V3.2, Qwen3-*-FP8,
GLM-5-FP8; arbor.models.fp8) and OpenAI's MXFP4 (`quant_method = "mxfp4"`: gpt-oss's experts as uint8 `*_blocks`
and `*_scales`; arbor.models.mxfp4). Every other method (GPTQ, AWQ, bitsandbytes, compressed-tensors, per-tensor
FP8, ...) stores weights arbor would have to reconstruct from its own kernels' layout: refused in one line naming
the method, before any process starts. No torch here: the launcher's preflight reads configs through it.
"""

from __future__ import annotations

from typing import Any

READ = {"fp8": "block FP8 (128x128 blocks)", "mxfp4": "MXFP4"}
"""quant_method -> what its weights are stored as, for the methods arbor dequantises on load."""


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """A `config.json`'s `quantization_config` (a vision-language model's may sit in its `text_config`)."""
    found = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return found or None


def quantization_refusal(config: dict[str, Any], source: str) -> str | None:
    """Why arbor cannot read the checkpoint `source` with this `config.json` (one line naming `model.name`), or
    None when it is unquantised or stored in a format arbor dequantises."""
    quant = quantization_config(config)
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8" and list(quant.get("weight_block_size") or []) != [128, 128]:
        return (
            f"model.name: {source} is quantised with fp8 without 128x128 weight blocks "
            f"(quantization_config.weight_block_size = {quant.get('weight_block_size')}); arbor reads DeepSeek's "
            "block FP8 only: use the unquantised checkpoint"
        )
    if method not in READ:
        return (
            f"model.name: {source} is quantised with {method!r} (quantization_config.quant_method); arbor trains "
            f"unquantised weights and dequantises only {', '.join(READ)} checkpoints on load: use the unquantised "
            "checkpoint"
        )
    return None


def quantization_note(config: dict[str, Any], dtype: str) -> str:
    """The preflight model line's note on a quantised checkpoint ("" for an unquantised one)."""
    quant = quantization_config(config)
    if quant is None or quant.get("quant_method") not in READ:
        return ""
    return f"; its {READ[quant['quant_method']]} weights are dequantised to {dtype} on load"


def is_quantized(config: dict[str, Any]) -> bool:
    """Whether the checkpoint stores weights quantised (a server must be given a dequantised copy when the run
    publishes unquantised weights into it)."""
    return quantization_config(config) is not None


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """`config.json` of the same model stored unquantised (what arbor publishes, and a dequantised copy holds)."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out
