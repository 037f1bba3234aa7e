"""GLM-4.5/4.6 mixture-of-experts decoders (`Glm4MoeForCausalLM`, prime-rl's INTELLECT-3 base): grouped-query
attention with q/k/v biases, optional per-head q/k norm and partial rotary, DeepSeek-V3-routed experts with shared
experts after `first_k_dense_replace` dense layers (arbor.models.glm4_moe). The MTP layers its checkpoints store
after the decoder's are neither trained nor served: dropped on load."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from arbor.models.args import ModelArgs, SigmoidMoEArgs
from arbor.models.families.qwen3_moe import Qwen3MoeFamily

if TYPE_CHECKING:  # annotations only: the model and tensors load torch
    import torch
    from torch import nn


def sigmoid_moe_args(dense: ModelArgs, **moe: Any) -> SigmoidMoEArgs:
    """`dense`'s attention and embedding fields with the routed experts `moe` (SigmoidMoEArgs' own fields and
    ModelArgs' expert fields)."""
    return SigmoidMoEArgs(**{**{f.name: getattr(dense, f.name) for f in dataclasses.fields(ModelArgs)}, **moe})


def check_sigmoid_router(config: dict[str, Any], arch: str) -> None:
    if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"{arch}: arbor routes with scoring_func = 'sigmoid' and topk_method = 'noaux_tc' only")


@dataclasses.dataclass(frozen=True)
class Glm4MoeFamily(Qwen3MoeFamily):
    """`Glm4MoeForCausalLM` checkpoints: per-expert tensors on disk (`mlp.experts.{e}.gate_proj.weight`), fused
    in the model."""

    architectures: tuple[str, ...] = ("Glm4MoeForCausalLM",)
    model_types: tuple[str, ...] = ("glm4_moe",)
    args_class: type = SigmoidMoEArgs

    def from_hf_config(self, config: dict[str, Any]) -> SigmoidMoEArgs:
        check_sigmoid_router(config, "Glm4MoeForCausalLM")
        dense = ModelArgs.from_hf_config(config)
        return sigmoid_moe_args(
            dense,
            qk_norm="head" if config.get("use_qk_norm", False) else "none",
            o_proj_bias=False,
            num_experts=config["n_routed_experts"],
            num_experts_per_tok=config.get("num_experts_per_tok", 8),
            moe_intermediate_size=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", True),
            n_group=config.get("n_group") or 1,
            topk_group=config.get("topk_group") or 1,
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            n_shared_experts=config.get("n_shared_experts") or 0,
            first_k_dense_replace=config.get("first_k_dense_replace", 1),
            mtp_depth=0,
        )

    def to_hf_config(self, args: SigmoidMoEArgs) -> dict[str, Any]:
        return args._dense_hf_config() | {
            "model_type": "glm4_moe",
            "partial_rotary_factor": args.partial_rotary_factor,  # where vLLM reads it
            "use_qk_norm": args.qk_norm == "head",
            "n_routed_experts": args.num_experts,
            "num_experts_per_tok": args.num_experts_per_tok,
            "moe_intermediate_size": args.moe_intermediate_size,
            "norm_topk_prob": args.norm_topk_prob,
            "n_group": args.n_group,
            "topk_group": args.topk_group,
            "routed_scaling_factor": args.routed_scaling_factor,
            "n_shared_experts": args.n_shared_experts,
            "first_k_dense_replace": args.first_k_dense_replace,
            "num_nextn_predict_layers": 0,
        }

    def build(self, args: SigmoidMoEArgs) -> "nn.Module":
        # torch only when a model is built: reading a config stays torch-free
        from arbor.models.glm4_moe import Glm4MoeForCausalLM

        return Glm4MoeForCausalLM(args)

    def from_hf_state(self, state: dict[str, "torch.Tensor"], args: Any) -> dict[str, "torch.Tensor"]:
        from arbor.models.hf import drop_mtp_layers, fuse_experts  # torch: see `build`

        return fuse_experts(drop_mtp_layers(state, args.num_hidden_layers))


GLM4_MOE = Glm4MoeFamily()
