"""Online training of the MTP draft modules (arbor.models.mtp) on each step's sequences.

Inside the policy's own forward (the model calls the `DraftFn` installed here with the decoder's final hidden
states), MTP depth d at position i reads the previous depth's hidden state there and the embedding of token
i + d + 1, and is fitted to the policy's next-token distribution at position i + d + 1 (the one that predicts
token i + d + 2): a top-K KL over K + 1 outcomes, the policy's K most likely tokens and "any other token",
`sum_k p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest)`, with `p` the policy's probabilities
(detached) and `q` the module's, both over the tokenizer's ids (the head's first `ParallelState.vocab` rows, as the
policy's logprobs, arbor.trainer.logprobs) at the training temperature. The tail term keeps
the module from piling the policy's whole mass onto its top K: acceptance is 1 - TV(p, q), and a draft fitted to
a renormalised top K would be over-confident wherever the policy is spread out. Positions count where tokens i + 1 .. i
+ d + 2 lie on i's own path (the same sample of a packed
row, descendants of i in a prefix-tree merged row).

Everything the draft loss reads from the policy (hidden states, shared embedding, head weight) is detached, so
its gradients reach the MTP modules only: the policy's loss and gradients are unchanged by it, and
`clip_grad_norm_split` clips the two groups separately so that the policy's clipping is unchanged as well.
The module's logprobs go through the trainer's vocabulary-chunked head (arbor.trainer.logprobs).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from arbor.models.dsa_indexer_loss import indexer_modules
from arbor.models.qwen3 import linear_weight
from arbor.trainer.logprobs import chunked_token_logprobs, default_chunk, real_rows
from arbor.trainer.parallel import clip_grad_norm
from arbor.trainer.parallel_state import UNPREPARED, ParallelState


@dataclasses.dataclass
class DraftOut:
    """One micro-batch's draft loss: `loss` (mean KL over counted positions and depths, with gradient),
    `kl_sum` (detached sum over positions and depths) and `positions` (positions x depths counted)."""

    loss: torch.Tensor
    kl_sum: torch.Tensor
    positions: torch.Tensor


def draft_modules(model: nn.Module, state: ParallelState = UNPREPARED) -> nn.ModuleList | None:
    """The model's MTP modules when it has any and can train them here: not under context parallelism (which
    splits the row the MTP block would have to attend over), nor when they are frozen (a LoRA run, whose drafts
    stay the base model's: it publishes its adapter only). `state`: how the trainer prepared the model."""
    mtp = getattr(model, "mtp", None)
    if mtp is None or not len(mtp) or state.cp is not None:
        return None
    if not any(p.requires_grad for p in mtp.parameters()):
        return None
    return mtp


def path_steps(subtree_end: torch.Tensor) -> torch.Tensor:
    """`[T]` bool: token i + 1 follows token i on its path (same sample; a child in DFS order of a tree row)."""
    T = subtree_end.shape[0]
    nxt = torch.zeros(T, dtype=torch.bool, device=subtree_end.device)
    idx = torch.arange(1, T, device=subtree_end.device)
    nxt[:-1] = idx < subtree_end[:-1]
    return nxt


def make_draft_fn(subtree_end: torch.Tensor, temperature: float, top_k: int, state: ParallelState = UNPREPARED):
    """The `DraftFn` for one row with tree/packing structure `subtree_end [T]` (logprob chunk and policy ids
    from the model's `state`)."""

    def draft_fn(model: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, rope, position_ids, attn_mask):
        return draft_loss(
            model,
            hidden,
            input_ids,
            rope,
            position_ids,
            attn_mask,
            subtree_end,
            temperature,
            top_k,
            state.logprob_chunk,
            state.vocab,
        )

    return draft_fn


@torch.no_grad()
def policy_top_k(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, k: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's `k` most likely tokens per row of normalised hidden states `[N, H]`: their probabilities
    `[N, k]` (fp32, over the head's rows `weight`: the caller cuts it to the tokenizer's ids) and ids `[N, k]`, a
    chunk of rows at a time."""
    probs, ids = [], []
    for start in range(0, hidden.shape[0], chunk):
        logits = F.linear(hidden[start : start + chunk], weight).float()
        if temperature > 0:
            logits = logits / temperature
        top, idx = logits.topk(k, dim=-1)
        probs.append((top - logits.logsumexp(-1, keepdim=True)).exp())
        ids.append(idx)
    return torch.cat(probs), torch.cat(ids)


def draft_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    rope,
    position_ids,
    attn_mask,
    subtree_end: torch.Tensor,
    temperature: float,
    top_k: int,
    chunk: int,
    vocab: int = 0,
) -> DraftOut:
    """The top-K KL of every MTP depth against the policy (module docstring), for one row `[1, T]`; `vocab`:
    the policy's ids (`ParallelState.vocab`)."""
    h = hidden.detach()
    weight = real_rows(linear_weight(model.lm_head).detach(), vocab)  # the policy's ids only
    emb_weight = model.model.embed_tokens.weight.detach()
    ids = input_ids[0]

    chunk = chunk or default_chunk(weight.shape[0])
    k = min(top_k, weight.shape[0])
    p, p_ids = policy_top_k(model.model.norm(h[0]), weight, temperature, k, chunk)
    steps = path_steps(subtree_end.to(ids.device))
    valid = steps.clone()  # token i + 1 is on i's path
    total = h.new_zeros((), dtype=torch.float32)
    kl_sum = torch.zeros((), dtype=torch.float32, device=h.device)
    count = torch.zeros((), dtype=torch.float32, device=h.device)
    prev = h
    for d, layer in enumerate(model.mtp):
        # depth d reads token i + d + 1 and predicts token i + d + 2: that one must be on the path too
        valid = valid & torch.cat([steps[d + 1 :], steps.new_zeros(d + 1)])
        nxt = torch.cat([ids[d + 1 :], ids.new_zeros(d + 1)])[None]
        out = layer(prev, F.embedding(nxt, emb_weight), rope, position_ids, attn_mask, None, None)
        prev = out
        rows = valid.nonzero().squeeze(1)
        if rows.numel() == 0:
            total = total + out.sum() * 0.0  # keeps every module in the graph (FSDP2 expects its gradients)
            continue
        target_p, target_ids = p[rows + d + 1], p_ids[rows + d + 1]
        pair_rows = torch.arange(rows.numel(), device=rows.device).repeat_interleave(k)
        q, _ = chunked_token_logprobs(
            layer.shared_head.norm(out[0, rows]), weight, pair_rows, target_ids.reshape(-1), temperature, False, chunk
        )
        q = q.view(-1, k)
        p_rest = (1.0 - target_p.sum(-1)).clamp_min(0.0)
        q_rest = (1.0 - q.exp().sum(-1)).clamp_min(1e-12)
        kl = (
            (torch.xlogy(target_p, target_p) - target_p * q).sum(-1)
            + torch.xlogy(p_rest, p_rest)
            - p_rest * q_rest.log()
        )
        total = total + kl.mean()
        kl_sum = kl_sum + kl.detach().sum()
        count = count + rows.numel()
    return DraftOut(total / len(model.mtp), kl_sum, count)


def clip_grad_norm_split(model: nn.Module, max_norm: float, state: ParallelState = UNPREPARED) -> torch.Tensor:
    """Clips the policy's gradients by their own global norm (returned, what the step reports) and the MTP
    modules' by theirs, so that training the drafts leaves the policy's update exactly as it would be; a trained
    DSA indexer (arbor.models.dsa_indexer_loss) is its own group too (`clip_grad_norm_groups`)."""
    return clip_grad_norm_groups(model, max_norm, state)["policy"]


def clip_grad_norm_groups(
    model: nn.Module, max_norm: float, state: ParallelState = UNPREPARED
) -> dict[str, torch.Tensor]:
    """Clips each group by its own global norm, each to `max_norm`: the MTP draft modules ("draft"), the DSA
    indexers the indexer loss trains ("indexer") and every other parameter ("policy"); returns the norms of the
    groups the model has ("policy" always). Neither side group's gradients change the policy's clipping."""
    mtp = getattr(model, "mtp", None)
    groups = {"draft": mtp if mtp is not None and len(mtp) else None, "indexer": indexer_modules(model)}
    groups = {k: v for k, v in groups.items() if v is not None}
    if not groups:
        return {"policy": clip_grad_norm(model, max_norm, state.expert_replicas)}
    params = [p for g in groups.values() for p in g.parameters()]
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    norms = {"policy": clip_grad_norm(model, max_norm, state.expert_replicas)}
    for p, g in zip(params, held):
        p.grad = g
    for name, group in groups.items():
        norms[name] = clip_grad_norm(group, max_norm)
    return norms
