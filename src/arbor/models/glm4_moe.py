"""A GLM-4.5/4.6-MoE-architecture decoder (`Glm4MoeForCausalLM`), which also builds MiniMax-M2
(`MiniMaxM2ForCausalLM`): grouped-query attention with DeepSeek-V3-routed experts.

The pieces are arbor's own, put together: the dense decoder's attention (arbor.models.qwen3, with q/k/v biases,
partial rotary and per-head or whole-projection q/k norm as `ModelArgs` says) and DeepSeek's MoE block
(arbor.models.deepseek_v32.DeepseekMoE: sigmoid scores, `e_score_correction_bias` for the choice, group-limited
top-k, `routed_scaling_factor`, shared experts), inside the Qwen3-MoE model's forward (router replay,
`last_routed_experts`, expert parallelism through the same grouped experts). Dense layers come first
(`first_k_dense_replace`). Parameter names are GLM-4.5's (`mlp.gate.e_score_correction_bias`,
`mlp.shared_experts`); MiniMax-M2's checkpoint names (`block_sparse_moe`, `w1`/`w2`/`w3`) are mapped by its family
(arbor.models.families.minimax_m2). Neither trains an auxiliary balancing loss (`aux_loss` stays None), as
DeepSeek-V3's bias-balanced routing does not.
"""

from __future__ import annotations

from arbor.models.args import SigmoidMoEArgs
from arbor.models.deepseek_v32 import DeepseekMoE
from arbor.models.qwen3_moe import MoEDecoderLayer, Qwen3MoeForCausalLM


class Glm4MoeDecoderLayer(MoEDecoderLayer):
    moe_cls = DeepseekMoE


class Glm4MoeForCausalLM(Qwen3MoeForCausalLM):
    """Same forward contract as `Qwen3MoeForCausalLM` (router replay, `last_routed_experts`); `aux_loss` None."""

    layer_cls = Glm4MoeDecoderLayer
    args: SigmoidMoEArgs
