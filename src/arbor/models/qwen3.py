"""A Qwen3-architecture dense decoder in plain PyTorch (RMSNorm, RoPE, GQA with per-head q/k norm, SwiGLU); by its
args' switches (q/k/v/o and MLP biases, q/k norm per head, over the projection or none, RoPE scaling and partial
rotary: arbor.models.args.ModelArgs) also Llama's, Qwen2's and Mistral's (arbor.models.families.llama).

Module and parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so published
weights load into vLLM or transformers without conversion. The same forward serves the trainer (packed rows
with a block-diagonal mask) and the inference engine (a slot KV cache); RoPE is computed in fp32 from explicit
position ids, as transformers does, which is what keeps trainer and inference logprobs equal in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from arbor.models.args import ModelArgs
from arbor.models.attention import KVCache, attend
from arbor.models.mtp import MTPLayer, init_mtp_from_last_layer
from arbor.models.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    cp = None
    """Context-parallel attention (arbor.trainer.context_parallel.ContextParallel), installed by `apply_cp`."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        h, q, kv, bias = args.hidden_size, self.n_heads * self.head_dim, self.n_kv * self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(h, q, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.o_proj = nn.Linear(q, h, bias=args.o_proj_bias)
        self.qk_norm = args.qk_norm
        if self.qk_norm != "none":
            per_head = self.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else q, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else kv, args.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int, norm: str) -> torch.Tensor:
        """`proj(x)` as `[B, n, T, head_dim]`, normed as `qk_norm` says (by `norm`, "q_norm" or "k_norm")."""
        B, T, _ = x.shape
        y = proj(x)
        if self.qk_norm == "projection":
            y = getattr(self, norm)(y)
        y = y.view(B, T, n, self.head_dim)
        if self.qk_norm == "head":
            y = getattr(self, norm)(y)
        return y.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        cache_slots: torch.Tensor | None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self._heads(x, self.q_proj, self.n_heads, "q_norm")
        k = self._heads(x, self.k_proj, self.n_kv, "k_norm")
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.cp is not None and kv_cache is None:
            return self.o_proj(self.cp.attention(q, k, v).transpose(1, 2).reshape(B, T, -1))
        if kv_cache is not None:
            k, v, attn_mask = kv_cache.write_and_read(self.layer_idx, k, v, cache_slots, position_ids)
        out = attend(q, k, v, attn_mask, self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = args.intermediate_size if intermediate_size is None else intermediate_size
        bias = getattr(args, "mlp_bias", False)  # DeepSeek's args have none
        self.gate_proj = nn.Linear(args.hidden_size, inter, bias=bias)
        self.up_proj = nn.Linear(args.hidden_size, inter, bias=bias)
        self.down_proj = nn.Linear(inter, args.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, rope, position_ids, attn_mask, kv_cache, cache_slots):
        x = x + self.self_attn(self.input_layernorm(x), rope, position_ids, attn_mask, kv_cache, cache_slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Backbone(nn.Module):
    def __init__(self, args: ModelArgs, layer_cls: type[nn.Module] | None = None) -> None:
        super().__init__()
        layer_cls = DecoderLayer if layer_cls is None else layer_cls
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layer_cls(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.rotary_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings
        )


def embed(
    backbone: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The forward prologue of every arbor decoder: (token embeddings, RoPE cos/sin, position ids), positions
    defaulting to 0..T-1 in each row. `backbone` has `embed_tokens` and `rotary_emb`."""
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    return backbone.embed_tokens(input_ids), backbone.rotary_emb(position_ids), position_ids


HeadFn = Callable[[torch.Tensor, torch.Tensor], Any]
"""Replaces the language-model head in a forward: `head_fn(hidden [B, T, H] after the final norm, lm_head weight
[V, H])`, and the forward returns what it returns. The trainer passes its vocabulary-chunked logprobs
(arbor.trainer.logprobs) so that `[T, V]` logits never exist; calling it inside the forward is what keeps the
weight usable under FSDP2 (the root module's parameters are gathered only around its forward and backward)."""


def linear_weight(module: nn.Linear) -> torch.Tensor:
    """The layer's effective weight, for code that reads the weight instead of calling the layer (the trainer's
    vocabulary-chunked head, MLA's absorbed `kv_b_proj`): its own, plus `scale * B A` of the trainer's LoRA
    adapter (`delta_weight`, arbor.models.lora) or of the engine's current adapter slot (`lora_weight_delta`,
    arbor.inference.engine.adapters). Defined here, where every model reads it, by what the layer has rather than its
    class: the adapter module imports the models. An adapter on `lm_head` changes the output projection only,
    also when the weight is tied to the embeddings; the `[V, H]` sum costs one copy of the head, against a
    forward's `[T, V]` logits that are never built."""
    delta = getattr(module, "delta_weight", None) or getattr(module, "lora_weight_delta", None)
    return module.weight if delta is None else module.weight + delta().to(module.weight.dtype)


def lm_logits(model: nn.Module, x: torch.Tensor, logits_to_keep: int, head_fn: HeadFn | None = None) -> Any:
    """The forward epilogue: final norm and language-model head, on the last `logits_to_keep` positions only
    when it is > 0 (prefill); with `head_fn`, its result instead of logits. `model` has `model.norm` and
    `lm_head` (a bias-free nn.Linear)."""
    x = model.model.norm(x)
    if head_fn is not None:
        return head_fn(x, linear_weight(model.lm_head))
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    return model.lm_head(x)


DraftFn = Callable[..., Any]
"""Trains the MTP modules inside a forward: `draft_fn(model, hidden [B, T, H] before the final norm, input_ids,
rope, position_ids, attn_mask)`; what it returns is left in `model.draft_out` (arbor.trainer.draft). Called
inside the forward for the same reason as `HeadFn`: the shared embedding and head are usable there under FSDP2."""


class Qwen3ForCausalLM(nn.Module):
    """Decoder with a language-model head; `forward` returns logits `[B, T, vocab]` (fp32 upcast left to callers).
    With `args.mtp_depth`, `mtp` holds the multi-token-prediction draft modules (arbor.models.mtp)."""

    accepts_block_mask = True
    """Its attention takes a FlexAttention `BlockMask` (CUDA) or a `SegmentMask` (CPU) as `attn_mask`
    (arbor.models.attention.attend); the trainer passes dense masks to models without this attribute."""
    draft_fn: DraftFn | None = None
    """Set by the trainer while it trains the MTP modules (`DraftFn`)."""
    draft_out: Any = None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Qwen3Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        L = args.num_hidden_layers
        # Registered after the decoder, so a preset's decoder draws the same initial weights with or without them.
        self.mtp = nn.ModuleList(MTPLayer(args, DecoderLayer(args, L + d), RMSNorm) for d in range(args.mtp_depth))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_slots: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        head_fn: HeadFn | None = None,
    ) -> torch.Tensor:
        """`attn_mask` `[B, 1, T, T]` (True = attend), a FlexAttention `BlockMask` or a `SegmentMask`
        (arbor.models.attention) overrides plain causal attention; with `kv_cache` the mask comes from the cache.
        `logits_to_keep > 0` computes logits for the last positions only (prefill). `head_fn` replaces the head
        (`HeadFn`)."""
        x, rope, position_ids = embed(self.model, input_ids, position_ids)
        for layer in self.model.layers:
            x = layer(x, rope, position_ids, attn_mask, kv_cache, cache_slots)
        if self.draft_fn is not None and len(self.mtp):
            self.draft_out = self.draft_fn(self, x, input_ids, rope, position_ids, attn_mask)
        return lm_logits(self, x, logits_to_keep, head_fn)

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_cache: KVCache, cache_slots: torch.Tensor
    ) -> torch.Tensor:
        """The decoder's final hidden states `[B, T, H]` before the final norm (what the MTP modules read);
        `lm_logits(model, hidden, 0)` turns them into logits."""
        x, rope, position_ids = embed(self.model, input_ids, position_ids)
        for layer in self.model.layers:
            x = layer(x, rope, position_ids, None, kv_cache, cache_slots)
        return x

    def mtp_hidden(
        self,
        depth: int,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MTP module `depth` at `position_ids` given the previous depth's `hidden` and the ids of the tokens one
        position ahead (`next_ids`); its hidden states `[B, T, H]` before `shared_head.norm`."""
        emb, rope, position_ids = embed(self.model, next_ids, position_ids)
        return self.mtp[depth](hidden, emb, rope, position_ids, attn_mask, kv_cache, cache_slots)

    def mtp_logits(self, depth: int, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mtp[depth].shared_head.norm(out))

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic initialisation from `seed` (same weights in every process that calls it)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith((".bias", "e_score_correction_bias")):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        if len(self.mtp):
            init_mtp_from_last_layer(self)

    def make_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        """One cache layer per decoder layer, then one per MTP module (their blocks' layer indices)."""
        a = self.args
        p = next(self.parameters())
        return KVCache(
            a.num_hidden_layers + len(self.mtp),
            num_slots,
            a.num_key_value_heads,
            max_len,
            a.head_dim,
            p.dtype,
            p.device,
        )
