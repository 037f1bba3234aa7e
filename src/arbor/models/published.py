"""The architectures of the hub models that `configs/models/` names, as their `config.json` on the Hugging Face hub
gives them, so that `rl plan` sizes them on a machine that has never downloaded them. A checkpoint in the cache
(or a local directory) still wins: arbor.config.layout.model_shape reads it first. No torch here."""

from __future__ import annotations

from arbor.models.args import DSAArgs, ModelArgs


def _qwen3(**kw) -> ModelArgs:
    return ModelArgs(vocab_size=151936, head_dim=128, rope_theta=1e6, max_position_embeddings=40960, **kw)


PUBLISHED_SHAPES: dict[str, ModelArgs | DSAArgs] = {
    # the decoder of Qwen2.5-VL-3B-Instruct (its vision tower: PUBLISHED_VISION)
    "Qwen/Qwen2.5-VL-3B-Instruct": ModelArgs(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        rope_theta=1e6,
        max_position_embeddings=128000,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3-0.6B": _qwen3(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3-4B": _qwen3(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3-8B": _qwen3(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-30B-A3B": _qwen3(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        architecture="Qwen3MoeForCausalLM",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "Qwen/Qwen3-235B-A22B": _qwen3(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        architecture="Qwen3MoeForCausalLM",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
    ),
    "deepseek-ai/DeepSeek-V3.2": DSAArgs(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        first_k_dense_replace=3,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    ),
    "zai-org/GLM-5": DSAArgs(
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        num_hidden_layers=78,
        num_attention_heads=64,
        kv_lora_rank=512,
        q_lora_rank=2048,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        architecture="GlmMoeDsaForCausalLM",
    ),
}
"""Hub id -> architecture (field values copied from each model's `config.json`)."""

PUBLISHED_VISION: dict[str, dict] = {
    # Qwen2.5-VL-3B-Instruct's vision tower as its config.json gives it (arbor.models.vision_params counts it:
    # 0.669B parameters, 3.75B with the decoder above, as published)
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "model_type": "qwen2_5_vl",
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
    },
}
"""The vision configs of the vision-language models in `PUBLISHED_SHAPES` (their shapes there are the decoders')."""
