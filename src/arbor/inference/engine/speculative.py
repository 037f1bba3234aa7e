"""Speculative decoding for the local engine, drafting with the model's first MTP module (arbor.models.mtp).

Each decode step drafts up to k tokens per sequence, verifies them in one `[B, k + 1]` forward and keeps them by
the exact speculative-sampling rule against the target's processed distribution, so every token is distributed
as under plain decoding and carries the target's logprob. Why that is exact and how the caches need no rollback:
docs/inference.md, "Speculative decoding"."""

from __future__ import annotations

import torch

from arbor.inference.engine.requests import EngineStats, Request, Seq
from arbor.inference.engine.runner import left_padded, row_chunks
from arbor.inference.engine.sampler import Sampler, inverse_cdf, processed_probs, scaled_logprobs
from arbor.models.qwen3 import lm_logits


def accept_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for R rows at once: target probabilities `p [R, K + 1, V]`, draft probabilities
    `q [R, K, V]` that `drafts [R, K]` were drawn from (row r's first `lens[r]` are real) and uniforms
    `u [R, 2K + 1]` (float64; draft j is kept iff u[K + j] q(d) < p(d), u[2K] draws the last token). Returns
    (accepted drafts per row, the one token drawn after them: from the residual max(p - q, 0) at the first
    rejection, or from p after the last draft when all were kept). Every emitted token is distributed as a draw
    from p at its position."""
    R, K = drafts.shape
    rows = torch.arange(R, device=p.device)
    n = torch.zeros(R, dtype=torch.long, device=p.device)
    if K:
        idx = drafts[..., None]
        kept = u[:, K : 2 * K] * q.gather(-1, idx)[..., 0] < p[:, :K].gather(-1, idx)[..., 0]  # no division: q(d) > 0
        kept &= torch.arange(K, device=p.device) < lens[:, None]
        n = kept.long().cumprod(1).sum(1)  # the kept prefix
    p_n = p[rows, n]
    if K:
        residual = (p_n - q[rows, n.clamp_max(K - 1)]).clamp_min(0.0)
        # p == q up to rounding leaves the residual no mass: p itself then
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
        p_n = torch.where((n < lens)[:, None], residual, p_n)
    return n, inverse_cdf(p_n, u[:, 2 * K])


def accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """Greedy verification: drafts kept while they equal the target's argmax `target [k + 1]`, then the target's
    own token at the first difference (or after the last draft)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        if d != target[j]:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


class SpeculativeDecoder:
    """Drafts and verifies `draft_tokens` tokens per sequence and step over the runner's model and KV cache.

    Per sequence it keeps `spec_pending`: (first position, the decoder's hidden states `[n, H]` from there)
    whose MTP cache entries are not written yet (their next tokens are known now)."""

    def __init__(self, model: torch.nn.Module, kv, sampler: Sampler, *, draft_tokens: int, seq_len: int) -> None:
        if not len(getattr(model, "mtp", ())):
            raise ValueError("inference.speculative.enabled needs a model with MTP modules (model.mtp_depth > 0)")
        self.model, self.kv, self.sampler = model, kv, sampler
        self.k, self.seq_len = draft_tokens, seq_len
        self.device = next(model.parameters()).device
        self.mtp_layer = model.args.num_hidden_layers  # the first MTP module's cache layer, after the decoder's

    def admitted(self, seqs: list[Seq], prompt_hidden: torch.Tensor) -> None:
        """After a prefill (`prompt_hidden`: the prompt's hidden states `[P, H]`): the MTP cache of every prompt
        position whose next token is known (all but the last) is written now, once for the request and copied to
        its samples' slots, as part of the prefill (vLLM runs its MTP over the prompt in the prefill too). Left to
        the next decode step's catch-up, every row of that step would be padded to the newest prompt's length."""
        prompt = seqs[0].req.prompt
        P = len(prompt)
        self._write_known(seqs[0].slot, prompt_hidden, prompt[1:])
        if len(seqs) > 1 and P > 1:
            self.kv.copy_slot(seqs[0].slot, [s.slot for s in seqs[1:]], P - 1, layers=[self.mtp_layer])
        for s in seqs:
            s.spec_pending = (P - 1, prompt_hidden[P - 1 :])

    def prefill_many(self, requests: list[Request], budget: int) -> list[torch.Tensor]:
        """Prefills several requests in batched forwards (one row per request, chunked by `row_chunks` within
        `budget`), the MTP cache of their prompts too, as `admitted` does for one; returns each request's fp32
        logits `[1, V]` of its last prompt position."""
        heads = [r.seqs[0] for r in requests]
        last = self._write_rows(heads, [r.prompt for r in requests], budget)
        out = []
        for req, hidden in zip(requests, last):
            seqs, P = req.seqs, len(req.prompt)
            if len(seqs) > 1:  # every layer, the MTP module's included
                self.kv.copy_slot(seqs[0].slot, [s.slot for s in seqs[1:]], P)
            for s in seqs:
                s.spec_pending = (P - 1, hidden)
            out.append(lm_logits(self.model, hidden[None], 1)[0].float())
        return out

    def recompute(self, seqs: list[Seq], budget: int) -> None:
        """Rewrites each sequence's cache with the current weights (all positions before its newest token), the
        MTP module's too but for the last position, which the next step's catch-up writes; in batched forwards
        (`row_chunks` within `budget`)."""
        rows = [s.req.prompt + s.tokens[:-1] for s in seqs]
        for s, row, hidden in zip(seqs, rows, self._write_rows(seqs, rows, budget)):
            s.spec_pending = (len(row) - 1, hidden)

    def _write_rows(self, seqs: list[Seq], rows: list[list[int]], budget: int) -> list[torch.Tensor]:
        """Writes `rows[i]` at positions 0.. of `seqs[i]`'s slot (left-padded forwards, `left_padded`): the
        decoder's cache at every position, the MTP module's at all but the last (its next token is not known);
        returns each row's decoder hidden state at its last position, `[1, H]`."""
        last: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        for chunk in row_chunks([len(r) for r in rows], budget, [0] * len(rows)):
            ids, pos = left_padded([rows[i] for i in chunk], self.device)
            slots = torch.tensor([seqs[i].slot for i in chunk], dtype=torch.long, device=self.device)
            hidden = self.model.hidden_states(ids, pos, self.kv, slots)
            if ids.shape[1] > 1:  # column c's MTP entry reads the hidden state there and the token after it
                self.model.mtp_hidden(0, hidden[:, :-1], ids[:, 1:], pos[:, :-1], kv_cache=self.kv, cache_slots=slots)
            for b, i in enumerate(chunk):
                last[i] = hidden[b, -1:]
        return last

    def _write_known(self, slot: int, hidden: torch.Tensor, next_ids: list[int]) -> None:
        """Writes the MTP cache of positions 0 .. n - 1 of `slot` from the decoder's hidden states there
        (`hidden [>= n, H]`) and the token after each (`next_ids`, n of them)."""
        n = len(next_ids)
        if n == 0:
            return
        dev = self.device
        self.model.mtp_hidden(
            0,
            hidden[None, :n],
            torch.tensor([next_ids], dtype=torch.long, device=dev),
            torch.arange(n, device=dev)[None],
            kv_cache=self.kv,
            cache_slots=torch.tensor([slot], dtype=torch.long, device=dev),
        )

    def step(self, seqs: list[Seq], version: int, stats: EngineStats) -> None:
        """Drafts, verifies and appends the accepted tokens of every sequence (`sampler.record`)."""
        budgets = [self._budget(s) for s in seqs]
        K = max(budgets)
        # Every uniform a sampled row needs this step, in one draw from its own generator (reproducible per
        # request whatever the batch): K to draw drafts, K to accept them, one for the last token.
        sampled = [b for b, s in enumerate(seqs) if s.generator is not None]
        u = (
            torch.stack([torch.rand(2 * K + 1, generator=seqs[b].generator, dtype=torch.float64) for b in sampled])
            if sampled
            else None
        )
        drafts, q = self._draft(seqs, budgets, sampled, u)
        rows_ids, rows_pos = [], []
        for s, d in zip(seqs, drafts):
            ids = [s.tokens[-1]] + d
            pos = list(range(s.position, s.position + len(ids)))
            rows_ids.append(ids + [ids[-1]] * (K + 1 - len(ids)))  # shorter rows repeat their last input
            rows_pos.append(pos + [pos[-1]] * (K + 1 - len(pos)))
        x = torch.tensor(rows_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(rows_pos, dtype=torch.long, device=self.device)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)
        hidden = self.model.hidden_states(x, pos, self.kv, slots)
        logits = lm_logits(self.model, hidden, 0).float()
        temps = torch.tensor([s.req.params.temperature for s in seqs], dtype=torch.float32, device=self.device)
        logp = scaled_logprobs(
            logits.reshape(-1, logits.shape[-1]), temps.repeat_interleave(K + 1), self.sampler.vocab_size
        )
        logp = logp.view(len(seqs), K + 1, -1)
        greedy = logp.argmax(-1).tolist() if len(sampled) < len(seqs) else None
        kept: dict[int, list[int]] = {}
        if sampled:
            p = processed_probs(logp[sampled], self._top_p([seqs[b] for b in sampled])[:, None])
            lens = torch.tensor([budgets[b] for b in sampled], dtype=torch.long, device=self.device)
            padded = torch.tensor(
                [drafts[b] + [0] * (K - len(drafts[b])) for b in sampled], dtype=torch.long, device=self.device
            ).view(len(sampled), K)
            n, last = accept_sampled(p, q, padded, lens, u)
            for b, m, t in zip(sampled, n.tolist(), last.tolist()):
                kept[b] = drafts[b][:m] + [t]
        for b, s in enumerate(seqs):
            k = len(drafts[b])
            toks = kept[b] if s.generator is not None else accept_greedy(greedy[b][: k + 1], drafts[b])
            start, row = s.position, logp[b]
            for j, tok in enumerate(toks):
                self.sampler.record(s, tok, row[j], version)
                if s.finish_reason is not None:
                    break
            stats.draft_tokens += k
            stats.accepted_draft_tokens += len(toks) - 1
            s.spec_pending = (start, hidden[b, : len(toks)])

    def _top_p(self, seqs: list[Seq]) -> torch.Tensor:
        return torch.tensor([s.req.params.top_p for s in seqs], dtype=torch.float32, device=self.device)

    def _budget(self, s: Seq) -> int:
        """Drafts worth verifying for `s`: within its max_tokens (the step adds one token after the drafts) and
        the cache (the verifying forward writes positions position .. position + k)."""
        left = s.req.params.max_tokens - len(s.tokens) - 1
        return max(0, min(self.k, left, self.seq_len - 1 - s.position))

    def _draft(
        self, seqs: list[Seq], budgets: list[int], sampled: list[int], u: torch.Tensor | None
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Catch-up of the MTP cache over each sequence's pending positions, then `budgets[b]` drafts per
        sequence (greedy rows: the argmax; the `sampled` rows: drawn with their uniforms `u[:, i]`); returns the
        drafts and the sampled rows' processed draft probabilities `[len(sampled), K, V]`."""
        dev, model = self.device, self.model
        N = max(s.spec_pending[1].shape[0] for s in seqs)
        hid, nxt, pos, ns = [], [], [], []
        for s in seqs:
            start, h = s.spec_pending
            n = h.shape[0]
            ns.append(n)
            ids = (s.req.prompt + s.tokens)[start + 1 : start + n + 1]
            hid.append(torch.cat([h, h[-1:].expand(N - n, -1)]))
            nxt.append(ids + [ids[-1]] * (N - n))
            pos.append(list(range(start, start + n)) + [start + n - 1] * (N - n))
            s.spec_pending = None
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        inp_h = torch.stack(hid)
        inp_id = torch.tensor(nxt, dtype=torch.long, device=dev)
        inp_pos = torch.tensor(pos, dtype=torch.long, device=dev)
        out = model.mtp_hidden(0, inp_h, inp_id, inp_pos, kv_cache=self.kv, cache_slots=slots)
        last = torch.tensor(ns, dtype=torch.long, device=dev) - 1  # each row's last real input
        rows = torch.arange(len(seqs), device=dev)
        g, cur_h, cur_id, cur_pos = out[rows, last], inp_h[rows, last], inp_id[rows, last], inp_pos[rows, last]
        positions = torch.tensor([s.position for s in seqs], dtype=torch.long, device=dev)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[torch.Tensor] = []
        temps = torch.tensor([s.req.params.temperature for s in seqs], dtype=torch.float32, device=dev)
        top_p = self._top_p([seqs[b] for b in sampled])
        sampled_rows = torch.tensor(sampled, dtype=torch.long, device=dev)
        K = max(budgets)
        for i in range(K):
            logp = scaled_logprobs(model.mtp_logits(0, g).float(), temps, self.sampler.vocab_size)
            choice = logp.argmax(-1)
            if sampled:
                qs = processed_probs(logp[sampled_rows], top_p)
                probs.append(qs)
                choice[sampled_rows] = inverse_cdf(qs, u[:, i])
            chosen = choice.tolist()
            for b in range(len(seqs)):
                if i < budgets[b]:
                    drafts[b].append(chosen[b])
            more = [b for b in range(len(seqs)) if i + 1 < budgets[b]]  # the others repeat their last input
            if not more:
                break
            if len(more) == len(seqs):
                cur_h, cur_id, cur_pos = g, choice, positions + i
            else:
                idx = torch.tensor(more, dtype=torch.long, device=dev)
                cur_h, cur_id, cur_pos = cur_h.clone(), cur_id.clone(), cur_pos.clone()
                cur_h[idx], cur_id[idx], cur_pos[idx] = g[idx], choice[idx], positions[idx] + i
            g = model.mtp_hidden(
                0, cur_h[:, None], cur_id[:, None], cur_pos[:, None], kv_cache=self.kv, cache_slots=slots
            )[:, 0]
        if not sampled:
            return drafts, None
        return drafts, torch.stack(probs, 1) if probs else g.new_zeros(len(sampled), 0, self.sampler.vocab_size)
