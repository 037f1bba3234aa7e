"""`[model]`: which model every process builds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arbor.config.base import Config, Count, Seed


class ModelConfig(Config):
    name: str = "qwen3-tiny"
    """A built-in preset (qwen3-test, qwen3-tiny, qwen3-small, qwen3-test-mtp, qwen3-tiny-mtp (one MTP draft module), qwen3-moe-test, qwen3-moe-tiny; DeepSeek sparse
    attention: dsa-test, dsa-tiny, dsa-moe-test), a local Hugging Face checkpoint directory, or a Hugging Face hub
    id such as "Qwen/Qwen3-4B" (Qwen3, Qwen3-MoE, DeepSeek-V3.2, GLM-5): taken from the Hugging Face cache
    (HF_HOME), downloaded into it by preflight when missing and the hub is reachable (HF_HUB_OFFLINE unset)."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id, or "byte"; default: the checkpoint's own, or the built-in byte tokenizer for
    presets."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and compute dtype. On CPU keep float32 so trainer and inference logprobs match."""
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
    """Seed of the deterministic initialisation of a preset (ignored for checkpoints)."""
    mtp_depth: Count | None = Field(None, ge=0, le=8)
    """Multi-token-prediction draft modules to build (arbor.models.mtp: speculative decoding drafts, trained online
    by `trainer.draft`); default: the preset's, or the checkpoint's `num_nextn_predict_layers`. A dense Qwen3
    checkpoint without stored modules starts them from its last decoder layer. Dense Qwen3 models only."""
