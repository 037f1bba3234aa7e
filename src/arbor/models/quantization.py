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


def is_served_block_fp8(config: dict[str, Any], args) -> bool:
    """Whether a checkpoint is already the block-FP8 directory vLLM serves under `model.fp8 = "block"` (DeepSeek's
    128x128 format with the modules arbor keeps in high precision unquantised), so it is served as it is."""
    quant = quantization_config(config) or {}
    kept = set(quant.get("modules_to_not_convert") or quant.get("ignored_layers") or [])
    block = quant.get("quant_method") == "fp8" and list(quant.get("weight_block_size") or []) == [128, 128]
    return block and kept >= set(high_precision_modules(args))


def high_precision_modules(args) -> list[str]:
    """The modules of an FP8 checkpoint that stay in high precision although a block-FP8 server would quantise
    them (`args`: ModelArgs or DSAArgs): every MoE layer's router (`mlp.gate`) and routed experts (`mlp.experts`,
    which arbor trains in the model's dtype: their grouped GEMM is not block-quantised) and, for DeepSeek sparse
    attention, MLA's `kv_b_proj`. Written as `modules_to_not_convert` in the `quantization_config`, which vLLM's
    fp8 method (its `ignored_layers`, matched exactly) and transformers read: vLLM then serves those layers
    unquantised, with the trainer's weights, instead of quantising its fused experts."""
    names = [f"model.layers.{i}.mlp.{m}" for i in args.moe_layers for m in ("gate", "experts")]
    if getattr(args, "is_dsa", False):
        names += [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(args.num_hidden_layers)]
    return names


def block_fp8_bytes(args, width: int) -> int:
    """About the size of the model's block-FP8 checkpoint (arbor.models.checkpoint_copies.write_block_fp8) whose
    high-precision tensors take `width` bytes a parameter: the embeddings and head, routed experts and routers (and
    MLA's kv_b_proj) at `width`, every other parameter one byte (its 128x128 block scales are negligible)."""
    h = args.hidden_size
    high = args.vocab_size * h * (1 if args.tie_word_embeddings else 2)
    high += len(args.moe_layers) * args.num_experts * (3 * h * args.moe_intermediate_size + h)
    if getattr(args, "is_dsa", False):
        per_head = args.qk_nope_head_dim + args.v_head_dim
        high += args.num_hidden_layers * args.kv_lora_rank * args.num_attention_heads * per_head
    total = args.num_params()
    return (total - min(high, total)) + min(high, total) * width
