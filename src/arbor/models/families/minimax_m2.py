"""MiniMax-M2 decoders (`MiniMaxM2ForCausalLM`, Forge's model): grouped-query attention with q/k RMSNorm over the
whole projection and partial rotary (`rotary_dim`), every layer a sigmoid-routed MoE with expert bias and no shared
expert. Built as arbor's GLM-4.5-MoE decoder (arbor.models.glm4_moe); the checkpoint's names
(`block_sparse_moe.experts.{e}.w1/w3/w2`, `block_sparse_moe.e_score_correction_bias`) are mapped here."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from arbor.models.args import ModelArgs, SigmoidMoEArgs
from arbor.models.families.glm4_moe import Glm4MoeFamily, check_sigmoid_router, sigmoid_moe_args

if TYPE_CHECKING:  # annotations only: tensors load torch
    import torch

_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
"""arbor's (and GLM's) per-expert projection names -> MiniMax-M2's."""
_TO_HF = [
    *(
        (re.compile(rf"\.mlp\.experts\.(\d+)\.{ours}\."), rf".block_sparse_moe.experts.\1.{theirs}.")
        for ours, theirs in _EXPERT_NAMES.items()
    ),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".block_sparse_moe.e_score_correction_bias"),
    (re.compile(r"\.mlp\.gate\.weight$"), ".block_sparse_moe.gate.weight"),
]
_FROM_HF = [
    *(
        (re.compile(rf"\.block_sparse_moe\.experts\.(\d+)\.{theirs}\."), rf".mlp.experts.\1.{ours}.")
        for ours, theirs in _EXPERT_NAMES.items()
    ),
    (re.compile(r"\.(block_sparse_moe|mlp)\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
]


def _rename(state: dict[str, "torch.Tensor"], rules: list[tuple[re.Pattern, str]]) -> dict[str, "torch.Tensor"]:
    out = {}
    for name, tensor in state.items():
        for pattern, repl in rules:
            name, n = pattern.subn(repl, name)
            if n:
                break
        out[name] = tensor
    return out


@dataclasses.dataclass(frozen=True)
class MiniMaxM2Family(Glm4MoeFamily):
    architectures: tuple[str, ...] = ("MiniMaxM2ForCausalLM",)
    model_types: tuple[str, ...] = ("minimax_m2",)

    def from_hf_config(self, config: dict[str, Any]) -> SigmoidMoEArgs:
        check_sigmoid_router(config, "MiniMaxM2ForCausalLM")
        if config.get("use_qk_norm", True) is False or config.get("qk_norm_type", "per_layer") != "per_layer":
            raise ValueError("MiniMaxM2ForCausalLM: arbor implements use_qk_norm with qk_norm_type = 'per_layer'")
        return sigmoid_moe_args(
            ModelArgs.from_hf_config(config),
            qk_norm="projection",
            attention_bias=False,
            o_proj_bias=False,
            num_experts=config["num_local_experts"],
            num_experts_per_tok=config.get("num_experts_per_tok", 8),
            moe_intermediate_size=config["intermediate_size"],
            norm_topk_prob=True,
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
            mtp_depth=0,
        )

    def to_hf_config(self, args: SigmoidMoEArgs) -> dict[str, Any]:
        out = args._dense_hf_config() | {
            "model_type": "minimax_m2",
            "intermediate_size": args.moe_intermediate_size,
            "num_local_experts": args.num_experts,
            "num_experts_per_tok": args.num_experts_per_tok,
            "rotary_dim": args.rotary_dim,
            "partial_rotary_factor": args.partial_rotary_factor,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "router_aux_loss_coef": args.router_aux_loss_coef,
        }
        out.pop("attention_bias")
        return out

    def to_hf_state(self, state: dict[str, "torch.Tensor"], args: Any) -> dict[str, "torch.Tensor"]:
        return _rename(super().to_hf_state(state, args), _TO_HF)

    def from_hf_state(self, state: dict[str, "torch.Tensor"], args: Any) -> dict[str, "torch.Tensor"]:
        return super().from_hf_state(_rename(state, _FROM_HF), args)


MINIMAX_M2 = MiniMaxM2Family()
