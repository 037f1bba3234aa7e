"""The forward of one micro-batch to per-token logprobs (and entropy): a packed row under its block-diagonal mask
(`packed_logprobs`), a prefix-tree merged row (`tree_logprobs`), either one (`micro_batch_logprobs`, what the
trainer step calls); `shifted_logprobs` is the full-logits reference.

Logprobs never materialise `[T, V]` logits: the model's forward hands its final hidden states and lm_head weight
to arbor.trainer.logprobs, which applies the head a chunk of tokens at a time with an exact custom backward
(chunk: `trainer.logprob_chunk_tokens`) and over the tokenizer's ids only (the head's first `vocab` rows), both
from the model's `ParallelState` (arbor.trainer.parallel_state), which `parallelize` returns and the caller passes in.
`shifted_logprobs` is the full-logits reference it equals (given logits cut to those ids).

Prefix-tree merged rows (their wire format is arbor.transport.batch's) forward the trie's nodes once under
their tree mask and unmerge: each original sample token's logprob is read from the distribution of the node
that predicts it (`tree_logprobs`), so everything after the forward sees the unmerged per-token arrays.
"""

from __future__ import annotations

import torch
from torch import nn

from arbor.models.attention import row_attention_mask, subtree_end_for
from arbor.models.qwen3 import HeadFn
from arbor.trainer.context_parallel import packed_logprobs_cp
from arbor.trainer.logprobs import (
    chunked_extra_logprobs,
    effective_top_p,
    nucleus_mask,
    shifted_chunked_logprobs,
)
from arbor.trainer.parallel_state import UNPREPARED, ParallelState
from arbor.transport.batch import MicroBatch


def shifted_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    with_entropy: bool = True,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs `[T]` of `input_ids` under `logits` `[T, V]` (token t scored by the logits at t-1; token
    0 gets 0) and, optionally, the entropy of the distribution that predicted each token (no gradient).
    With `top_p < 1` (and a temperature above 0) each logprob is renormalised over the row's nucleus plus the
    target, by masking the other logits (arbor.trainer.logprobs' rule; the entropy stays the full one's).
    The full-logits reference of the trainer's chunked path (arbor.trainer.logprobs); tests compare the two."""
    logits = logits.float()
    if temperature > 0:  # greedy rollouts (temperature 0) are scored untempered
        logits = logits / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1)
    targets = input_ids[1:, None]
    if effective_top_p(temperature, top_p) < 1:
        support = nucleus_mask(logp.detach(), top_p).scatter(-1, targets, True)
        picked = torch.where(support, logits[:-1], -torch.inf).log_softmax(-1).gather(-1, targets).squeeze(-1)
    else:
        picked = logp.gather(-1, targets).squeeze(-1)
    logprobs = torch.cat([picked.new_zeros(1), picked])
    entropy = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
            entropy = torch.cat([ent.new_zeros(1), ent])
    return logprobs, entropy


def packed_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    temperature: float,
    device: torch.device,
    with_entropy: bool = True,
    routed_experts: torch.Tensor | None = None,
    top_p: float = 1.0,
    extra_ids: torch.Tensor | None = None,
    state: ParallelState = UNPREPARED,
    images: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Forward one packed row `[T]` with its block-diagonal mask; (logprobs, entropy) `[T]` on `device`.
    `images` (`pixel_values`, `image_grid_thw`: MicroBatch.images) feed a vision-language model's tower.
    `routed_experts [T, moe_layers, k]` replays the inference engine's routing (MoE models); `top_p < 1` scores
    the nucleus-truncated distribution (arbor.trainer.logprobs); `extra_ids [T, k]` adds a third result, the
    logprobs `[T, k]` of those ids where token t is predicted. Under context parallelism the row is split over
    the cp ranks (arbor.trainer.context_parallel) with the same result. `state`: how the model was prepared."""
    if state.cp is not None:
        if images:
            raise ValueError("rows with images cannot be split by context parallelism: set trainer.parallel.cp = 1")
        if extra_ids is not None:
            raise ValueError(
                "orchestrator.teacher.top_k > 0 is not supported with trainer.parallel.cp > 1: set "
                "orchestrator.teacher.top_k = 0 or trainer.parallel.cp = 1"
            )
        return packed_logprobs_cp(
            model,
            state.cp,
            state.logprob_chunk,
            state.vocab,
            input_ids,
            position_ids,
            seq_lens,
            temperature,
            device,
            with_entropy,
            routed_experts,
            top_p,
        )
    input_ids = input_ids.to(device, non_blocking=True)
    end = subtree_end_for(seq_lens, input_ids.shape[0])
    chunk, vocab, softcap = state.logprob_chunk, state.vocab, logit_softcap(model)

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return shifted_chunked_logprobs(
            hidden[0], weight, input_ids, temperature, with_entropy, chunk, top_p, extra_ids, vocab, softcap
        )

    return _row_forward(model, input_ids, position_ids, end, device, routed_experts, head, images)


def logit_softcap(model: nn.Module) -> float:
    """The soft-capping the model's head applies to its logits (`logit_softcap`, Gemma 2's 30), 0 for none."""
    return float(getattr(model, "logit_softcap", 0.0))


def _row_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    subtree_end: torch.Tensor,
    device: torch.device,
    routed_experts: torch.Tensor | None,
    head_fn: HeadFn,
    images: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_fn`'s (logprobs, entropy) for one row forwarded under its tree mask (a packed row is a forest of
    chains): one mask per row, shared by every layer (dense on CPU, a FlexAttention block mask on CUDA)."""
    block, segments = getattr(model, "accepts_block_mask", False), getattr(model, "accepts_segment_mask", None)
    mask = row_attention_mask(subtree_end, device, block, segments)
    kwargs = {} if routed_experts is None else {"routed_experts": routed_experts.to(device)[None]}
    kwargs.update({k: v.to(device) for k, v in (images or {}).items()})
    return model(
        input_ids.to(device)[None], position_ids.to(device, non_blocking=True)[None], mask, head_fn=head_fn, **kwargs
    )


def tree_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    temperature: float,
    device: torch.device,
    with_entropy: bool = True,
    routed_experts: torch.Tensor | None = None,
    top_p: float = 1.0,
    extra_ids: torch.Tensor | None = None,
    state: ParallelState = UNPREPARED,
) -> tuple[torch.Tensor, ...]:
    """Forward a prefix-tree merged row once over its M nodes; (logprobs, entropy) `[N]` per ORIGINAL sample
    token (0 at each sample's first token), equal to the unmerged samples' within float rounding; with
    `extra_ids [N, k]` also their logprobs `[N, k]` (as `packed_logprobs`).

    An MoE model's load-balancing loss counts each node as many times as samples pass through it (the
    per-token weights `aux_valid`), so it equals the unmerged row's too."""
    if state.cp is not None:
        raise ValueError(
            "a prefix-tree merged micro-batch reached a context-parallel trainer: set "
            "orchestrator.batching.prefix_merge = false or trainer.parallel.cp = 1"
        )
    nodes = mb.token_nodes.to(device, torch.long)
    input_ids = mb.input_ids.to(device)
    predictors = mb.predictor_nodes().to(device)
    chunk, vocab, softcap = state.logprob_chunk, state.vocab, logit_softcap(model)

    def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return unmerged_logprobs(
            hidden[0],
            weight,
            input_ids,
            nodes,
            predictors,
            temperature,
            with_entropy,
            chunk,
            top_p,
            extra_ids,
            vocab,
            softcap,
        )

    moe = hasattr(model, "aux_valid")
    if moe:
        model.aux_valid = torch.bincount(nodes, minlength=mb.num_tokens)
    try:
        return _row_forward(model, mb.input_ids, mb.position_ids, mb.subtree_end, device, routed_experts, head)
    finally:
        if moe:
            model.aux_valid = None


def unmerged_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    token_nodes: torch.Tensor,
    predictors: torch.Tensor,
    temperature: float,
    with_entropy: bool = True,
    chunk: int = 0,
    top_p: float = 1.0,
    extra_ids: torch.Tensor | None = None,
    vocab: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """Per sample token t: log p(input_ids[token_nodes[t]] | node predictors[t]) under the head `weight` (its
    first `vocab` rows, arbor.trainer.logprobs) applied to the node hidden states `[M, H]` (0 where
    predictors[t] < 0), and with `extra_ids [N, k]` the logprobs `[N, k]` of those ids under the same node. Each
    node's distribution is normalised once, chunk by chunk (arbor.trainer.logprobs), then read by every sample
    token it predicts, so a node shared by many samples costs one row of the vocabulary, not one per sample."""
    has = predictors >= 0
    src = predictors.clamp(min=0)
    picked, ent, extra = chunked_extra_logprobs(
        hidden, weight, src, input_ids[token_nodes], extra_ids, temperature, with_entropy, chunk, top_p, vocab, softcap
    )
    zero = torch.zeros_like(picked)
    logprobs = torch.where(has, picked, zero)
    entropy = None if ent is None else torch.where(has, ent[src], zero)
    if extra is None:
        return logprobs, entropy
    return logprobs, entropy, torch.where(has[:, None], extra, torch.zeros_like(extra))


def micro_batch_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    temperature: float,
    device: torch.device,
    with_entropy: bool = True,
    router_replay: bool = False,
    top_p: float = 1.0,
    extra_ids: torch.Tensor | None = None,
    state: ParallelState = UNPREPARED,
) -> tuple[torch.Tensor, ...]:
    """(logprobs, entropy) per token of the micro-batch's samples (per original sample token when merged), of
    the distribution the tokens were sampled from (`top_p`: its nucleus; see arbor.trainer.logprobs); with
    `extra_ids [N, k]` (a teacher's top-k ids) a third result, their logprobs `[N, k]` (`packed_logprobs`)."""
    mb = mb.torch()
    replay = mb.routed_experts if router_replay else None
    if mb.merged:
        return tree_logprobs(model, mb, temperature, device, with_entropy, replay, top_p, extra_ids, state)
    return packed_logprobs(
        model,
        mb.input_ids,
        mb.position_ids,
        mb.seq_lens,
        temperature,
        device,
        with_entropy,
        replay,
        top_p,
        extra_ids,
        state,
        mb.images,
    )
