"""Training DeepSeek sparse attention's lightning indexer with its KL loss to the main attention
(`trainer.indexer.train`), as DeepSeek-V3.2's sparse training stage does.

For each query t with selected keys S_t (the indexer's own top-k), the target is the main attention's distribution
over S_t: the sparse MLA probabilities summed over the heads and L1-normalised, detached. The indexer's
distribution is the softmax of its scores `sum_h w[t, h] relu(q[t, h] . k[s])` over the valid keys of S_t, and the
loss is KL(target || indexer). The indexer's queries, head weights and keys are computed from DETACHED hidden
states (`x`, and the query latent `q_lat`), so the indexer learns from this loss only and the main model from the
LM/RL loss only (the policy's gradients are unchanged by it).

Per layer the loss is the sum over the queries whose selection holds at least two valid keys (a query that sees
one key has nothing to choose: its KL is 0 and it is not counted, which also leaves padding out), divided by their
count; the model's `aux_loss` is `weight x` the sum over layers. The scores over S_t are computed a query chunk
at a time (`dsa.QUERY_CHUNK`, fed by `sparse_mla`'s per-chunk probabilities) under
`torch.utils.checkpoint`, so the `[chunk, Hi, k]` ReLU logits and `[chunk, k, Di]` gathered keys are recomputed
in backward rather than kept: what stays for backward is the index queries, weights and keys `[T, Hi, Di]`,
`[T, Hi]`, `[T, Di]` and the fp32 targets `[T, k]` per layer (1/64 of the `[T, H, k]` bf16 attention
probabilities sparse attention keeps for its own backward at H = 128); the extra work is one more scoring pass
over the selected keys forward, and its recompute and gradient in backward. A prefix-tree merged row counts each
node once.

Under DSA context parallelism each rank scores its local queries against the all-gathered global keys; the index
keys travel in the gathered per-token row with their indexer-path graph, so the all-gather's backward returns each
rank's key gradients to their owner. The KL sum and the query count are all-reduced over the cp group (the sum
differentiably, as the MoE load-balancing loss is), so every rank holds the whole row's loss, as with the
policy loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.utils.checkpoint import checkpoint


def chunk_kl(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor,
    target: torch.Tensor,
) -> torch.Tensor:
    """Sum over counted queries of KL(target || softmax(indexer scores over the selected keys)), fp32.

    `q [B, c, Hi, Di]`, `w [B, c, Hi]` index queries and head weights of one chunk of queries, `keys [B, Tk, Di]`
    all index keys, `idx, valid [B, c, k]` the selection, `target [B, c, k]` the main attention's normalised
    probabilities over it (0 at invalid keys)."""
    B, c, k = idx.shape
    Tk, Di = keys.shape[1], keys.shape[2]
    with torch.autocast(q.device.type, enabled=False):
        rows = (idx + (torch.arange(B, device=idx.device) * Tk)[:, None, None]).reshape(-1)
        sel = keys.float().reshape(B * Tk, Di)[rows].view(B, c, k, Di)
        logits = torch.einsum("bqhd,bqkd->bqhk", q.float(), sel).relu()
        score = torch.einsum("bqhk,bqh->bqk", logits, w.float()).masked_fill(~valid, float("-inf"))
        logq = torch.log_softmax(score, dim=-1).masked_fill(~valid, 0.0)
        kl = (torch.xlogy(target, target) - target * logq).sum(-1)
        return torch.where(valid.sum(-1) >= 2, kl, 0.0).sum()


class ChunkLoss:
    """Accumulates one layer's indexer KL over the query chunks of `sparse_mla` (its `on_probs` callback)."""

    def __init__(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor):
        self.q, self.w, self.keys, self.idx, self.valid = q, w, keys, idx, valid
        self.kl_sum: torch.Tensor | None = None
        self.count = torch.zeros((), dtype=torch.float32, device=q.device)

    def __call__(self, s: int, e: int, probs: torch.Tensor) -> None:
        """`probs [B, c, H, k]`: the main attention's probabilities of queries `[s, e)` over their selection."""
        valid = self.valid[:, s:e]
        with torch.no_grad():
            target = probs.detach().float().sum(2).masked_fill(~valid, 0.0)
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
            self.count += (valid.sum(-1) >= 2).sum()
        part = checkpoint(
            chunk_kl, self.q[:, s:e], self.w[:, s:e], self.keys, self.idx[:, s:e], valid, target, use_reentrant=False
        )
        self.kl_sum = part if self.kl_sum is None else self.kl_sum + part

    def release(self) -> None:
        """Drops the references to the layer's index tensors once every chunk is in (the graph keeps what backward
        needs), so that the module holding this does not keep them alive past the step."""
        self.q = self.w = self.keys = self.idx = self.valid = None


def enable_indexer_training(model: nn.Module, weight: float) -> None:
    """Turns the indexer loss on in every DSA attention layer of `model` (`trainer.indexer`); a model without a
    lightning indexer is an error naming the setting."""
    layers = getattr(getattr(model, "model", None), "layers", [])
    attns = [layer.self_attn for layer in layers if hasattr(getattr(layer, "self_attn", None), "indexer")]
    if not attns:
        name = type(model).__name__
        raise ValueError(f"trainer.indexer.train = true: {name} has no DeepSeek sparse attention indexer to train")
    for attn in attns:
        attn.train_indexer = True
    model.indexer_loss_weight = float(weight)


def indexer_modules(model: nn.Module) -> nn.ModuleList | None:
    """The indexers the loss trains (a list of references for clipping them as their own group), or None."""
    layers = getattr(getattr(model, "model", None), "layers", [])
    attns = [getattr(layer, "self_attn", None) for layer in layers]  # a hybrid model's linear layers have none
    found = [attn.indexer for attn in attns if getattr(attn, "train_indexer", False)]
    return nn.ModuleList(found) if found else None


def model_indexer_loss(model: nn.Module, losses: list[ChunkLoss], group) -> None:
    """Sets `model.aux_loss` (weight x the sum over layers of each layer's mean KL, with gradient to the indexers)
    and `model.indexer_stats` (detached: KL summed over counted queries, averaged over layers, and the count) from
    the layers' accumulated losses; `group`: the cp group to sum over (None on one rank)."""
    sums = [lo.kl_sum for lo in losses if lo.kl_sum is not None]
    total = torch.stack(sums).sum() if sums else losses[0].count * 0.0
    count = losses[0].count.clone()  # the same queries in every layer
    if group is not None:
        total = all_reduce(total, group=group)
        dist.all_reduce(count, group=group)
    per_query = total / count.clamp_min(1.0)
    model.aux_loss = model.indexer_loss_weight * per_query
    model.indexer_stats = (total.detach() / len(losses), count)
