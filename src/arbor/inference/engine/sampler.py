"""Token choice for the local engine: one token per running sample from a batch of logits, recorded with its
logprob, top alternatives and policy version, then the sample's stop conditions (eos, stop strings, max_tokens).

Logprobs follow the convention in `arbor.inference.engine.params`: temperature-scaled; with top-p (at a temperature
above 0) a sampler built with `nucleus_logprobs` reports the truncated, renormalised distribution's logprob
`log p(x) - log sum_{j in nucleus} p(j)`, as vLLM's `processed_logprobs` do and as the trainer scores it
(the trainer's `logprobs` module), and its listed alternatives are that distribution's too (-9999 outside the nucleus,
vLLM's floor for -inf); without it (the library default) both stay the full distribution's.

Padding rows: a model's head is often larger than its tokenizer (Qwen3: 151,936 rows, 151,669 tokens; the
presets: 264 rows, 259 byte-tokenizer ids). Ids from the tokenizer's `vocab_size` upwards decode to nothing and
are never training targets, so the policy is a distribution over the tokenizer's ids only: `scaled_logprobs`
takes the logits of those ids (the padding rows are the trailing columns, so ids are unchanged) and everything
after it (the draw, the greedy argmax, the top-p nucleus, the reported logprob and the listed alternatives)
sees that distribution, renormalised over the real ids. It is what vLLM reports behind arbor's padding mask
(arbor.inference.vllm.logits) and what the trainer scores (its `logprobs` module cuts the head to the same ids),
so the three agree exactly; a padding id is never drawn, chosen or listed.

Speed: a step's rows are handled in batched tensor passes (the nucleus masks built once for the draw and the
reported logprobs; over large vocabularies the draw's CDF in two levels and the nucleus among each row's most
likely ids), since per-row work cost more than a small model's forward and a 151k-id full sort most of a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from arbor.inference.engine.requests import Seq
from arbor.models.tokenizer import Tokenizer


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """`log_softmax(logits[:, :vocab] / T)` per row in fp32 `[B, vocab]` (`vocab`: the tokenizer's id count, None
    for every column); rows with T = 0 use T = 1 (greedy reports the untempered distribution)."""
    x = logits[:, :vocab].float()
    if bool((temperatures != 1).any()):  # most runs sample at 1: no [B, vocab] division then
        t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
        x = x / t[:, None]
    return torch.log_softmax(x, dim=-1)


FLOOR_LOGPROB = -9999.0
"""What a listed alternative outside the nucleus reports (its logprob is -inf; vLLM's OpenAI server says -9999)."""


NUCLEUS_CANDIDATES = 1024
"""Most likely ids per row that `nucleus_keep` looks among first, over vocabularies of more than 4 times that."""


def nucleus_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which ids `[..., vocab]` are in each row's top-p nucleus, for rows of probabilities with their `top_p`
    (one per row): in the order of a stable descending sort, a token is kept if the mass strictly before it is
    below top_p, so the most likely one always is (the trainer's `nucleus_mask` applies the same rule); rows with
    top_p >= 1 keep every id. Over a large vocabulary the rows whose nucleus lies among their NUCLEUS_CANDIDATES
    most likely ids (a trained model's usually does) are decided from those alone, with the same float sums as
    a full sort (which took most of a 151k-vocabulary sampling step); the others are sorted whole."""
    shape, V = probs.shape, probs.shape[-1]
    flat, top_p = probs.reshape(-1, V), top_p.expand(shape[:-1]).reshape(-1)
    keep = torch.ones(flat.shape, dtype=torch.bool, device=flat.device)
    rows = (top_p < 1.0).nonzero()[:, 0]
    if V > 4 * NUCLEUS_CANDIDATES and len(rows):
        decided, kept = _nucleus_among_candidates(flat[rows], top_p[rows])
        keep[rows[decided]] = kept[decided]
        rows = rows[~decided]
    if len(rows):
        sorted_p, order = flat[rows].sort(dim=-1, descending=True, stable=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p[rows, None]
        keep[rows] = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep.reshape(shape)


def _nucleus_among_candidates(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`nucleus_keep` of rows `[R, V]` from their NUCLEUS_CANDIDATES most likely ids: which rows that decides
    `[R]`, and their masks `[R, V]`. The candidates in a full stable sort's order (by value, ties by id) are that
    sort's first ids, except that ids tied with the least candidate may interleave with ids left out; a row is
    decided when the mass before the first of those ties already reaches top_p, as nothing from there on is kept."""
    idx = probs.topk(NUCLEUS_CANDIDATES, dim=-1).indices.sort(dim=-1).values
    sorted_p, order = probs.gather(1, idx).sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    first_tie = (sorted_p == sorted_p[:, -1:]).int().argmax(-1)
    decided = before.gather(1, first_tie[:, None])[:, 0] >= top_p
    kept = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device)
    kept.scatter_(1, idx.gather(1, order), before < top_p[:, None])
    return decided, kept


def processed_probs(
    logprobs: torch.Tensor, top_p: torch.Tensor | float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The distribution a sampled token is drawn from, as probabilities `[..., vocab]` for rows of scaled logprobs
    over the tokenizer's ids `[..., vocab]` (`scaled_logprobs`) with their `top_p` (a float, or one per row):
    the smallest top-p nucleus (`nucleus_keep`, or `keep` when the caller has it already), renormalised."""
    weights = nucleus_weights(logprobs, top_p, keep)
    return weights / weights.sum(-1, keepdim=True)


def nucleus_weights(
    logprobs: torch.Tensor, top_p: torch.Tensor | float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """`processed_probs` before the renormalisation (what a draw by `inverse_cdf` needs)."""
    weights = logprobs.exp()
    if keep is None:
        top_p = torch.as_tensor(top_p, dtype=logprobs.dtype, device=logprobs.device)
        if bool((top_p < 1.0).any()):
            keep = nucleus_keep(weights, top_p)
    return weights if keep is None else torch.where(keep, weights, torch.zeros_like(weights))


CDF_BLOCK = 1024
"""Ids per block of `inverse_cdf`'s two-level search."""


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of `probs` `[R, V]` (unnormalised weights will do) from uniforms `u` `[R]` in [0, 1)
    (float64): the first id whose cumulative weight exceeds u times the row's total, so an id of weight 0 is never
    drawn. Over a large vocabulary in two levels: a block of CDF_BLOCK ids by the blocks' sums, then the id within
    it, so that only one block per row gets a float64 cumulative sum (the whole row's took a fifth of a
    151k-vocabulary sampling step)."""
    R, V = probs.shape
    if V <= 2 * CDF_BLOCK:
        return _first_above(probs.double().cumsum(-1), u)
    n = V // CDF_BLOCK
    sums = probs[:, : n * CDF_BLOCK].reshape(R, n, CDF_BLOCK).sum(-1)
    if V > n * CDF_BLOCK:
        sums = torch.cat([sums, probs[:, n * CDF_BLOCK :].sum(-1, keepdim=True)], 1)
    c = sums.double().cumsum(-1)
    block = _first_above(c, u)  # a block of weight 0 never (its cumulative weight equals the one before)
    rows = torch.arange(R, device=probs.device)
    before = torch.where(block > 0, c[rows, (block - 1).clamp_min(0)], torch.zeros_like(u))
    # where u falls within the block, as a fraction of its weight (below 1, so the draw stays inside it)
    frac = ((u * c[:, -1] - before) / (c[rows, block] - before)).clamp(0.0, 1.0 - 1e-12)
    ids = block[:, None] * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    inside = probs.gather(1, ids.clamp_max(V - 1)).double().masked_fill(ids >= V, 0.0).cumsum(-1)
    return block * CDF_BLOCK + _first_above(inside, frac)


def _first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of cumulative weights `[R, K]`, the first index whose value exceeds u times the row's last."""
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)


def choose(seqs: Sequence[Seq], logprobs: torch.Tensor, keep: torch.Tensor | None = None) -> list[int]:
    """One token per row of scaled logprobs `[B, vocab]`: the argmax for greedy sequences (no generator), else
    one draw from the row's processed distribution (`processed_probs`; `keep`: the rows' nucleus masks when the
    caller has them). The draws of all rows take one batched inverse-CDF pass, each row's uniform from its own
    sequence's generator, so a request's tokens depend on its seed, never on the batch it shares (one
    multinomial call per row cost a fifth of a small model's step)."""
    sampled = [b for b, s in enumerate(seqs) if s.generator is not None]
    greedy = [b for b, s in enumerate(seqs) if s.generator is None]
    toks = [0] * len(seqs)
    if greedy:
        rows = logprobs if len(greedy) == len(seqs) else logprobs[greedy]
        for b, tok in zip(greedy, rows.argmax(-1).tolist()):
            toks[b] = tok
    if sampled:
        u = torch.cat(
            [torch.rand(1, generator=seqs[b].generator, dtype=torch.float64, device=logprobs.device) for b in sampled]
        )
        top_p = torch.tensor([seqs[b].req.params.top_p for b in sampled], dtype=logprobs.dtype, device=logprobs.device)
        every = len(sampled) == len(seqs)
        rows = logprobs if every else logprobs[sampled]
        kept = keep if keep is None or every else keep[sampled]
        for b, tok in zip(sampled, inverse_cdf(nucleus_weights(rows, top_p, kept), u).tolist()):
            toks[b] = tok
    return toks


class Sampler:
    """Appends one sampled token to each sequence and marks the ones that finished (their `finish_reason`)."""

    def __init__(self, tokenizer: Tokenizer, nucleus_logprobs: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(tokenizer.stop_token_ids)
        self.vocab_size: int = tokenizer.vocab_size
        self.nucleus_logprobs = nucleus_logprobs
        """Report the top-p nucleus' renormalised logprobs (the module docstring)."""

    def sample(self, seqs: list[Seq], logits: torch.Tensor, version: int | Sequence[int]) -> None:
        """Chooses one token per sequence from `logits` `[B, V]` (the head's rows; only the tokenizer's ids are
        read) and records it as sampled from `version` (one for all, or one per sequence: each sequence's adapter
        has its own versions). The nucleus masks are built once, for the draw and the reported logprobs both."""
        versions = [version] * len(seqs) if isinstance(version, int) else list(version)
        dev = logits.device
        temps = torch.tensor([s.req.params.temperature for s in seqs], dtype=torch.float32, device=dev)
        logp = scaled_logprobs(logits, temps, self.vocab_size)
        keep = None
        if any(s.req.params.top_p < 1 and s.generator is not None for s in seqs):
            top_p = torch.tensor(
                [s.req.params.top_p if s.generator is not None else 1.0 for s in seqs], dtype=logp.dtype, device=dev
            )
            keep = nucleus_keep(logp.exp(), top_p)
        toks = choose(seqs, logp, keep)
        for s, tok, lp, top, v in zip(seqs, toks, *self._reported(seqs, logp, toks, keep), versions):
            self._append(s, tok, lp, top, v)

    def record(self, s: Seq, tok: int, logprobs: torch.Tensor, version: int) -> None:
        """Appends `tok`, chosen elsewhere (speculative decoding), with its logprob and top alternatives from the
        target's scaled logprobs over the tokenizer's ids `[vocab]` (`scaled_logprobs`) at its position."""
        if not s.req.params.top_logprobs and not self._truncates(s):  # the common case, without building tensors
            self._append(s, tok, float(logprobs[tok]), [], version)
            return
        keep = None
        if self._truncates(s):
            keep = nucleus_keep(
                logprobs.exp()[None], torch.tensor([s.req.params.top_p], dtype=logprobs.dtype, device=logprobs.device)
            )
        (lp,), (top,) = self._reported([s], logprobs[None], [tok], keep)
        self._append(s, tok, lp, top, version)

    def _truncates(self, s: Seq) -> bool:
        """Whether the sequence's logprobs are reported under its top-p nucleus (the module docstring)."""
        p = s.req.params
        return self.nucleus_logprobs and p.top_p < 1 and p.temperature > 0

    def _reported(
        self, seqs: Sequence[Seq], logp: torch.Tensor, toks: list[int], keep: torch.Tensor | None
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Each row's logprob of its token and its `top_logprobs` alternatives (the full distribution's most
        likely ids), in one batched pass: under the full distribution, or, for the rows reported truncated,
        renormalised over the nucleus `keep` (the token chosen always lies in it; an alternative outside it
        reports FLOOR_LOGPROB)."""
        dev = logp.device
        chosen = logp.gather(1, torch.tensor(toks, dtype=torch.long, device=dev)[:, None])[:, 0].double()
        k = max(s.req.params.top_logprobs for s in seqs)
        top_vals, top_ids = logp.topk(k, dim=-1) if k else (None, None)
        top_vals = top_vals.double() if k else None
        truncated = [b for b, s in enumerate(seqs) if self._truncates(s)] if keep is not None else []
        if truncated:
            rows = torch.tensor(truncated, dtype=torch.long, device=dev)
            kept = keep[rows]
            log_mass = logp[rows].masked_fill(~kept, float("-inf")).logsumexp(-1).double()
            chosen[rows] -= log_mass
            if k:
                inside = kept.gather(1, top_ids[rows])
                top_vals[rows] = torch.where(
                    inside, top_vals[rows] - log_mass[:, None], torch.full_like(top_vals[rows], FLOOR_LOGPROB)
                )
        if not k:
            return chosen.tolist(), [[] for _ in seqs]
        ids, vals = top_ids.tolist(), top_vals.tolist()
        tops = [
            list(zip(ids[b][: s.req.params.top_logprobs], vals[b][: s.req.params.top_logprobs]))
            for b, s in enumerate(seqs)
        ]
        return chosen.tolist(), tops

    def _append(self, s: Seq, tok: int, logprob: float, top: list[tuple[int, float]], version: int) -> None:
        """Records `tok` with its reported logprob and alternatives, then checks the stop conditions."""
        s.tokens.append(tok)
        s.versions.append(version)
        s.logprobs.append(logprob)
        if s.req.params.top_logprobs:
            s.top.append(top)
        self._check_finished(s)

    def abort(self, s: Seq) -> None:
        """Ends an unfinished sequence with what it has generated so far."""
        if s.finish_reason is None:
            s.finish_reason = "abort"
            s.text = self._decode(s)

    def _check_finished(self, s: Seq) -> None:
        p = s.req.params
        if s.tokens[-1] in self.stop_token_ids or s.tokens[-1] in p.stop_token_ids:
            s.finish_reason = "stop"
        elif p.stop:
            text = self._decode(s)
            hits = [(text.find(stop), stop) for stop in p.stop if stop in text]
            if hits:
                cut, stop = min(hits)
                s.finish_reason, s.stop_reason, s.text = "stop", stop, text[:cut]
                return
        if s.finish_reason is None and len(s.tokens) >= p.max_tokens:
            s.finish_reason = "length"
        if s.finish_reason is not None:
            s.text = self._decode(s)

    def _decode(self, s: Seq) -> str:
        return self.tokenizer.decode(s.tokens, skip_special_tokens=s.req.params.skip_special_tokens)
