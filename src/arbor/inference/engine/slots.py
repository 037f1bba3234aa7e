"""Continuous batching over the local engine's KV-cache slots: admission of queued requests into free slots, one
decode step for every running sequence, and the retirement of finished, aborted, abandoned or failed ones.

Only the engine thread calls it. A request is admitted whole (all `n` samples at once, first come first served
while the head of the queue fits); its samples then leave the running batch one by one as they finish, and its
future resolves when the last one does. An error in one request's forward fails that request only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from arbor.inference.engine.inbox import Inbox
from arbor.inference.engine.requests import EngineStats, Request, Seq, by_request, fail, resolve
from arbor.inference.engine.runner import ModelRunner
from arbor.inference.engine.sampler import Sampler
from arbor.inference.engine.speculative import SpeculativeDecoder

log = logging.getLogger("arbor.inference.engine.core")


class SlotScheduler:
    """The running batch over `max_batch_size` slots, fed from `inbox`; `stats` counts its work. With `spec`
    each decode step is a speculative one (arbor.inference.engine.speculative) for the base model's requests."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        inbox: Inbox,
        *,
        max_batch_size: int,
        version: int,
        spec: SpeculativeDecoder | None = None,
    ) -> None:
        self.runner = runner
        self.spec = spec
        self.sampler = sampler
        self.inbox = inbox
        self.stats = EngineStats(policy_version=version)
        self.running: list[Seq] = []
        self._free = list(range(max_batch_size - 1, -1, -1))  # pop() hands out low slots first

    def admit(self) -> None:
        """Prefills queued requests, first come first served, while the head of the queue fits: together in
        batched forwards (speculative ones apart), but for those asking for prompt logprobs and, should the
        batched forwards fail, request by request, so that an error fails only its request."""
        admitted = []
        while (req := self.inbox.next_admissible(len(self._free))) is not None:
            try:
                req.lora_slot = self.runner.adapters.slot_of(req.adapter)  # unloaded since it was queued: fails
                for i in range(req.params.n):
                    # the slot is taken only once its sample exists, so a sample that cannot be set up leaks none
                    req.seqs.append(Seq(req, i, self._free[-1], self.runner.device))
                    self._free.pop()
                admitted.append(req)
            except Exception as e:
                log.exception("admitting request %s failed", req.request_id)
                self._fail_request(req, e)
        together = [r for r in admitted if r.params.prompt_logprobs is None and r.images is None]
        logits: dict[int, torch.Tensor] = {}
        for group, prefill in (
            ([r for r in together if not self._speculative(r)], self.runner.prefill_many),
            ([r for r in together if self._speculative(r)], self._spec_prefill),
        ):
            if len(group) > 1:
                try:
                    logits.update(zip(map(id, group), prefill(group)))
                except Exception:
                    log.warning("batched prefill failed; prefilling request by request", exc_info=True)
        for req in admitted:
            self._start(req, logits.get(id(req)))

    def _start(self, req: Request, logits: torch.Tensor | None) -> None:
        """Puts an admitted request's samples in the running batch with their first tokens, prefilling it alone
        unless `logits` (its last prompt position's, from a batched prefill) are given."""
        try:
            if logits is None:
                logits = self.runner.prefill(req.seqs)
                if self._speculative(req):
                    self.spec.admitted(req.seqs, self.runner.last_hidden)
            self.stats.requests += 1
            self.stats.prompt_tokens += len(req.prompt)
            self.running.extend(req.seqs)
            self._sample(req.seqs, logits.expand(len(req.seqs), -1))
        except Exception as e:  # this request's fault or not, it fails alone: the loop serves the others
            log.exception("admitting request %s failed", req.request_id)
            self._fail_request(req, e)

    def decode_step(self) -> None:
        """Samples the next token of every running sequence with one batched forward (or, speculative, appends
        the verified drafts and one more token; a LoRA adapter's sequences decode plainly beside them)."""
        seqs = self.running
        stats = self.stats
        try:
            t0, before = time.perf_counter(), sum(len(s.tokens) for s in seqs)
            drafted = [s for s in seqs if self._speculative(s.req)]
            plain = [s for s in seqs if not self._speculative(s.req)] if drafted else seqs
            if plain:
                logits = self.runner.decode(plain)
                self.sampler.sample(plain, logits, [self._version(s.req) for s in plain])
            if drafted:
                self.spec.step(drafted, stats.policy_version, stats)
            stats.decode_steps += 1
            stats.max_decode_batch = max(stats.max_decode_batch, len(seqs))
            added = sum(len(s.tokens) for s in seqs) - before
            stats.decode_tokens += added
            stats.decode_seq_steps += len(seqs)
            stats.decode_seconds += time.perf_counter() - t0
            self._retire(seqs, added)
        except Exception as e:
            log.exception("decode step failed")
            for group in by_request(seqs).values():
                self._fail_request(group[0].req, e)

    def recompute_caches(self, adapter: str | None = None) -> None:
        """Rebuilds the KV cache of running sequences with the current weights; with `adapter`, only those of
        that adapter's requests (a new version of it was loaded). Recomputed together in batched forwards (the
        speculative ones, whose MTP cache is rebuilt too, apart); should that fail, request by request, so that
        an error fails only its request."""
        groups = [
            seqs for seqs in by_request(self.running).values() if adapter is None or seqs[0].req.adapter == adapter
        ]
        for part, recompute in (
            ([g for g in groups if not self._speculative(g[0].req)], self.runner.recompute),
            ([g for g in groups if self._speculative(g[0].req)], self._spec_recompute),
        ):
            if not part:
                continue
            try:
                recompute([s for seqs in part for s in seqs])
            except Exception:
                log.warning("batched cache recomputation failed; recomputing request by request", exc_info=True)
                for seqs in part:
                    self._recompute_alone(seqs, recompute)

    def _spec_prefill(self, requests: list[Request]) -> list[torch.Tensor]:
        assert self.spec is not None
        return self.spec.prefill_many(requests, self.runner.rows_budget)

    def _spec_recompute(self, seqs: list[Seq]) -> None:
        assert self.spec is not None
        self.spec.recompute(seqs, self.runner.rows_budget)

    def _recompute_alone(self, seqs: list[Seq], recompute: Callable[[list[Seq]], None]) -> None:
        """Recomputes one request's sequences; its error fails that request."""
        try:
            recompute(seqs)
        except Exception as e:
            self._fail_request(seqs[0].req, e)

    def drop_abandoned(self) -> None:
        """Frees the slots of requests whose caller cancelled them (or that failed)."""
        if any(s.req.abandoned for s in self.running):
            for s in self.running:
                if s.req.abandoned:
                    self._release(s)
            self.running = [s for s in self.running if not s.req.abandoned]
            self.stats.running = len(self.running)

    def abort(self, ids: frozenset[str] | None) -> int:
        """Finishes matching requests now: queued ones with no tokens, running ones with their tokens so far."""
        return self.abort_where(lambda r: ids is None or r.request_id in ids)

    def abort_where(self, hit: Callable[[Request], bool]) -> int:
        """`abort` of the requests `hit` selects (an unloaded adapter's, say)."""
        queued = self.inbox.take_waiting(hit)
        for req in queued:
            resolve(req.future, req.aborted_output())
        running = {id(s.req): s.req for s in self.running if hit(s.req)}
        for req in running.values():
            for s in req.seqs:
                self.sampler.abort(s)
                self._release(s)
            resolve(req.future, req.output())
        self.running = [s for s in self.running if not hit(s.req)]
        self.stats.running = len(self.running)
        return len(queued) + len(running)

    def take_running(self) -> list[Request]:
        """Empties the running batch (the engine is stopping); returns its requests."""
        requests = [seqs[0].req for seqs in by_request(self.running).values()]
        self.running = []
        return requests

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """Samples one token per sequence, then retires the finished ones and resolves completed requests."""
        self.sampler.sample(seqs, logits, [self._version(s.req) for s in seqs])
        self._retire(seqs, len(seqs))

    def _retire(self, seqs: list[Seq], added: int) -> None:
        """Counts the `added` tokens, retires the finished sequences and resolves completed requests."""
        self.stats.generated_tokens += added
        done = [s for s in seqs if s.finish_reason is not None]
        if done:
            for s in done:
                self._release(s)
            self.running = [s for s in self.running if s.finish_reason is None]
            for group in by_request(done).values():
                req = group[0].req
                if all(x.finish_reason is not None for x in req.seqs):
                    resolve(req.future, req.output())
        self.stats.running = len(self.running)

    def _speculative(self, req: Request) -> bool:
        """Whether `req` decodes speculatively: the MTP drafts are the base model's, so an adapter's requests
        (whose verifying forward would need their adapter's rows) decode plainly."""
        return self.spec is not None and req.lora_slot == 0

    def _version(self, req: Request) -> int:
        """The policy version a token of `req` is sampled from: its adapter's, else the base weights'."""
        if req.adapter is None:
            return self.stats.policy_version
        version = self.runner.adapters.version_of(req.adapter)
        return self.stats.policy_version if version is None else version

    def _release(self, s: Seq) -> None:
        if s.holds_slot:
            self._free.append(s.slot)
            s.holds_slot = False

    def _fail_request(self, req: Request, err: BaseException) -> None:
        """Frees every slot the request holds and hands the error to its caller."""
        for s in req.seqs:
            self._release(s)
        self.running = [s for s in self.running if s.req is not req]
        self.stats.running = len(self.running)
        fail(req.future, err)
