"""Qwen3 dense decoders (`Qwen3ForCausalLM`), with optional multi-token-prediction draft modules."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from arbor.models.args import ModelArgs

if TYPE_CHECKING:  # annotations only: the model and tensors load torch
    import torch
    from torch import nn


@dataclasses.dataclass(frozen=True)
class Qwen3Family:
    """`Qwen3ForCausalLM` checkpoints; a subclass (or another instance) serves a look-alike architecture."""

    architectures: tuple[str, ...] = ("Qwen3ForCausalLM",)
    model_types: tuple[str, ...] = ("qwen3",)
    args_class: type = ModelArgs
    supports_mtp: bool = True
    supports_moe: bool = False
    dsa: bool = False

    def from_hf_config(self, config: dict[str, Any]) -> ModelArgs:
        return ModelArgs.from_hf_config(config, moe=self.supports_moe)

    def to_hf_config(self, args: ModelArgs) -> dict[str, Any]:
        return args.to_hf_config()

    def build(self, args: ModelArgs) -> "nn.Module":
        # torch only when a model is built: reading a config stays torch-free
        from arbor.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM(args)

    def to_hf_state(self, state: dict[str, "torch.Tensor"], args: ModelArgs) -> dict[str, "torch.Tensor"]:
        from arbor.models.mtp import mtp_to_hf  # torch: see `build`

        return mtp_to_hf(state, args.num_hidden_layers) if args.mtp_depth else state

    def from_hf_state(self, state: dict[str, "torch.Tensor"], args: ModelArgs) -> dict[str, "torch.Tensor"]:
        from arbor.models.mtp import mtp_from_hf  # torch: see `build`

        return mtp_from_hf(state, args.num_hidden_layers) if args.mtp_depth else state


QWEN3 = Qwen3Family()
