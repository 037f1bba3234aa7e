"""Token logprobs and entropy straight from the final hidden states and the lm_head weight, a chunk of tokens at a
time, so that `[T, V]` logits never exist at once.

`VocabChunkedLogprobs` recomputes each chunk in an exact custom backward; the same pass reads a distillation
teacher's top-k ids, scores the top-p nucleus the engines sampled from, and covers only the tokenizer's ids
(`vocab`, kept in the trainer's ParallelState, arbor.trainer.parallel_state), never the head's padding rows. Details:
docs/training.md, "Logprobs without `[tokens, vocab]` logits".
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 256 * 2**20
"""Default size of one chunk's fp32 logits: `CHUNK_BYTES / (4 V)` rows (441 at V = 151,936). Large enough that
each chunk's matmul runs at full speed, small enough that the few buffers of a chunk stay well under a GB."""


def default_chunk(vocab_size: int) -> int:
    """Rows per chunk when `trainer.logprob_chunk_tokens` is 0: one chunk's fp32 logits take `CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def real_rows(weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """The head `weight [V, H]`'s first `vocab` rows (a view), or the whole head when `vocab` is 0 or covers it."""
    return weight[:vocab] if 0 < vocab < weight.shape[0] else weight


def effective_top_p(temperature: float, top_p: float) -> float:
    """The nucleus mass that applies: greedy rollouts (temperature 0) ignore top_p, as both engines do."""
    return top_p if temperature > 0 else 1.0


def nucleus_mask(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[..., V]` bool: each row's top-p nucleus, the tokens whose more likely predecessors (in descending order)
    hold less than `top_p` of the mass; the most likely token is always kept."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    p = sorted_logp.exp()
    kept = (p.cumsum(-1) - p) < top_p
    return torch.zeros_like(kept).scatter_(-1, order, kept)


def _nucleus_pairs(
    logp: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For (row, target) pairs of one chunk: the logprob under the row's nucleus plus the target, the log of
    the nucleus' share of that support's mass (0 when the target is in the nucleus) and whether it is outside."""
    lse_nuc = torch.where(keep, logp, torch.full_like(logp, -torch.inf)).logsumexp(-1)[rows]
    lp = logp[rows, targets]
    outside = ~keep[rows, targets]
    norm = torch.where(outside, torch.logaddexp(lse_nuc, lp), lse_nuc)
    return lp - norm, lse_nuc - norm, outside


def _chunk_logp(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log_softmax` of one chunk's tempered logits `[C, V]` in fp32: the same ops, in the same order, as
    `shifted_logprobs` applies to the full logits. With `softcap` (Gemma 2's final-logit soft-capping, as the
    model's own head applies it: `softcap * tanh(logits / softcap)`) also `tanh(logits / softcap)`, which the
    backward's chain rule reads; else None."""
    logits = torch.nn.functional.linear(hidden, weight).float()
    tanh = None
    if softcap:
        tanh = logits.div_(softcap).tanh_()  # in place: the buffer is this function's own
        logits = tanh * softcap
    if temperature > 0:  # greedy rollouts (temperature 0) are scored untempered
        logits.div_(temperature)  # in place: the buffer is this function's own, and no autograd runs here
    return torch.log_softmax(logits, dim=-1), tanh


class VocabChunkedLogprobs(torch.autograd.Function):
    """`(hidden [N, H], weight [V, H], rows [K], targets [K], temperature, chunk, with_entropy, top_p, vocab,
    softcap)` -> `(logprobs [K], entropy [N])`: `logprobs[k] = log softmax(cap(hidden[rows[k]] W^T) /
    temperature)[targets[k]]` with `W` the head's first `vocab` rows (`real_rows`; the other rows' gradient is
    0) and `cap` the soft-capping `softcap * tanh(x / softcap)` (identity at 0), renormalised over the row's
    nucleus with top_p < 1 (the module docstring); entropy (no gradient) is empty unless `with_entropy`.
    `hidden` and `weight` share a dtype (autocast is applied by the caller, see `chunked_token_logprobs`)."""

    @staticmethod
    def forward(ctx, hidden, weight, rows, targets, temperature, chunk, with_entropy, top_p=1.0, vocab=0, softcap=0.0):
        ctx.temperature, ctx.chunk, ctx.top_p, ctx.vocab, ctx.softcap = temperature, chunk, top_p, vocab, softcap
        head = real_rows(weight, vocab)
        order, bounds = _pairs_by_chunk(rows, hidden.shape[0], chunk)
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
        # with a nucleus: per pair, log of the nucleus' share of its support, and whether the target is outside
        shift = torch.zeros(rows.shape[0] if top_p < 1 else 0, dtype=torch.float32, device=hidden.device)
        outside = torch.zeros(shift.shape[0], dtype=torch.bool, device=hidden.device)
        entropy = torch.empty(hidden.shape[0] if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for i, start in enumerate(range(0, hidden.shape[0], chunk)):
                logp, _ = _chunk_logp(hidden[start : start + chunk], head, temperature, softcap)
                mine = order[bounds[i] : bounds[i + 1]]
                if top_p < 1:
                    out[mine], shift[mine], outside[mine] = _nucleus_pairs(
                        logp, nucleus_mask(logp, top_p), rows[mine] - start, targets[mine]
                    )
                else:
                    out[mine] = logp[rows[mine] - start, targets[mine]]
                if with_entropy:
                    p = logp.exp()
                    entropy[start : start + chunk] = -(p.mul_(logp)).sum(-1)
        ctx.save_for_backward(hidden, weight, rows, targets, out, shift, outside)
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, rows, targets, out, shift, outside = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_out = grad_out.float()
        top_p = ctx.top_p
        # Rows none of whose pairs has a gradient (prompt tokens and padding, outside the loss mask) contribute
        # exactly 0: only the others are recomputed, renumbered 0..live-1 (one host sync for their count).
        active = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        active[rows[grad_out != 0]] = True
        live = active.nonzero().squeeze(1)
        slot = torch.cumsum(active, 0) - 1
        keep = active[rows]
        p_rows, p_targets, p_grad = slot[rows[keep]], targets[keep], grad_out[keep]
        # the sum of each row's pair gradients: the softmax term of log_softmax's backward. Under a nucleus a
        # pair's support holds the nucleus with share exp(shift) of its mass, and a target outside it takes the
        # rest, exp(logprob): that part of the softmax term is subtracted at the target itself.
        p_coef, p_target_grad = p_grad, p_grad
        if top_p < 1:
            p_coef = p_grad * shift[keep].exp()
            p_target_grad = p_grad * (1 - outside[keep] * out[keep].exp())
        row_sum = torch.zeros(live.shape[0], dtype=torch.float32, device=hidden.device).index_add_(0, p_rows, p_coef)
        chunk, temperature = ctx.chunk, ctx.temperature
        order, bounds = _pairs_by_chunk(p_rows, live.shape[0], chunk)
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        head = real_rows(weight, ctx.vocab)
        grad_head = None if grad_w is None else grad_w[: head.shape[0]]  # a view: padding rows keep 0
        with torch.autocast(hidden.device.type, enabled=False):
            for i, start in enumerate(range(0, live.shape[0], chunk)):
                idx = live[start : start + chunk]
                h = hidden[idx]
                logp, tanh = _chunk_logp(h, head, temperature, ctx.softcap)
                if top_p < 1:  # the softmax over the nucleus
                    nuc = nucleus_mask(logp, top_p)
                    logp = torch.where(nuc, logp, torch.full_like(logp, -torch.inf)).log_softmax(-1)
                grad = logp.exp_()
                grad.mul_(-row_sum[start : start + idx.shape[0], None])
                mine = order[bounds[i] : bounds[i + 1]]
                grad.index_put_((p_rows[mine] - start, p_targets[mine]), p_target_grad[mine], accumulate=True)
                if temperature > 0:
                    grad.div_(temperature)
                if tanh is not None:  # through the soft-capping: d/dx softcap * tanh(x / softcap) = 1 - tanh^2
                    grad.mul_(tanh.square_().neg_().add_(1))
                grad = grad.to(hidden.dtype)
                if need_h:
                    grad_h[idx] = grad.mm(head)
                if need_w and acc == weight.dtype:
                    grad_head.addmm_(grad.t(), h)
                elif need_w:  # a low-precision head: each chunk's product is summed in fp32
                    grad_head += grad.t().mm(h)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def _pairs_by_chunk(rows: torch.Tensor, n_rows: int, chunk: int) -> tuple[torch.Tensor, list[int]]:
    """Pair indices sorted by row, and where each chunk's pairs begin and end in that order (one host sync)."""
    order = torch.argsort(rows, stable=True)
    n_chunks = -(-n_rows // chunk)
    starts = (torch.arange(n_chunks + 1, device=rows.device) * chunk).clamp(max=n_rows)
    bounds = torch.searchsorted(rows[order], starts).tolist()
    return order, bounds


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool = True,
    chunk: int = 0,
    top_p: float = 1.0,
    vocab: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 `(logprobs [K], entropy [N] or None)` of `targets` under the head's first `vocab` rows (0: all of
    them) applied to `hidden [N, H]` rows `rows` (renormalised over each row's top-p nucleus when `top_p < 1`
    and the temperature is above 0; logits soft-capped at `softcap` when above 0, as Gemma 2's head does);
    `chunk` rows at a time (0: `default_chunk(V)`). Under autocast the head's
    matmuls run in the autocast dtype, as `nn.Linear` would; the casts are outside the function so autograd
    carries their gradients."""
    dtype = weight.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    chunk = chunk or default_chunk(weight.shape[0])
    rows, targets = rows.to(hidden.device, torch.long), targets.to(hidden.device, torch.long)
    logprobs, entropy = VocabChunkedLogprobs.apply(
        hidden.to(dtype),
        weight.to(dtype),
        rows,
        targets,
        temperature,
        chunk,
        with_entropy,
        effective_top_p(temperature, top_p),
        vocab,
        softcap,
    )
    return logprobs, entropy if with_entropy else None


def chunked_extra_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    extra_ids: torch.Tensor | None,
    temperature: float,
    with_entropy: bool = True,
    chunk: int = 0,
    top_p: float = 1.0,
    vocab: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`chunked_token_logprobs` plus, with `extra_ids [K, k]`, the logprobs `[K, k]` of those ids under each
    pair's row (pair j's row read at `extra_ids[j]` as well as at `targets[j]`), in the same chunked pass."""
    if extra_ids is None:
        return (
            *chunked_token_logprobs(
                hidden, weight, rows, targets, temperature, with_entropy, chunk, top_p, vocab, softcap
            ),
            None,
        )
    n, k = rows.shape[0], extra_ids.shape[1]
    rows = rows.to(hidden.device, torch.long)
    all_rows = torch.cat([rows, rows.repeat_interleave(k)])
    extra = extra_ids.to(hidden.device, torch.long).reshape(-1)
    all_targets = torch.cat([targets.to(hidden.device, torch.long), extra])
    lp, entropy = chunked_token_logprobs(
        hidden, weight, all_rows, all_targets, temperature, with_entropy, chunk, top_p, vocab, softcap
    )
    return lp[:n], entropy, lp[n:].view(n, k)


def shifted_chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    with_entropy: bool = True,
    chunk: int = 0,
    top_p: float = 1.0,
    extra_ids: torch.Tensor | None = None,
    vocab: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """`shifted_logprobs` from hidden states `[T, H]` and the head weight: per-token logprobs `[T]` (token t
    scored by row t-1, token 0 gets 0) and, optionally, the entropy of the distribution that predicted each.
    With `extra_ids [T, k]` a third result: `[T, k]`, the logprob of `extra_ids[t]` under the distribution
    that predicted token t (0 for token 0)."""
    T = hidden.shape[0]
    rows = torch.arange(T - 1, device=hidden.device)
    lp, ent, extra = chunked_extra_logprobs(
        hidden[:-1],
        weight,
        rows,
        input_ids[1:],
        None if extra_ids is None else extra_ids[1:],
        temperature,
        with_entropy,
        chunk,
        top_p,
        vocab,
        softcap,
    )
    logprobs = torch.cat([lp.new_zeros(1), lp])
    entropy = None if ent is None else torch.cat([ent.new_zeros(1), ent])
    if extra is None:
        return logprobs, entropy
    return logprobs, entropy, torch.cat([extra.new_zeros(1, extra.shape[1]), extra])
