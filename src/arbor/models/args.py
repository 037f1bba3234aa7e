"""Model hyper-parameters, named as in a Hugging Face `config.json` so that conversion is a plain field copy:
`ModelArgs` (Qwen3 dense and MoE) and `DSAArgs` (DeepSeek sparse attention: DeepSeek-V3.2, GLM-5). No torch here:
the launcher's preflight and the config validation read presets and checkpoint configs without it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from arbor.models.family import args_from_dir


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
    mtp_depth: int = 0
    """Multi-token-prediction draft modules (DeepSeek-V3 style, arbor.models.mtp); stored in Hugging Face
    checkpoints as `num_nextn_predict_layers` layers after the decoder's. Dense models only."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2 always; Llama, Qwen3 and GLM-4.5 with `attention_bias`)."""
    o_proj_bias: bool = False
    """A bias on the attention's output projection (Llama and Qwen3 with `attention_bias`)."""
    mlp_bias: bool = False
    """Biases on the SwiGLU projections (Llama's `mlp_bias`)."""
    qk_norm: str = "head"
    """RMSNorm of queries and keys before RoPE (QK_NORMS): "head" (per head: Qwen3, GLM-4.5 with `use_qk_norm`),
    "projection" (over the whole projection, all heads at once: MiniMax-M2) or "none" (Llama, Qwen2)."""
    rope_scaling: dict[str, Any] | None = None
    """None (plain RoPE) or the checkpoint's `rope_parameters` other than `rope_theta`, with a `rope_type` of
    ROPE_TYPES (arbor.models.rope)."""
    partial_rotary_factor: float = 1.0
    """The fraction of each head's dimensions RoPE rotates (the first ones; GLM-4.5: 0.5)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r} must be one of {QK_NORMS}")
        check_rope(self.rope_scaling)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} must give an even "
                "number of rotated dimensions, at most head_dim"
            )
        if self.mtp_depth < 0 or (self.mtp_depth and self.is_moe):
            raise ValueError(
                f"mtp_depth ({self.mtp_depth}) must be >= 0, and 0 for MoE models (dense MTP modules only)"
            )
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts={self.num_experts}]"
            )
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], moe: bool = False) -> "ModelArgs":
        """A Qwen3-style `config.json` (the family serving its architecture chose this class: arbor.models.family);
        `moe` reads the routed experts (Qwen3-MoE), else the model is dense."""
        arch = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r}: arbor's decoders implement silu (SwiGLU)")
        theta, scaling, partial = read_rope(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            attention_bias=bool(cfg.get("attention_bias", False)),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            architecture=arch,
            num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            # a dense model's args keep the MoE fields' defaults (its config has none to read)
            **({"norm_topk_prob": cfg.get("norm_topk_prob", False)} if moe else {}),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            mtp_depth=cfg.get("num_nextn_predict_layers") or 0,
        )

    def to_hf_config(self) -> dict[str, Any]:
        out = self._dense_hf_config()
        if self.is_moe:
            out.update(
                model_type="qwen3_moe",
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        if self.mtp_depth:
            out["num_nextn_predict_layers"] = self.mtp_depth
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
            "rope_parameters": self.rope_parameters(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "torch_dtype": "float32",
        }

    def rope_parameters(self) -> dict[str, Any]:
        """`config.json`'s `rope_parameters` (transformers 5's layout: type, theta, scaling and partial factor)."""
        out = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out

    @staticmethod
    def from_dir(path: str | Path, impl: str = "auto") -> "ModelArgs | DSAArgs":
        """The checkpoint's architecture, read by the model family serving its `config.json` architecture
        (arbor.registry.MODEL_FAMILIES): DeepSeek sparse attention models (DeepSeek-V3.2, GLM-5) get their own
        `DSAArgs`, which the rest of arbor reads through the same attribute names. An architecture no family
        serves is an `UnsupportedArchitecture` in one line naming `model.name`. `impl` is `model.impl`: any other
        `*ForCausalLM` is read by the transformers path (arbor.models.families.transformers.HFArgs)."""
        return args_from_dir(path, impl)

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        norm = {"head": 2 * self.head_dim, "projection": q + kv, "none": 0}[self.qk_norm]
        bias = (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias
        attn = h * (q + 2 * kv) + q * h + 2 * h + norm + bias
        moe = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        if self.shared_expert_intermediate_size:
            moe += 3 * h * self.shared_expert_intermediate_size + h
        n_moe = len(self.moe_layers)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        mtp = self.mtp_depth * (attn + 3 * h * i + 2 * h * h + 3 * h)  # block, eh_proj, enorm, hnorm, its norm
        dense = 3 * h * i + (2 * i + h) * self.mlp_bias
        return L * attn + n_moe * moe + (L - n_moe) * dense + emb + h + mtp


@dataclasses.dataclass
class SigmoidMoEArgs(ModelArgs):
    """A decoder whose experts are routed DeepSeek-V3's way (GLM-4.5/4.6 MoE, MiniMax-M2): sigmoid scores, experts
    chosen on `scores + e_score_correction_bias` within the `topk_group` best of `n_group` groups, weights the
    chosen scores (renormalised with `norm_topk_prob`) times `routed_scaling_factor`; `n_shared_experts` dense
    experts beside them; the first `first_k_dense_replace` layers dense (`intermediate_size`)."""

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    """Shared experts: one dense SwiGLU MLP of `n_shared_experts * moe_intermediate_size`."""
    first_k_dense_replace: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.is_moe and (self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(
                f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and be >= topk_group "
                f"({self.topk_group})"
            )

    @property
    def n_routed_experts(self) -> int:
        """DeepSeek's name (arbor.models.deepseek_v32.DeepseekRouter reads it)."""
        return self.num_experts

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.first_k_dense_replace

    def num_params(self) -> int:
        shared = 3 * self.hidden_size * self.moe_intermediate_size * self.n_shared_experts + self.num_experts
        return super().num_params() + len(self.moe_layers) * shared


QK_NORMS = ("head", "projection", "none")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The RoPE types arbor's decoders implement (arbor.models.rope)."""


def check_rope(scaling: dict[str, Any] | None) -> None:
    """A ValueError in one line naming a RoPE type arbor does not implement."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type {kind!r}: arbor implements {', '.join(ROPE_TYPES)}")


def read_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling parameters or None for plain RoPE, partial_rotary_factor) of a `config.json`:
    transformers 5 keeps them in `rope_parameters`, older configs in `rope_scaling` (`type` for `rope_type`) and
    at the top level; MiniMax-M2 gives a `rotary_dim`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor")
    if partial is None and cfg.get("rotary_dim") and cfg.get("head_dim"):
        partial = cfg["rotary_dim"] / cfg["head_dim"]
    scaling = None if kind == "default" else {"rope_type": kind, **params}
    check_rope(scaling)
    return theta, scaling, float(partial or 1.0)


DSA_ARCHITECTURES = {"DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}


@dataclasses.dataclass
class DSAArgs:
    """Architecture of a DeepSeek-V3.2 decoder (Hugging Face field names). `n_routed_experts = 0`: dense MLPs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_interleave: bool = True
    """MLA's RoPE on consecutive pairs (DeepSeek's layout); False: on halves."""
    indexer_rope_interleave: bool = False
    """The indexer's RoPE layout: halves for DeepSeek-V3.2 (the reference's 2025-11 fix), pairs for GLM-5."""
    rope_scaling: dict[str, Any] | None = None
    """None (plain RoPE) or YaRN as in DeepSeek's config: {"rope_type": "yarn", "factor",
    "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}."""
    architecture: str = "DeepseekV32ForCausalLM"
    n_routed_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction (MTP) layers that DeepSeek-V3.2 / GLM-5 checkpoints store after the decoder layers
    (`model.layers.{num_hidden_layers + i}`). arbor neither trains nor serves them: their weights are skipped on
    load (arbor.models.hf.load_weights)."""

    is_dsa = True

    def __post_init__(self) -> None:
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim})"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if (
            self.rope_scaling is not None
            and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) != "yarn"
        ):
            raise ValueError(
                f"unsupported rope scaling {self.rope_scaling!r}; the DSA model implements default RoPE and YaRN"
            )
        if self.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {self.index_topk}")
        if self.is_moe and (self.n_routed_experts % self.n_group or self.topk_group > self.n_group):
            raise ValueError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts}) "
                f"and be >= topk_group ({self.topk_group})"
            )

    # -- the interface the rest of arbor reads (same names as ModelArgs) --------------------------------------
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    _FIELDS = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "q_lora_rank",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "rope_interleave",
        "indexer_rope_interleave",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        "first_k_dense_replace",
        "moe_layer_freq",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        "num_nextn_predict_layers",
    )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "DSAArgs":
        arch = (cfg.get("architectures") or ["DeepseekV32ForCausalLM"])[0]
        if arch not in DSA_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} for a DSA model; arbor loads {sorted(DSA_ARCHITECTURES)}"
            )
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "yarn", None):
            raise ValueError(f"unsupported rope scaling {kind!r}; arbor's DSA model implements default RoPE and YaRN")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError("arbor's DSA MoE implements scoring_func = 'sigmoid' with topk_method = 'noaux_tc'")
        kwargs = {f: cfg[f] for f in cls._FIELDS if cfg.get(f) is not None}
        kwargs["rope_theta"] = float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
        if kind == "yarn":
            kwargs["rope_scaling"] = {k: v for k, v in params.items() if k not in ("rope_theta", "type")} | {
                "rope_type": "yarn"
            }
        kwargs.setdefault("indexer_rope_interleave", arch == "GlmMoeDsaForCausalLM")  # GLM-5's default
        if cfg.get("mlp_layer_types"):  # GLM-5 lists dense/sparse per layer; arbor supports a dense prefix
            types = list(cfg["mlp_layer_types"])
            k = types.index("sparse") if "sparse" in types else len(types)
            if any(t != "sparse" for t in types[k:]):
                raise ValueError(f"mlp_layer_types {types}: arbor supports dense layers followed by sparse ones only")
            kwargs["first_k_dense_replace"] = k
        return cls(architecture=arch, **kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": [self.architecture], "model_type": DSA_ARCHITECTURES[self.architecture]}
        out.update({f: getattr(self, f) for f in self._FIELDS})
        rope = dict(self.rope_scaling or {"rope_type": "default"}) | {"rope_theta": self.rope_theta}
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling) | {"type": "yarn"}
        out.update(
            num_key_value_heads=self.num_attention_heads,
            rope_theta=self.rope_theta,
            rope_parameters=rope,
            hidden_act="silu",
            attention_bias=False,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            torch_dtype="float32",
        )
        return out

    def num_params(self) -> int:
        h, H, L = self.hidden_size, self.num_attention_heads, self.num_hidden_layers
        qin = self.q_lora_rank or h
        q = (h * self.q_lora_rank + self.q_lora_rank if self.q_lora_rank else 0) + qin * H * self.qk_head_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim) + H * self.v_head_dim * h
        idx = qin * self.index_n_heads * self.index_head_dim + h * self.index_head_dim + 2 * self.index_head_dim
        idx += h * self.index_n_heads
        moe = 3 * h * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts)
        moe += self.n_routed_experts * (h + 1)
        n_moe = len(self.moe_layers)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * (q + kv + idx + 2 * h) + n_moe * moe + (L - n_moe) * 3 * h * self.intermediate_size + emb + h


def check_cp_style(style: str, dsa: bool) -> None:
    """Raises ValueError unless context-parallel style `style` (`trainer.parallel.cp_style`) can split the
    attention of the model (`dsa`: DeepSeek sparse attention). Beside the model arguments, without torch, so that
    the config validation and the trainer share it."""
    if dsa and style not in ("dsa", "auto"):
        raise ValueError(
            f"trainer.parallel.cp_style = {style!r} cannot split DeepSeek sparse attention over the "
            "context; use 'dsa' (or 'auto')"
        )
    if not dsa and style == "dsa":
        raise ValueError(
            "trainer.parallel.cp_style = 'dsa' needs a DeepSeek sparse attention model; use 'ulysses' or 'ring'"
        )
