"""Token choice for the local engine: one token per running sample from a batch of logits, recorded with its
logprob, top alternatives and policy version, then the sample's stop conditions (eos, stop strings, max_tokens).

Logprobs follow the convention in `arbor.inference.sampling`: temperature-scaled; with top-p (at a temperature
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
(arbor.inference.vllm_logits) and what the trainer scores (its `logprobs` module cuts the head to the same ids),
so the three agree exactly; a padding id is never drawn, chosen or listed.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from arbor.inference.requests import Seq


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """`log_softmax(logits[:, :vocab] / T)` per row in fp32 `[B, vocab]` (`vocab`: the tokenizer's id count, None
    for every column); rows with T = 0 use T = 1 (greedy reports the untempered distribution)."""
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits[:, :vocab].float() / t[:, None], dim=-1)


FLOOR_LOGPROB = -9999.0
"""What a listed alternative outside the nucleus reports (its logprob is -inf; vLLM's OpenAI server says -9999)."""


def nucleus(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Ids of a row's top-p nucleus, most likely first: a token is kept if the mass strictly before it is below
    top_p (the most likely token always is). The trainer's `nucleus_mask` applies the same rule."""
    sorted_p, order = logprobs.exp().sort(descending=True, stable=True)
    return order[(sorted_p.cumsum(0) - sorted_p) < top_p]


def processed_probs(logprobs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """The distribution a sampled token is drawn from, as probabilities `[..., vocab]` for rows of scaled logprobs
    over the tokenizer's ids `[..., vocab]` (`scaled_logprobs`) with their `top_p` (a float, or one per row):
    the smallest top-p nucleus (`nucleus`'s rule), renormalised."""
    weights = logprobs.exp()
    top_p = torch.as_tensor(top_p, dtype=logprobs.dtype, device=logprobs.device)
    if bool((top_p < 1.0).any()):
        sorted_p, order = weights.sort(dim=-1, descending=True, stable=True)
        # Keep a token if the mass strictly before it is below top_p (as `nucleus`), rows with top_p = 1 whole.
        keep_sorted = ((sorted_p.cumsum(-1) - sorted_p) < top_p[..., None]) | (top_p[..., None] >= 1.0)
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        weights = torch.where(keep, weights, torch.zeros_like(weights))
    return weights / weights.sum(-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of `probs` `[R, V]` from uniforms `u` `[R]` in [0, 1) (float64): the first id whose
    cumulative probability exceeds u times the row's total, so an id of probability 0 is never drawn."""
    c = probs.double().cumsum(-1)
    return torch.searchsorted(c, (u * c[:, -1])[:, None], right=True)[:, 0].clamp_max(probs.shape[-1] - 1)


def choose(seqs: Sequence[Seq], logprobs: torch.Tensor) -> list[int]:
    """One token per row of scaled logprobs `[B, vocab]`: the argmax for greedy sequences (no generator), else
    one draw from the row's processed distribution (`processed_probs`). The draws of all rows take one batched
    inverse-CDF pass, each row's uniform from its own sequence's generator, so a request's tokens depend on its
    seed, never on the batch it shares (one multinomial call per row cost a fifth of a small model's step)."""
    toks = logprobs.argmax(-1).tolist()
    sampled = [b for b, s in enumerate(seqs) if s.generator is not None]
    if sampled:
        u = torch.cat([torch.rand(1, generator=seqs[b].generator, dtype=torch.float64, device=logprobs.device)
                       for b in sampled])
        top_p = torch.tensor([seqs[b].req.params.top_p for b in sampled], dtype=logprobs.dtype,
                             device=logprobs.device)
        rows = logprobs if len(sampled) == len(seqs) else logprobs[sampled]
        for b, tok in zip(sampled, inverse_cdf(processed_probs(rows, top_p), u).tolist()):
            toks[b] = tok
    return toks


class Sampler:
    """Appends one sampled token to each sequence and marks the ones that finished (their `finish_reason`)."""

    def __init__(self, tokenizer: Any, nucleus_logprobs: bool = False) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.vocab_size: int = tokenizer.vocab_size
        self.nucleus_logprobs = nucleus_logprobs
        """Report the top-p nucleus' renormalised logprobs (the module docstring)."""

    def sample(self, seqs: list[Seq], logits: torch.Tensor, version: int | Sequence[int]) -> None:
        """Chooses one token per sequence from `logits` `[B, V]` (the head's rows; only the tokenizer's ids are
        read) and records it as sampled from `version` (one for all, or one per sequence: each sequence's adapter
        has its own versions)."""
        versions = [version] * len(seqs) if isinstance(version, int) else list(version)
        temps = torch.tensor([s.req.params.temperature for s in seqs], dtype=torch.float32, device=logits.device)
        logp = scaled_logprobs(logits, temps, self.vocab_size)
        toks = choose(seqs, logp)
        k = max(s.req.params.top_logprobs for s in seqs)
        top_vals, top_ids = (logp.topk(k, dim=-1) if k else (None, None))
        top_vals = top_vals.tolist() if k else None
        top_ids = top_ids.tolist() if k else None
        for b, s in enumerate(seqs):
            n = s.req.params.top_logprobs
            self._append(s, toks[b], logp[b], versions[b], self._kept(s, logp[b]), top_ids[b][:n] if n else [],
                         top_vals[b][:n] if n else [])

    def record(self, s: Seq, tok: int, logprobs: torch.Tensor, version: int) -> None:
        """Appends `tok`, chosen elsewhere (speculative decoding), with its logprob and top alternatives from the
        target's scaled logprobs over the tokenizer's ids `[vocab]` (`scaled_logprobs`) at its position."""
        k = s.req.params.top_logprobs
        if not k:  # the common case, without building empty tensors per token
            self._append(s, tok, logprobs, version, self._kept(s, logprobs), [], [])
            return
        vals, ids = logprobs.topk(k)
        self._append(s, tok, logprobs, version, self._kept(s, logprobs), ids.tolist(), vals.tolist())

    def _kept(self, s: Seq, logp: torch.Tensor) -> torch.Tensor | None:
        """The row's nucleus when its logprobs are reported truncated, else None."""
        p = s.req.params
        return nucleus(logp, p.top_p) if self.nucleus_logprobs and p.top_p < 1 and p.temperature > 0 else None

    def _append(self, s: Seq, tok: int, logp: torch.Tensor, version: int, kept: torch.Tensor | None,
                top_ids: list[int], top_vals: list[float]) -> None:
        """Records `tok` with its logprob under `logp` `[vocab]` (renormalised over the nucleus `kept` when reported
        truncated) and its listed alternatives, then checks the stop conditions."""
        s.tokens.append(tok)
        s.versions.append(version)
        if kept is None:
            s.logprobs.append(float(logp[tok]))
            if top_ids:
                s.top.append(list(zip(top_ids, top_vals)))
        else:
            self._record_truncated(s, logp, kept, tok, top_ids)
        self._check_finished(s)

    @staticmethod
    def _record_truncated(s: Seq, logp: torch.Tensor, kept: torch.Tensor, tok: int, top_ids: list[int]) -> None:
        """The token's logprob (and its alternatives') under the nucleus, renormalised: the choice is always in
        the nucleus."""
        log_mass = float(logp[kept].logsumexp(0))
        s.logprobs.append(float(logp[tok]) - log_mass)
        if top_ids:
            inside = set(kept.tolist())
            n = s.req.params.top_logprobs
            s.top.append([(i, float(logp[i]) - log_mass if i in inside else FLOOR_LOGPROB) for i in top_ids[:n]])

    def abort(self, s: Seq) -> None:
        """Ends an unfinished sequence with what it has generated so far."""
        if s.finish_reason is None:
            s.finish_reason = "abort"
            s.text = self._decode(s)

    def _check_finished(self, s: Seq) -> None:
        p = s.req.params
        if s.tokens[-1] == self.eos_token_id:
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
