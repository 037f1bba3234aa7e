"""Multi-token-prediction (MTP) draft modules, DeepSeek-V3 style, and their Hugging Face names.

The module of depth d (0-based) at position i combines the previous depth's hidden state there (the decoder's
final hidden state, before the final norm, for d = 0) with the embedding of token i + d + 1:
`h' = block(eh_proj([enorm(embed(t[i+d+1])), hnorm(h)]))`, one transformer block of the decoder's own kind,
and predicts token i + d + 2 through its own final norm (`shared_head.norm`) and the decoder's embedding and
head, which every depth shares. The trainer fits them to the policy (arbor.trainer.draft); the local engine
drafts with depth 0 applied autoregressively, its own output standing in for the decoder's hidden state after
the first draft (arbor.inference.engine.speculative), as vLLM does when it drafts more tokens than there are modules.

Checkpoints store depth d as decoder layer `num_hidden_layers + d` (DeepSeek-V3's layout, read from
`num_nextn_predict_layers`): `model.layers.{L+d}.{enorm,hnorm,eh_proj,shared_head.norm}` beside the block's
own `self_attn`, `mlp` and norms. DeepSeek's copies of the shared embedding and head under that prefix are
dropped on load and never written. Models without stored modules start from their last decoder layer.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from arbor.models.args import ModelArgs
from arbor.models.materialize import local_tensor, write_full


class SharedHead(nn.Module):
    """The depth's final norm (its head weight is the decoder's `lm_head`)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm


class MTPLayer(nn.Module):
    """One MTP depth: norms of the previous hidden state and of the next token's embedding, their projection,
    and one decoder block (`block`, built by the model with its cache layer index after the decoder's)."""

    def __init__(self, args: ModelArgs, block: nn.Module, norm_cls: type[nn.Module]) -> None:
        super().__init__()
        h = args.hidden_size
        self.enorm = norm_cls(h, args.rms_norm_eps)
        self.hnorm = norm_cls(h, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block
        self.shared_head = SharedHead(norm_cls(h, args.rms_norm_eps))

    def forward(
        self,
        hidden: torch.Tensor,
        token_emb: torch.Tensor,
        rope,
        position_ids: torch.Tensor,
        attn_mask,
        kv_cache,
        cache_slots,
    ) -> torch.Tensor:
        """This depth's hidden states `[B, T, H]` (before `shared_head.norm`)."""
        x = self.eh_proj(torch.cat([self.enorm(token_emb), self.hnorm(hidden)], dim=-1))
        return self.block(x, rope, position_ids, attn_mask, kv_cache, cache_slots)


def init_mtp_from_last_layer(model: nn.Module) -> None:
    """Starts every MTP depth from the decoder's last layer: the block is a copy of it, the norms are 1 and
    `eh_proj` passes the normalised hidden state through (its embedding half is 0), so a fresh module begins as
    one more pass of the last layer and training moves it from there. The model may be sharded: a block and the
    last layer are sharded alike, so each rank copies its own parts."""
    last = model.model.layers[-1].state_dict(keep_vars=True)
    h = model.args.hidden_size
    with torch.no_grad():
        for layer in model.mtp:
            for name, t in layer.block.state_dict(keep_vars=True).items():
                local_tensor(t).copy_(local_tensor(last[name]))
            for norm in (layer.enorm, layer.hnorm, layer.shared_head.norm):
                local_tensor(norm.weight).fill_(1.0)
            w = torch.zeros(h, 2 * h)
            w[:, h:] = torch.eye(h)
            write_full(layer.eh_proj.weight, w)


_OWN = re.compile(r"^mtp\.(\d+)\.(block\.)?(.*)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_HF_COPIES = ("embed_tokens.", "shared_head.head.")


def mtp_to_hf(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """arbor's `mtp.{d}.…` names -> the checkpoint's `model.layers.{num_layers + d}.…`; other names unchanged."""
    out = {}
    for k, v in state.items():
        m = _OWN.match(k)
        out[f"model.layers.{num_layers + int(m.group(1))}.{m.group(3)}" if m else k] = v
    return out


def mtp_from_hf(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The inverse of `mtp_to_hf`; DeepSeek's per-depth copies of the shared embedding and head are dropped."""
    out = {}
    for k, v in state.items():
        m = _HF.match(k)
        if m is None or int(m.group(1)) < num_layers:
            out[k] = v
            continue
        d, rest = int(m.group(1)) - num_layers, m.group(2)
        if rest.startswith(_HF_COPIES):
            continue
        out[f"mtp.{d}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.{d}.block.{rest}"] = v
    return out


def has_mtp_weights(state: dict[str, torch.Tensor]) -> bool:
    return any(k.startswith("mtp.") for k in state)
