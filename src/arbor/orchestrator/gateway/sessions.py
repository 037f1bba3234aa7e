"""The gateway's session store: the open agent sessions, their lifecycle, and the queue of work for remote agents.

A session is opened by an environment (arbor.environments.black_box) or over HTTP, collects the model calls made
through it (arbor.orchestrator.trajectory), is closed by a reward, and is finished (forgotten) by its owner once
no call is still generating. At most `max_open_sessions` are held; closed sessions opened over HTTP, which no
in-process owner will finish, are evicted to make room. Pull mode queues tasks here for remote agents to claim.
Refusals are `HTTPError`s (404 unknown, 409 closed or existing, 429 full) so the HTTP routes answer them as they are.

`GatewayCounts` is what the gateway reports in metrics.jsonl (`gateway/...`, arbor.orchestrator.figures): the
requests it refused by status class, the sessions finished without a posted reward by why they ended, the
temperature overrides and the completions cut at a stop string. An agent's mistakes never vanish: each is a
count there, beside the log line.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.trajectory import Trajectory, Turn
from arbor.transport.http import HTTPError

if TYPE_CHECKING:
    from arbor.orchestrator.rollout import Rollout


@dataclasses.dataclass
class Session:
    """One agent run: the tree of its model calls (arbor.orchestrator.trajectory), its reward, its state."""

    id: str
    trajectory: Trajectory
    task_id: int | str = -1
    group_id: int = -1
    closed: bool = False
    reward: float | None = None
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    external: bool = False
    """Opened over HTTP (POST /v1/sessions) rather than by an environment: served and recorded, not trained on."""
    pending: int = 0
    """Calls being generated; a session closed meanwhile still records them (the agent saw their answers)."""
    responses: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    """Responses API: each stored response's conversation (without instructions), which a later call continues
    by `previous_response_id` (arbor.orchestrator.gateway.responses)."""

    @property
    def turns(self) -> list[Turn]:
        return self.trajectory.turns

    def rollouts(self, episode_id: int = -1) -> list["Rollout"]:
        """One sample per chain of calls with the session's reward; `episode_id`: its index in its group."""
        return self.trajectory.rollouts(
            self.task_id, self.reward or 0.0, self.components, group_id=self.group_id, episode_id=episode_id
        )


UNREWARDED = ("scored_by_env", "timed_out", "agent_failed", "abandoned")
"""Why a session ended without a posted reward: its agent exited cleanly without posting one (the environment
scored its answer), outlived its timeout (remote: no reward arrived in time), exited non-zero or raised, or its
owner finished it for another reason (a cancelled group)."""


@dataclasses.dataclass
class GatewayCounts:
    """Cumulative counters of the gateway, reported as `gateway/...` figures."""

    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Refused requests by status class ("4xx": the agent's error; "5xx": the backend's or the gateway's)."""
    unrewarded: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Sessions finished without a posted reward, by UNREWARDED reason."""
    temperature_overrides: int = 0
    """Calls whose own temperature was replaced by the run's (`override_sampling`)."""
    stop_trimmed: int = 0
    """Completions cut at a stop string whose tokens were trimmed to what the agent saw."""
    stop_untrimmed: int = 0
    """Completions cut at a stop string inside a token: trained with the stop string's tokens."""

    def figures(self) -> dict[str, int]:
        out = {f"gateway/rejected_{c}": self.rejected[c] for c in ("4xx", "5xx")}
        out.update({f"gateway/unrewarded/{r}": self.unrewarded[r] for r in UNREWARDED})
        out["gateway/temperature_overrides"] = self.temperature_overrides
        out["gateway/stop_trimmed"] = self.stop_trimmed
        out["gateway/stop_untrimmed"] = self.stop_untrimmed
        return out


class SessionStore:
    """The open sessions by id, with the events their waiters need; lives on the caller's event loop."""

    def __init__(self, tokenizer: Tokenizer, max_open_sessions: int) -> None:
        self.tokenizer = tokenizer
        self.max_open_sessions = max_open_sessions
        # Mutated in place, never rebound: the gateway hands this same dict out as `Gateway.sessions`.
        self.sessions: dict[str, Session] = {}
        # Per session: set while no call is generating (`finish` waits on it), set once rewarded (`wait_reward`).
        self._idle: dict[str, asyncio.Event] = {}
        self._rewarded: dict[str, asyncio.Event] = {}
        # (session id, task text) offered to remote agents, claimed in order.
        self._work: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.counts = GatewayCounts()

    @property
    def open_count(self) -> int:
        """Sessions not yet closed (a session closed by its reward waits for its owner, but is not open)."""
        return sum(not s.closed for s in self.sessions.values())

    def open(self, session_id: str | None = None, task_id: int | str = -1, group_id: int = -1) -> Session:
        if len(self.sessions) >= self.max_open_sessions:
            # Sessions opened over HTTP have no in-process owner to finish them: closed ones make room.
            for sid in [k for k, v in self.sessions.items() if v.external and v.closed and not v.pending]:
                self._forget(sid)
        if len(self.sessions) >= self.max_open_sessions:
            raise HTTPError(429, f"{len(self.sessions)} sessions are open (max_open_sessions)", kind="rate_limit_error")
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise HTTPError(409, f"session {sid!r} exists", "id")
        s = self.sessions[sid] = Session(sid, Trajectory(self.tokenizer), task_id, group_id)
        self._idle[sid] = asyncio.Event()
        self._idle[sid].set()
        self._rewarded[sid] = asyncio.Event()
        return s

    def get(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise HTTPError(404, f"unknown session {session_id!r}", kind="not_found_error")
        return s

    def close(
        self, session_id: str, reward: float | None = None, components: dict[str, float] | None = None
    ) -> Session:
        s = self.get(session_id)
        if s.closed:
            raise HTTPError(409, f"session {session_id!r} is closed", kind="conflict_error")
        s.closed, s.reward, s.components = True, reward, dict(components or {})
        self._rewarded[session_id].set()
        return s

    async def finish(self, session_id: str, ended: str = "abandoned") -> Session:
        """Closes (if open), waits for calls still generating, and forgets the session; returns it. A session
        without a posted reward is counted under `ended` (one of UNREWARDED: why it ended)."""
        if ended not in UNREWARDED:
            raise ValueError(f"ended must be one of {UNREWARDED}, got {ended!r}")
        s = self.get(session_id)
        if s.reward is None:
            self.counts.unrewarded[ended] += 1
        s.closed = True
        await self._idle[session_id].wait()
        self._forget(session_id)
        return s

    def abandon(self, session_id: str) -> None:
        """Forgets a session at once, without waiting for its calls (its owner was cancelled); counted as
        "abandoned" when it had no reward. A call still generating in it finishes unrecorded by anyone."""
        s = self.sessions.get(session_id)
        if s is None:
            return
        if s.reward is None:
            self.counts.unrewarded["abandoned"] += 1
        s.closed = True
        self._forget(session_id)

    async def wait_reward(self, session_id: str, timeout: float) -> bool:
        """Waits until the session is closed by a reward POST; False on timeout."""
        try:
            await asyncio.wait_for(self._rewarded[session_id].wait(), timeout)
            return True
        except TimeoutError:
            return False

    @contextlib.contextmanager
    def generating(self, s: Session) -> Iterator[None]:
        """Marks a call of `s` in flight for the block: `finish` waits for it and eviction spares the session."""
        s.pending += 1
        self._idle[s.id].clear()
        try:
            yield
        finally:
            s.pending -= 1
            if s.pending == 0 and s.id in self._idle:
                self._idle[s.id].set()

    def offer(self, session_id: str, task: str) -> None:
        """Queues a session for a remote agent to claim with POST /v1/work (pull mode)."""
        self._work.put_nowait((session_id, task))

    async def claim(self, wait: float) -> tuple[str, str] | None:
        """The next offered (session id, task) whose session is still open, waiting up to `wait` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            try:
                sid, task = self._work.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    sid, task = await asyncio.wait_for(self._work.get(), left)
                except TimeoutError:
                    return None
            s = self.sessions.get(sid)
            if s is not None and not s.closed:  # skip work whose rollout already gave up
                return sid, task

    def _forget(self, session_id: str) -> None:
        del self.sessions[session_id], self._idle[session_id], self._rewarded[session_id]
