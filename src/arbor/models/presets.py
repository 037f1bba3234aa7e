"""Tiny model presets that need no download: architectures sized for CPU runs and tests, byte tokenizer."""

from __future__ import annotations

from arbor.models.args import ModelArgs

BYTE_VOCAB = 264  # 259 byte-tokenizer ids padded to a multiple of 8

PRESETS: dict[str, ModelArgs] = {
    # ~0.1M parameters: unit tests.
    "qwen3-test": ModelArgs(
        vocab_size=BYTE_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0, max_position_embeddings=512,
    ),
    # ~1M parameters: the CPU quick start (reverse_text learns in minutes on 2 cores).
    "qwen3-tiny": ModelArgs(
        vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, max_position_embeddings=1024,
    ),
    # ~10M parameters: benchmarks.
    "qwen3-small": ModelArgs(
        vocab_size=BYTE_VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, rope_theta=10_000.0, max_position_embeddings=2048,
    ),
    # ~0.2M parameters, 4 experts top-2: MoE unit and distributed tests.
    "qwen3-moe-test": ModelArgs(
        vocab_size=BYTE_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0, max_position_embeddings=512,
        architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    ),
    # ~1.5M parameters, 8 experts top-2: the CPU MoE example (moe_reverse_text).
    "qwen3-moe-tiny": ModelArgs(
        vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, max_position_embeddings=1024,
        architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
    ),
}
