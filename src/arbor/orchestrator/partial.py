"""Partial rollouts: generation that can be aborted mid-way, parked, and resumed later with its tokens kept.

`PartialRollouts` wraps an `InferenceClient`. Each group of rollouts gets a `GroupHandle` whose `generate` has
`InferenceClient.generate`'s signature; `generate_group` (and any environment that calls a generate function
once per turn) uses it and always sees one complete completion per sample. Underneath, every request the
handle sends carries a fresh request id, so the orchestrator can:

- `abort` a group: the handle's gate closes and its in-flight requests are aborted on the servers
  (`/abort_requests`); their responses come back with the tokens, logprobs and per-token policy versions
  produced so far (`finish_reason == "abort"`). The handle keeps those pieces and waits at the gate, so the
  caller's coroutine (its environment state included) simply stays suspended: the group is *parked*.
- `resume` it: the gate opens, and each unfinished sample is re-submitted as prompt + tokens so far with the
  remaining `max_tokens` (a request of its own, n = 1, with a seed derived from the original one). Pieces are
  concatenated: token ids, logprobs and per-token versions, so the trainer's per-token importance ratio and
  the per-token staleness bound see exactly which policy sampled what. At temperature 0 a resumed sample is
  token for token the uninterrupted one (the continuation's prefill sees the same prefix).

Departures from slime (whose partial rollouts this follows): slime keeps aborted samples in a buffer and
re-generates from the data side; here the park happens inside the per-request call, so multi-turn
environments need no cooperation. Text of a resumed sample is re-decoded from all its token ids when a
`decode` function is given (pieces may split a multi-byte character), else the pieces' texts are joined.
MoE routed experts come from the last piece, which re-encodes the whole prefix (as the local engine does for
every in-flight sequence after a weight update).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
import zlib
from collections.abc import Callable
from typing import Any

from arbor.orchestrator.client import Completion, InferenceClient


class GroupHandle:
    """One group's resumable generation (see the module docstring); create it with `PartialRollouts.handle`."""

    def __init__(self, owner: "PartialRollouts", key: int | str) -> None:
        self.owner, self.key = owner, key
        self.aborts = 0
        """Times this group's requests were aborted (any reason)."""
        self.resumes = 0
        """Times it was resumed after a scheduling abort (a move to the queue's tail or a park between steps);
        aborts around a weight update are not counted (they only pause it)."""
        self.split = False
        """Some sample of this group was generated in more than one piece."""
        self.oldest_version: int | None = None
        """Oldest policy version of any token generated so far (the per-token staleness bound's input)."""
        self._active: set[str] = set()
        self._gate = asyncio.Event()
        self._gate.set()
        self._ids = itertools.count()

    @property
    def parked(self) -> bool:
        return not self._gate.is_set()

    async def _open(self) -> None:
        while not self._gate.is_set():
            await self._gate.wait()

    async def _piece(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        images: dict[str, Any] | None = None,
    ) -> list[Completion]:
        await self._open()
        rid = f"arbor-{self.owner.run_id}-{self.key}-{next(self._ids)}"
        self._active.add(rid)
        try:
            extra = {"images": images} if images else {}
            out = await self.owner.client.generate(
                prompt_ids, n, max_tokens, temperature, top_p, seed, request_id=rid, **extra
            )
        finally:
            self._active.discard(rid)
        for c in out:
            if c.policy_versions:
                low = min(c.policy_versions)
                self.oldest_version = low if self.oldest_version is None else min(self.oldest_version, low)
        return out

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
        images: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """`InferenceClient.generate`, made whole across aborts: returns when every sample has really finished
        (a resumed piece carries the prompt's `images` again)."""
        first = await self._piece(prompt_ids, n, max_tokens, temperature, top_p, seed, images)
        pieces: list[list[Completion]] = [[c] for c in first]
        for attempt in itertools.count(1):
            todo = [i for i, p in enumerate(pieces) if p[-1].finish_reason == "abort"]
            if not todo:
                break
            done = [sum(len(c.token_ids) for c in pieces[i]) for i in todo]
            if len(todo) == n and not any(done):  # nothing generated at all: the same request again
                for i, c in enumerate(await self._piece(prompt_ids, n, max_tokens, temperature, top_p, seed, images)):
                    pieces[i] = [c]
                continue
            self.split = True

            async def more(i: int, k: int) -> Completion:
                if k >= max_tokens:  # cannot happen with a conforming server (it would say "length")
                    return Completion([], [], [], "", "length")
                ids = prompt_ids + [t for c in pieces[i] for t in c.token_ids]
                s = None if seed is None else zlib.crc32(f"{seed}/{i}/{attempt}".encode()) & 0x7FFFFFFF
                (c,) = await self._piece(ids, 1, max_tokens - k, temperature, top_p, s, images)
                return c

            for i, c in zip(todo, await asyncio.gather(*(more(i, k) for i, k in zip(todo, done)))):
                pieces[i].append(c)
        return [self._join(p) for p in pieces]

    def _join(self, pieces: list[Completion]) -> Completion:
        if len(pieces) == 1:
            return pieces[0]
        ids = [t for c in pieces for t in c.token_ids]
        decode = self.owner.decode
        text = decode(ids) if decode is not None else "".join(c.text for c in pieces)
        last = pieces[-1]
        return Completion(
            ids,
            [x for c in pieces for x in c.logprobs],
            [v for c in pieces for v in c.policy_versions],
            text,
            last.finish_reason,
            last.routed_experts,
            pieces=len(pieces),
        )

    def pause(self) -> list[str]:
        """Closes the gate (no new request goes out) and returns the ids of the requests in flight."""
        self._gate.clear()
        return sorted(self._active)

    def resume(self, scheduled: bool = True) -> None:
        if self.parked and scheduled:
            self.resumes += 1
        self._gate.set()


class PartialRollouts:
    """The controller: hands out `GroupHandle`s and aborts, parks and resumes them on `client`'s fleet."""

    def __init__(
        self, client: InferenceClient, decode: Callable[[list[int]], str] | None = None, run_id: str | None = None
    ) -> None:
        self.client, self.decode = client, decode
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.handles: dict[int | str, GroupHandle] = {}
        self.aborted = 0
        """Groups aborted so far (cumulative)."""

    def handle(self, key: int | str) -> GroupHandle:
        h = self.handles[key] = GroupHandle(self, key)
        return h

    def forget(self, key: int | str) -> None:
        self.handles.pop(key, None)

    async def abort(self, handles: list[GroupHandle]) -> None:
        """Parks these groups: closes their gates and aborts their in-flight requests. Each call of their
        `generate` returns only once the group is resumed and finished."""
        ids = [rid for h in handles for rid in h.pause()]
        for h in handles:
            h.aborts += 1
        self.aborted += len(handles)
        if ids:
            await self.client.abort_requests(ids)

    async def abort_all(self) -> list[GroupHandle]:
        """Aborts every running group (for a weight update); returns them, for `resume(..., scheduled=False)`."""
        running = [h for h in self.handles.values() if not h.parked]
        await self.abort(running)
        return running

    @staticmethod
    def resume(handles: list[GroupHandle], scheduled: bool = True) -> None:
        for h in handles:
            h.resume(scheduled)
