"""Continuous batching over the local engine's KV-cache slots: admission of queued requests into free slots, one
decode step for every running sequence, and the retirement of finished, aborted, abandoned or failed ones.

Only the engine thread calls it. A request is admitted whole (all `n` samples at once, first come first served
while the head of the queue fits); its samples then leave the running batch one by one as they finish, and its
future resolves when the last one does. An error in one request's forward fails that request only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from arbor.inference.inbox import Inbox
from arbor.inference.requests import EngineStats, Request, Seq, by_request, fail, resolve
from arbor.inference.runner import ModelRunner
from arbor.inference.sampler import Sampler

log = logging.getLogger("arbor.inference.engine")


class SlotScheduler:
    """The running batch over `max_batch_size` slots, fed from `inbox`; `stats` counts its work."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, inbox: Inbox, *, max_batch_size: int,
                 version: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.inbox = inbox
        self.stats = EngineStats(policy_version=version)
        self.running: list[Seq] = []
        self._free = list(range(max_batch_size - 1, -1, -1))  # pop() hands out low slots first

    def admit(self) -> None:
        """Prefills queued requests, first come first served, while the head of the queue fits."""
        while (req := self.inbox.next_admissible(len(self._free))) is not None:
            try:
                req.lora_slot = self.runner.adapters.slot_of(req.adapter)  # unloaded since it was queued: fails
                for i in range(req.params.n):
                    # the slot is taken only once its sample exists, so a sample that cannot be set up leaks none
                    req.seqs.append(Seq(req, i, self._free[-1], self.runner.device))
                    self._free.pop()
                logits = self.runner.prefill(req.seqs)
                self.stats.requests += 1
                self.stats.prompt_tokens += len(req.prompt)
                self.running.extend(req.seqs)
                self._sample(req.seqs, logits.expand(len(req.seqs), -1))
            except Exception as e:  # this request's fault or not, it fails alone: the loop serves the others
                log.exception("admitting request %s failed", req.request_id)
                self._fail_request(req, e)

    def decode_step(self) -> None:
        """Samples the next token of every running sequence with one batched forward."""
        seqs = self.running
        try:
            logits = self.runner.decode(seqs)
            self.stats.decode_steps += 1
            self.stats.max_decode_batch = max(self.stats.max_decode_batch, len(seqs))
            self._sample(seqs, logits)
        except Exception as e:
            log.exception("decode step failed")
            for group in by_request(seqs).values():
                self._fail_request(group[0].req, e)

    def recompute_caches(self, adapter: str | None = None) -> None:
        """Rebuilds the KV cache of running sequences with the current weights (prompt once per request); with
        `adapter`, only those of that adapter's requests (a new version of it was loaded)."""
        for seqs in by_request(self.running).values():
            if adapter is not None and seqs[0].req.adapter != adapter:
                continue
            try:
                self.runner.recompute(seqs)
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
        self.stats.generated_tokens += len(seqs)
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
