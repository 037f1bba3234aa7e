"""Llama-style dense decoders: `LlamaForCausalLM`, `Qwen2ForCausalLM` (Qwen2 and Qwen2.5) and `MistralForCausalLM`,
built as arbor's dense decoder (arbor.models.qwen3) without q/k norm, with each architecture's biases: Llama's
`attention_bias` (q/k/v/o) and `mlp_bias`, Qwen2's q/k/v biases, none for Mistral. RoPE scaling (linear, llama3,
YaRN) as `rope_parameters` gives it. Sliding-window attention is refused where it would act (Qwen2's
`use_sliding_window`, a Mistral window shorter than the context): arbor's attention sees the whole context."""

from __future__ import annotations

import dataclasses
from typing import Any

from arbor.models.args import ModelArgs
from arbor.models.families.qwen3 import Qwen3Family

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def _check_window(config: dict[str, Any], arch: str) -> None:
    window = config.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        acts = config.get("use_sliding_window", False) and window is not None
    else:
        acts = window is not None and window < config.get("max_position_embeddings", 0)
    if acts:
        raise ValueError(
            f"sliding_window = {window}: arbor's native {arch} attends to the whole context (a window shorter than "
            f"max_position_embeddings = {config.get('max_position_embeddings')} is not implemented)"
        )


@dataclasses.dataclass(frozen=True)
class LlamaFamily(Qwen3Family):
    """Dense Llama, Qwen2/2.5 and Mistral checkpoints (no MTP modules)."""

    architectures: tuple[str, ...] = tuple(MODEL_TYPES)
    model_types: tuple[str, ...] = tuple(MODEL_TYPES.values())
    supports_mtp: bool = False

    def from_hf_config(self, config: dict[str, Any]) -> ModelArgs:
        args = ModelArgs.from_hf_config(config)
        arch = args.architecture
        _check_window(config, arch)
        qkv = {"LlamaForCausalLM": args.attention_bias, "Qwen2ForCausalLM": True}.get(arch, False)
        return dataclasses.replace(
            args,
            qk_norm="none",
            attention_bias=qkv,
            o_proj_bias=qkv and arch == "LlamaForCausalLM",
            mlp_bias=bool(config.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
        )

    def to_hf_config(self, args: ModelArgs) -> dict[str, Any]:
        out = args.to_hf_config() | {"model_type": MODEL_TYPES[args.architecture]}
        if args.architecture == "LlamaForCausalLM":
            out["mlp_bias"] = args.mlp_bias
        elif args.architecture == "Qwen2ForCausalLM":
            out.pop("attention_bias")
            out["use_sliding_window"] = False
        else:
            out.pop("attention_bias")
            out["sliding_window"] = None
        return out


LLAMA = LlamaFamily()
