"""Qwen3 mixture-of-experts decoders (`Qwen3MoeForCausalLM`): per-expert checkpoint tensors, fused in the model."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from arbor.models.args import ModelArgs
from arbor.models.families.qwen3 import Qwen3Family

if TYPE_CHECKING:  # annotations only: the model and tensors load torch
    import torch
    from torch import nn


@dataclasses.dataclass(frozen=True)
class Qwen3MoeFamily(Qwen3Family):
    """`Qwen3MoeForCausalLM` checkpoints (no MTP modules: arbor builds those for dense models only)."""

    architectures: tuple[str, ...] = ("Qwen3MoeForCausalLM",)
    model_types: tuple[str, ...] = ("qwen3_moe",)
    supports_mtp: bool = False
    supports_moe: bool = True

    def build(self, args: ModelArgs) -> "nn.Module":
        # torch only when a model is built: reading a config stays torch-free
        from arbor.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(args)

    def to_hf_state(self, state: dict[str, "torch.Tensor"], args: Any) -> dict[str, "torch.Tensor"]:
        from arbor.models.hf import split_experts  # torch: see `build`

        return split_experts(state)

    def from_hf_state(self, state: dict[str, "torch.Tensor"], args: Any) -> dict[str, "torch.Tensor"]:
        from arbor.models.hf import fuse_experts  # torch: see `build`

        return fuse_experts(state)


QWEN3_MOE = Qwen3MoeFamily()
