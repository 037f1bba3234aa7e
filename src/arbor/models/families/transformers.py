"""The transformers path: any `*ForCausalLM` the installed transformers builds, trained and served through
transformers' own modules (arbor.models.hf_causal) with arbor around them.

`HFArgs` keeps the checkpoint's `config.json` whole but for a `quantization_config` (the published config is the
checkpoint's own, for the unquantised weights arbor trains) and reads the few fields arbor's processes ask of
every model. Parameter names are the module's own; a model whose checkpoint layout differs from its modules
(transformers' weight conversions, e.g. per-expert MoE tensors fused on load) is mapped by transformers' own
conversion tables, both ways. No torch here: preflight reads configs through it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from arbor.models.hf_args import HFArgs
from arbor.models.quantization import without_quantization

if TYPE_CHECKING:  # annotations only: the model and tensors load torch
    import torch
    from torch import nn

REFUSED_SETTINGS = {
    "trainer.parallel.ep > 1": "expert parallelism",
    "trainer.parallel.cp > 1": "context parallelism",
    "model.router_replay = true": "router replay",
    'model.fp8 = "block"': "FP8 layers",
    "model.mtp_depth > 0": "MTP draft modules",
}
"""What the transformers path cannot honour, refused at config time (arbor.config.layout): setting -> feature."""


@dataclasses.dataclass(frozen=True)
class TransformersFamily:
    """Every `*ForCausalLM` class of the installed transformers (`model.impl = "transformers"`, or "auto" where
    no native family serves the architecture: arbor.models.family.choose_family)."""

    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    args_class: type = HFArgs
    supports_mtp: bool = False
    supports_moe: bool = False
    dsa: bool = False

    def from_hf_config(self, config: dict[str, Any]) -> HFArgs:
        # A quantised checkpoint is read dequantised, then trained and published unquantised: its config says so.
        config = without_quantization(config)
        return HFArgs(config=config, architecture=(config.get("architectures") or [""])[0])

    def to_hf_config(self, args: HFArgs) -> dict[str, Any]:
        return dict(args.config)

    def build(self, args: HFArgs) -> "nn.Module":
        # torch and transformers only when a model is built: reading a config stays torch-free
        from arbor.models.hf_causal import HFCausalLM
        from arbor.models.hf_vision import HFVisionLM

        return HFVisionLM(args) if args.vision else HFCausalLM(args)

    def to_hf_state(self, state: dict[str, "torch.Tensor"], args: HFArgs) -> dict[str, "torch.Tensor"]:
        from arbor.models.hf_causal import checkpoint_state  # torch: see `build`

        return checkpoint_state(state, args)

    def from_hf_state(self, state: dict[str, "torch.Tensor"], args: HFArgs) -> dict[str, "torch.Tensor"]:
        from arbor.models.hf_causal import module_state  # torch: see `build`

        return module_state(state, args)


TRANSFORMERS = TransformersFamily()
