"""`[model]`: which model every process builds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from arbor.config.base import Config, Count, FilePath, Float, Seed

DEFAULT_LORA_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
]
"""Every attention and MLP projection of the dense, MoE (experts included) and DeepSeek (MLA) models; names
that a model lacks match nothing there."""


class LoRAConfig(Config):
    """`[model.lora]`: train, publish and serve a low-rank adapter on the frozen base model (arbor.models.lora)."""

    rank: int = Field(16, ge=1, le=1024, strict=True)
    """Rank r of each adapter pair (A is [r, in], B is [out, r])."""
    alpha: Float = Field(32.0, gt=0)
    """Scale numerator: the adapter adds (alpha / rank) * B A x to each target's output."""
    dropout: Float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (PEFT's lora_dropout); none at inference."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)
    """Linear layers that get an adapter: a name matches a module whose last name component equals it (MoE expert
    projections as `gate_proj`, `up_proj`, `down_proj`, one pair per expert), or, when it holds regular-expression
    characters, a module whose full Hugging Face path matches it whole. At least one module must match."""
    path: FilePath | None = None
    """A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`, for this base model) to
    start from: the trainer initialises its adapter with it, an `inference` server serves it under the adapter
    name from the start (version 0), and `eval` evaluates it. None: training starts from a zero adapter (B = 0:
    the base model), and eval and inference serve the base model until an adapter is loaded."""
    name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Adapter name inference serves it under (the completion's `model`); default: the run's name (the output
    directory's name), else "arbor"."""

    def adapter_name(self, output_dir: object = None) -> str:
        """`name`, else the run's name (the output directory's last component, when it is a valid name), else
        "arbor"."""
        if self.name is not None:
            return self.name
        run = Path(str(output_dir)).resolve().name if output_dir is not None else ""
        return run if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", run) else "arbor"

    @field_validator("target_modules")
    @classmethod
    def _patterns_compile(cls, value: list[str]) -> list[str]:
        for p in value:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"{p!r} is not a valid pattern: {e}") from None
        return value


class ModelConfig(Config):
    name: str = "qwen3-tiny"
    """A built-in preset (qwen3-test, qwen3-tiny, qwen3-small; with one MTP draft module: qwen3-test-mtp,
    qwen3-tiny-mtp, qwen3-deep-mtp; qwen3-moe-test, qwen3-moe-tiny; DeepSeek sparse attention: dsa-test,
    dsa-tiny, dsa-moe-test; llama-test, glm4-moe-test, minimax-m2-test), a local Hugging Face checkpoint directory,
    or a Hugging Face hub id such as "Qwen/Qwen3-4B" (the architectures of arbor.registry.MODEL_FAMILIES: Qwen3,
    Qwen3-MoE, DeepSeek-V3.2, GLM-5, Llama, Qwen2/2.5, Mistral, GLM-4.5/4.6-MoE, MiniMax-M2): taken from the cache
    (HF_HOME), downloaded into it by preflight when missing and the hub is reachable (HF_HUB_OFFLINE unset)."""
    impl: Literal["auto", "native", "transformers"] = "auto"
    """Which implementation builds a checkpoint: "native" arbor's own model (the families of
    arbor.registry.MODEL_FAMILIES), "transformers" transformers' own modules with arbor around them (any
    `*ForCausalLM` of the installed transformers; no expert or context parallelism, router replay, FP8 or MTP),
    "auto" the native one where arbor has it, else transformers. Preflight says which path a run takes and why."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id, or "byte"; default: the checkpoint's own, or the built-in byte tokenizer for
    presets."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the trainer (over fp32 master weights and optimizer state) and of the inference engine,
    and the dtype of published weights; what stays fp32 where: docs/training.md, "bfloat16". bfloat16 runs of the
    MoE and CP recipes learn like float32 ones (benchmarks/bf16_learning.py) but run several times slower on CPU,
    so the CPU recipes keep float32 (trainer and engine logprobs then match to ~1e-14)."""
    router_replay: bool = False
    """MoE router replay (R3): the inference engine returns the experts it chose for every token and MoE layer,
    and the trainer routes each token to exactly those experts (gathering their router scores), so trainer
    and inference compute the same function. Ignored for dense models."""
    fp8: Literal["none", "block"] = "none"
    """FP8 linear layers in DeepSeek-V3's block-scaled format (e4m3; activations in 1x128 tiles, weights in
    128x128 blocks with float32 scales; see arbor.models.fp8). "block" makes the trainer compute attention
    projections and dense MLPs in FP8 (master weights and optimizer state stay in full precision), the local
    engine run the same FP8 forward, and published weights use DeepSeek's FP8 checkpoint format (float8 `weight`
    + `weight_scale_inv`), which vLLM serves with its block `fp8` quantisation, so both sides compute alike.
    Embeddings, lm_head, norms, MoE routers and routed experts stay in `dtype`. Needs file weight transport."""
    init_seed: Seed = 0
    """Seed of the deterministic initialisation of a preset (ignored for checkpoints), and of LoRA's A matrices."""
    mtp_depth: Count | None = Field(None, ge=0, le=8)
    """Multi-token-prediction draft modules to build (arbor.models.mtp: speculative decoding drafts, trained online
    by `trainer.draft`); default: the preset's, or the checkpoint's `num_nextn_predict_layers`. A dense Qwen3
    checkpoint without stored modules starts them from its last decoder layer. Dense Qwen3 models only."""
    vision_tower: Literal["frozen", "trainable"] = "frozen"
    """A vision-language checkpoint's image encoder (arbor.models.hf_vision): "frozen" trains the language model
    only (the tower's parameters take no gradient and no optimizer state; images still shape the text's
    logprobs), "trainable" trains the tower too. Ignored for text models. A LoRA run (`[model.lora]`) adapts the
    modules its patterns match, the tower's included when they match its names."""
    lora: LoRAConfig | None = None
    """`[model.lora]`: train and serve a LoRA adapter instead of the full weights (absent: full fine-tuning)."""
