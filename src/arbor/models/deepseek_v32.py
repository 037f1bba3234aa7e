"""A DeepSeek-V3.2-architecture decoder (DeepSeek sparse attention over multi-head latent attention) in plain
PyTorch, with Hugging Face configuration and parameter names (`model_type = "deepseek_v32"`; GLM-5's
`glm_moe_dsa` loads too).

Multi-head latent attention with a lightning indexer that picks `index_topk` keys per query (arbor.models.dsa),
and a SwiGLU or DeepSeek-MoE MLP. The names and numerics it was checked against, and its departures:
docs/models.md, "DeepSeek sparse attention"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arbor.models.args import DSAArgs
from arbor.models.dsa import DSACache, causal_mask, indexer_topk, mla_scale, sparse_mla
from arbor.models.dsa_indexer_loss import ChunkLoss, model_indexer_loss
from arbor.models.qwen3 import MLP, HeadFn, RMSNorm, embed, linear_weight, lm_logits
from arbor.models.qwen3_moe import GroupedExperts, MoE, local_dispatch
from arbor.models.rope import RotaryEmbedding, apply_rope, rope_frequencies, yarn_get_mscale


def rope_setup(args: DSAArgs) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies `[Dr/2]`, factor on cos/sin, factor on the softmax scale) of the model's RoPE: plain or
    YaRN (arbor.models.rope), and MLA's softmax scale times mscale(factor, mscale_all_dim)^2 under YaRN, as
    DeepSeek-V3 defines it."""
    ys = args.rope_scaling
    inv_freq, attn = rope_frequencies(args.qk_rope_head_dim, args.rope_theta, ys, args.max_position_embeddings)
    m_all = (ys or {}).get("mscale_all_dim")
    softmax = yarn_get_mscale(float(ys["factor"]), m_all) ** 2 if ys and m_all else 1.0
    return inv_freq, attn, softmax


class DSARotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` over the rope part of MLA's heads, plain or YaRN-scaled."""

    def __init__(self, args: DSAArgs) -> None:
        super().__init__(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on consecutive pairs (x0, x1), (x2, x3), ... (DeepSeek's MLA layout); `cos, sin [B, T, D]` as
    `RotaryEmbedding` returns them (the frequencies repeated twice), broadcast over the heads of `x [B, T, H, D]`."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half, None].to(x.dtype), sin[..., :half, None].to(x.dtype)
    if x.dim() == 4:
        c, s = c[:, :, None], s[:, :, None]
    pairs = x.unflatten(-1, (half, 2))
    x0, x1 = pairs[..., :1], pairs[..., 1:]
    return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves (the Llama/"neox" layout) of `x [B, T, H, D]` or `[B, T, D]`."""
    if x.dim() == 4:
        return apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    return apply_rope(x[:, None], cos, sin)[:, 0]


class Indexer(nn.Module):
    """Lightning indexer: `index_n_heads` ReLU dot-product heads scoring every key for each query."""

    def __init__(self, args: DSAArgs, q_in: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
        self.rope = rope_interleaved if args.indexer_rope_interleave else rope_neox
        self.wq_b = nn.Linear(q_in, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The rope part comes first in the indexer's head (after the nope part in MLA's).
        pe, nope = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([self.rope(pe, cos, sin), nope], dim=-1)

    def forward(self, x: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grad: bool = False):
        """(queries `[B, T, Hi, Di]`, head weights `[B, T, Hi]`, keys `[B, T, Di]`), all rotated and scaled. With
        `grad` (the indexer loss is training it) they carry gradient to the indexer's weights only: its inputs are
        detached from the main model's graph (arbor.models.dsa_indexer_loss)."""
        B, T, _ = x.shape
        with torch.set_grad_enabled(grad):
            x, q_lat = x.detach(), q_lat.detach()
            q = self._rotate(self.wq_b(q_lat).view(B, T, self.n_heads, self.head_dim), cos, sin)
            k = self._rotate(self.k_norm(self.wk(x)), cos, sin)
            w = self.weights_proj(x) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, w, k


class DSAAttention(nn.Module):
    cp = None
    """DSA context parallel state (arbor.trainer.dsa_cp.DSAContextParallel), installed by `apply_dsa_cp`."""
    train_indexer = False
    """Set by `enable_indexer_training` (`trainer.indexer.train`): a forward with gradient in training mode also
    computes the indexer's KL loss (arbor.models.dsa_indexer_loss) and appends it to `indexer_sink`."""
    indexer_sink: list[ChunkLoss] | None = None
    """Where the layer's indexer loss goes: a list the model's forward installs for its duration only (so an
    activation-checkpointing recompute in backward keeps nothing, and the module never holds a graph)."""

    def __init__(self, args: DSAArgs, layer_idx: int) -> None:
        super().__init__()
        self.args, self.layer_idx = args, layer_idx
        h, H = args.hidden_size, args.num_attention_heads
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, H * args.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, H * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, H * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * args.v_head_dim, h, bias=False)
        self.indexer = Indexer(args, args.q_lora_rank or h)
        self.scale = mla_scale(args.qk_head_dim) * rope_setup(args)[2]
        self.rope = rope_interleaved if args.rope_interleave else rope_neox
        self.last_topk: torch.Tensor | None = None
        """Key indices `[B, T, k]` the last forward selected, -1 where a query had fewer than k visible keys (indices
        into the global row under context parallelism)."""

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], grad_indexer: bool = False):
        """(q_nope, q_pe, index queries, index weights, per-token row `[B, T, R + Dr + Di]` = latent | rope key |
        index key): the row is what the cache stores and context parallelism all-gathers (its index-key part
        carrying the indexer loss's graph when `grad_indexer`)."""
        a = self.args
        B, T, _ = x.shape
        if a.q_lora_rank:
            q_lat = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_lat)
        else:
            q_lat = x
            q = self.q_proj(x)
        q_nope, q_pe = q.view(B, T, a.num_attention_heads, a.qk_head_dim).split(
            [a.qk_nope_head_dim, a.qk_rope_head_dim], -1
        )
        q_pe = self.rope(q_pe, *rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = self.rope(k_pe, *rope)
        iq, iw, ik = self.indexer(x, q_lat, *rope, grad=grad_indexer)
        return q_nope, q_pe, iq, iw, torch.cat([c_kv, k_pe, ik.to(c_kv.dtype)], dim=-1)

    def forward(self, x, rope, position_ids, attn_mask, kv_cache, cache_slots) -> torch.Tensor:
        a = self.args
        B, T, _ = x.shape
        grad_indexer = self.train_indexer and self.training and torch.is_grad_enabled() and kv_cache is None
        q_nope, q_pe, iq, iw, row = self.project(x, rope, grad_indexer)
        if self.cp is not None and kv_cache is None:
            keys, mask = self.cp.gather_keys(row), self.cp.local_mask()
        elif kv_cache is not None:
            keys, mask = kv_cache.write_and_read(self.layer_idx, row, cache_slots, position_ids)
        else:
            keys = row
            mask = causal_mask(T, x.device) if attn_mask is None else attn_mask[:, 0]
        c_kv, k_pe, ik = keys.split([a.kv_lora_rank, a.qk_rope_head_dim, a.index_head_dim], dim=-1)
        idx, valid = indexer_topk(iq.detach(), iw.detach(), ik.detach(), mask, a.index_topk)
        self.last_topk = idx.masked_fill(~valid, -1)
        loss = ChunkLoss(iq, iw, ik, idx, valid) if grad_indexer else None
        out = sparse_mla(
            q_nope, q_pe, c_kv, k_pe, linear_weight(self.kv_b_proj), idx, valid, a.v_head_dim, self.scale, loss
        )
        if loss is not None:
            loss.release()
            if self.indexer_sink is not None:
                self.indexer_sink.append(loss)
        return self.o_proj(out.reshape(B, T, -1))


class DeepseekRouter(nn.Module):
    """Sigmoid scores; experts chosen on `scores + e_score_correction_bias` within the `topk_group` best of
    `n_group` groups (a group scores the sum of its two best); weights are the chosen plain scores, renormalised
    (`norm_topk_prob`) and times `routed_scaling_factor`."""

    def __init__(self, args: DSAArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.zeros(args.n_routed_experts, args.hidden_size))
        # A checkpoint tensor (so a Parameter, for loading and FSDP), not trained here.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        with torch.autocast(x.device.type, enabled=False):  # fp32 scores under an enclosing bf16 autocast too
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        if replay is not None:
            idx = replay.to(device=x.device, dtype=torch.long)
        else:
            choice = scores.detach() + self.e_score_correction_bias.float()
            if a.n_group > 1:
                groups = choice.view(-1, a.n_group, a.n_routed_experts // a.n_group)
                best = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(-1).topk(a.topk_group, dim=-1)[1]
                keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
                choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
            idx = choice.topk(a.num_experts_per_tok, dim=-1)[1]
        w = scores.gather(-1, idx)
        if a.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return (w * a.routed_scaling_factor).to(x.dtype), idx


class DeepseekMoE(MoE):
    """DeepSeek's MoE block. A subclass of Qwen3-MoE's block (its own router, shared experts and forward) so that
    expert parallelism (`arbor.trainer.expert_parallel.apply_ep`) finds and shards its grouped experts."""

    def __init__(self, args: DSAArgs) -> None:
        nn.Module.__init__(self)
        self.gate = DeepseekRouter(args)
        self.experts = GroupedExperts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size)
        self.dispatcher = local_dispatch
        self.shared_experts = None
        if args.n_shared_experts:
            inter = args.moe_intermediate_size * args.n_shared_experts
            self.shared_experts = MLP(args, inter)  # type: ignore[arg-type]  (reads hidden_size only)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, None, torch.Tensor]:
        """(output `[B, T, H]`, None: no router logits for an auxiliary loss, chosen experts `[B*T, k]`)."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        w, idx = self.gate(flat, None if replay is None else replay.reshape(B * T, -1))
        y = self.dispatcher(flat, w, idx, self.experts)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.reshape(B, T, H), None, idx


class DSADecoderLayer(nn.Module):
    def __init__(self, args: DSAArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DSAAttention(args, layer_idx)
        self.is_moe = args.is_moe_layer(layer_idx)
        self.mlp = DeepseekMoE(args) if self.is_moe else MLP(args)  # type: ignore[arg-type]
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, rope, position_ids, attn_mask, kv_cache, cache_slots, replay=None):
        """(hidden states, chosen experts `[B*T, k]` or None)."""
        x = x + self.self_attn(self.input_layernorm(x), rope, position_ids, attn_mask, kv_cache, cache_slots)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), None
        y, _, idx = self.mlp(h, replay)
        return x + y, idx


class DSABackbone(nn.Module):
    def __init__(self, args: DSAArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DSADecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = DSARotaryEmbedding(args)


class DeepseekV32ForCausalLM(nn.Module):
    """Same forward contract as `Qwen3ForCausalLM` (packed rows with a `[B, 1, T, T]` mask, or a slot cache from
    `make_kv_cache`), plus `routed_experts` router replay and `last_routed_experts` for MoE layers."""

    def __init__(self, args: DSAArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DSABackbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.last_routed_experts: torch.Tensor | None = None
        self.aux_loss = None
        """DeepSeek balances experts without an auxiliary loss: None, or the indexer's KL loss times
        `indexer_loss_weight` when it is trained (arbor.models.dsa_indexer_loss)."""
        self.indexer_loss_weight = 1.0
        self.indexer_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        """(indexer KL summed over counted queries, mean over layers; counted queries) of the last forward that
        trained the indexer, detached, for the trainer's `indexer/kl`."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: DSACache | None = None,
        cache_slots: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        routed_experts: torch.Tensor | None = None,
        head_fn: HeadFn | None = None,
    ) -> torch.Tensor:
        B, T = input_ids.shape
        x, rope, position_ids = embed(self.model, input_ids, position_ids)
        chosen, losses = [], []
        for layer in self.model.layers:
            layer.self_attn.indexer_sink = losses
        try:
            for layer in self.model.layers:
                replay = routed_experts[:, :, len(chosen)] if routed_experts is not None and layer.is_moe else None
                x, idx = layer(x, rope, position_ids, attn_mask, kv_cache, cache_slots, replay)
                if idx is not None:
                    chosen.append(idx)
        finally:
            for layer in self.model.layers:
                layer.self_attn.indexer_sink = None
        self.last_routed_experts = (
            torch.stack(chosen, dim=1).reshape(B, T, len(chosen), -1).detach() if chosen else None
        )
        self.aux_loss = self.indexer_stats = None
        if losses:  # the indexer trained in this forward (arbor.models.dsa_indexer_loss)
            cp = self.model.layers[0].self_attn.cp
            model_indexer_loss(self, losses, None if cp is None or kv_cache is not None else cp.group)
        return lm_logits(self, x, logits_to_keep, head_fn)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic initialisation from `seed`: norms 1 (LayerNorm biases and router biases 0), the rest
        normal with `std`."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(("norm.bias", "e_score_correction_bias")):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def make_kv_cache(self, num_slots: int, max_len: int) -> DSACache:
        p = next(self.parameters())
        return DSACache(self.args.num_hidden_layers, num_slots, max_len, self.args.cache_width, p.dtype, p.device)
