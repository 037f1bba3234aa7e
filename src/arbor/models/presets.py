"""Tiny model presets that need no download: architectures sized for CPU runs and tests, byte tokenizer."""

from __future__ import annotations

from arbor.models.args import DSAArgs, ModelArgs, SigmoidMoEArgs

BYTE_VOCAB = 264  # 259 byte-tokenizer ids padded to a multiple of 8

_TEST = dict(  # the shape of the ~0.1M-parameter test presets
    vocab_size=BYTE_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=10_000.0,
    max_position_embeddings=512,
)

PRESETS: dict[str, ModelArgs | SigmoidMoEArgs | DSAArgs] = {
    # ~0.1M parameters: unit tests.
    "qwen3-test": ModelArgs(**_TEST),
    # ~1M parameters: the CPU quick start (reverse_text learns in minutes on 2 cores).
    "qwen3-tiny": ModelArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        max_position_embeddings=1024,
    ),
    # ~10M parameters: benchmarks.
    "qwen3-small": ModelArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10_000.0,
        max_position_embeddings=2048,
    ),
    # qwen3-test and qwen3-tiny with one MTP draft module (speculative decoding, online draft training): the
    # module's block is initialised from the last decoder layer (arbor.models.mtp.init_mtp_from_last_layer).
    "qwen3-test-mtp": ModelArgs(
        **_TEST,
        mtp_depth=1,
    ),
    "qwen3-tiny-mtp": ModelArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        max_position_embeddings=1024,
        mtp_depth=1,
    ),
    # ~2.5M parameters, 12 layers and one MTP module: the speculative-decoding benchmark, whose draft (one block)
    # costs a twelfth of the decoder, nearer real MTP models (one layer beside dozens) than qwen3-tiny-mtp's quarter.
    "qwen3-deep-mtp": ModelArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        max_position_embeddings=1024,
        mtp_depth=1,
    ),
    # ~0.2M parameters, 4 experts top-2: MoE unit and distributed tests.
    "qwen3-moe-test": ModelArgs(
        **_TEST,
        architecture="Qwen3MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    # ~1.5M parameters, 8 experts top-2: the CPU MoE example (moe_reverse_text).
    "qwen3-moe-tiny": ModelArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        max_position_embeddings=1024,
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
    ),
    # DeepSeek-V3.2 architecture (MLA + DeepSeek sparse attention), ~0.1M parameters: unit and CP tests. A small
    # index_topk so that even short test rows attend sparsely.
    "dsa-test": DSAArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=8,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    # ~1M parameters: the CPU DSA example (rl with model.name = "dsa-tiny"). Its rope part is 32 wide, as
    # qwen3-tiny's heads are: with 16 (8 frequencies, DeepSeek's 1/3 of the head) the reverse_text warm-up learned
    # the positional copy far slower (SFT loss 1.85 after 60 steps against 1.47 with 32 and qwen3-tiny's 0.98).
    "dsa-tiny": DSAArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    # DSA with DeepSeek MoE layers after the first (4 routed experts in 2 groups, top-2, one shared expert).
    "dsa-moe-test": DSAArgs(
        vocab_size=BYTE_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=8,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
}

# Llama, GLM-4.5-MoE and MiniMax-M2 architectures, ~0.1-0.2M parameters: the native families' unit and distributed
# tests (the GLM preset with q/k/v biases, per-head q/k norm, half-rotary heads, a dense first layer, 4 experts in
# 2 groups and a shared expert; the MiniMax preset with whole-projection q/k norm and rotary_dim 4 of 8).
PRESETS["llama-test"] = ModelArgs(**_TEST, architecture="LlamaForCausalLM", qk_norm="none", tie_word_embeddings=False)
PRESETS["glm4-moe-test"] = SigmoidMoEArgs(
    **_TEST,
    architecture="Glm4MoeForCausalLM",
    attention_bias=True,
    partial_rotary_factor=0.5,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
PRESETS["minimax-m2-test"] = SigmoidMoEArgs(
    **{**_TEST, "intermediate_size": 32},  # MiniMax's config has one MLP width, the experts' (no dense layers)
    architecture="MiniMaxM2ForCausalLM",
    qk_norm="projection",
    partial_rotary_factor=0.5,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
