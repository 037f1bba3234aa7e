"""Model hyper-parameters, named as in a Hugging Face `config.json` so that conversion is a plain field copy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class ModelArgs:
    """Architecture of a Qwen3-style dense decoder (the field names are Hugging Face's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    architecture: str = "Qwen3ForCausalLM"
    # Mixture of experts (Qwen3-MoE); num_experts = 0 is the dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE style shared expert (sigmoid-gated dense MLP beside the routed experts); 0 = none, as Qwen3-MoE."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def __post_init__(self) -> None:
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts={self.num_experts}]")
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        arch = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; arbor loads {sorted(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            architecture=arch,
            num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if arch == "Qwen3MoeForCausalLM" else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
        )

    def to_hf_config(self) -> dict[str, Any]:
        out = self._dense_hf_config()
        if self.is_moe:
            out.update(
                model_type="qwen3_moe", num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        return out

    def _dense_hf_config(self) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        """The checkpoint's architecture: DeepSeek sparse attention models (DeepSeek-V3.2, GLM-5) get their own
        `arbor.models.deepseek_v32.DSAArgs`, which the rest of arbor reads through the same attribute names."""
        cfg = json.loads((Path(path) / "config.json").read_text())
        from arbor.models.deepseek_v32 import DSA_ARCHITECTURES, DSAArgs

        arch = (cfg.get("architectures") or [""])[0]
        if arch in DSA_ARCHITECTURES or cfg.get("model_type") in DSA_ARCHITECTURES.values():
            return DSAArgs.from_hf_config(cfg)  # type: ignore[return-value]
        return cls.from_hf_config(cfg)

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + 2 * h + 2 * self.head_dim
        moe = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        if self.shared_expert_intermediate_size:
            moe += 3 * h * self.shared_expert_intermediate_size + h
        n_moe = len(self.moe_layers)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * attn + n_moe * moe + (L - n_moe) * 3 * h * i + emb + h


SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into `rope_parameters`; older configs keep it at the top level.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"unsupported rope_type {params['rope_type']!r}; arbor implements the default RoPE")
    return float(params.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
