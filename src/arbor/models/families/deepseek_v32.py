"""DeepSeek sparse attention decoders: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5
(`GlmMoeDsaForCausalLM`), one model class (arbor.models.deepseek_v32) for both."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from arbor.models.args import DSA_ARCHITECTURES, DSAArgs

if TYPE_CHECKING:  # annotations only: the model and tensors load torch
    import torch
    from torch import nn


@dataclasses.dataclass(frozen=True)
class DSAFamily:
    """MLA + DeepSeek sparse attention, dense or MoE. The MTP layers its checkpoints store after the decoder's
    are neither trained nor served: dropped on load."""

    architectures: tuple[str, ...] = tuple(DSA_ARCHITECTURES)
    model_types: tuple[str, ...] = tuple(DSA_ARCHITECTURES.values())
    args_class: type = DSAArgs
    supports_mtp: bool = False
    supports_moe: bool = True
    dsa: bool = True

    def from_hf_config(self, config: dict[str, Any]) -> DSAArgs:
        return DSAArgs.from_hf_config(config)

    def to_hf_config(self, args: DSAArgs) -> dict[str, Any]:
        return args.to_hf_config()

    def build(self, args: DSAArgs) -> "nn.Module":
        # torch only when a model is built: reading a config stays torch-free
        from arbor.models.deepseek_v32 import DeepseekV32ForCausalLM

        return DeepseekV32ForCausalLM(args)

    def to_hf_state(self, state: dict[str, "torch.Tensor"], args: DSAArgs) -> dict[str, "torch.Tensor"]:
        from arbor.models.hf import split_experts  # torch: see `build`

        return split_experts(state)

    def from_hf_state(self, state: dict[str, "torch.Tensor"], args: DSAArgs) -> dict[str, "torch.Tensor"]:
        from arbor.models.hf import drop_mtp_layers, fuse_experts  # torch: see `build`

        if args.num_nextn_predict_layers:
            state = drop_mtp_layers(state, args.num_hidden_layers)
        return fuse_experts(state)


DSA = DSAFamily()
