"""Several runs on one fleet: the router's registry of runs, their scoped admin tokens, fair sharing of the
fleet's sequence slots between them, and what each run used.

A run registers (`POST /runs/register {"run", "weight"}`, fleet admin rights) and gets a token of its own. With
it, and only for itself, it may load and unload the adapter named after it (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`), abort its own requests, pause and resume its own queue, and unregister; a fleet-wide
call (`/update_weights`, another run's adapter or requests) is a 403. A request belongs to the run named by its
`X-Arbor-Run` header, else by its `model` (the run's adapter); anything else is the fleet's own (run "").

Fair sharing (`FairShare`): with `backend_slots` set, the router lets at most `backend_slots` x (backends in
rotation) sequences be in flight (a completion with `n` choices takes `n` slots). Beyond that, requests wait in
one queue per run and are let through by deficit round robin: each round a run earns `weight` x its quantum of
slots and spends them on its queue's head, so saturated runs get the fleet in proportion to their weights and a
run that asks for less than its share never waits behind one that asks for more.

Use (`Meter`): for each run, requests, prompt and completion tokens (the `usage` of each answer) and
slot-seconds (sequences in flight integrated over time); the fleet's utilisation is its slot-seconds over
slots x seconds, a run's its own slot-seconds over the same denominator since it registered.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from arbor.transport.http import BadRequest, HTTPError

QUANTUM = 1
"""Slots a run of weight 1 earns per round of the deficit round robin."""


@dataclass
class Run:
    """One registered run (or the fleet's own requests, run "")."""

    name: str
    weight: float = 1.0
    token: str = ""
    registered: float = field(default_factory=time.monotonic)
    paused: bool = False
    queue: deque = field(default_factory=deque)
    """Waiting requests: (slots, future) pairs."""
    deficit: float = 0.0
    in_flight: int = 0
    """Slots its requests hold now."""
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    slot_seconds: float = 0.0
    choices: dict[str, int] = field(default_factory=lambda: {"adapter": 0, "base": 0, "foreign": 0})
    """Its answers' choices by what generated them, as the backends name it: its own adapter, the base model
    (before its first adapter load), another adapter (never, unless a backend mixes adapters up)."""
    request_ids: set[str] = field(default_factory=set)
    """Ids of its requests in flight (an abort of "all" by the run means these)."""


class Tenants:
    """The registry: runs by name and by token; the fleet's own requests are run ""."""

    def __init__(self) -> None:
        self.runs: dict[str, Run] = {"": Run("")}

    def register(self, body: dict[str, Any]) -> Run:
        name = body.get("run")
        weight = body.get("weight", 1.0)
        if (
            not isinstance(name, str)
            or not name
            or len(name) > 255
            or not name.replace("-", "").replace("_", "").replace(".", "").isalnum()
        ):
            raise BadRequest("run (a name of letters, digits, '-', '_' and '.') is required", "run")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
            raise BadRequest("weight must be a number in (0, 1e6]", "weight")
        if name in self.runs:
            raise HTTPError(409, f"run {name!r} is already registered on this fleet", "run")
        run = Run(name, float(weight), secrets.token_urlsafe(32))
        self.runs[name] = run
        return run

    def unregister(self, name: str) -> Run:
        run = self.runs.pop(name, None) if name else None
        if run is None:
            raise HTTPError(404, f"run {name!r} is not registered", "run")
        for _, fut in run.queue:  # its waiting requests: their clients are going away with the run
            if not fut.done():
                fut.set_exception(HTTPError(503, f"run {name!r} was unregistered", None, "unavailable"))
        return run

    def by_token(self, sent: str) -> Run | None:
        """The run whose token `sent` is (compared in constant time against each)."""
        found = None
        for run in self.runs.values():
            if run.token and hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), run.token.encode()):
                found = run
        return found

    def owner(self, run_header: str | None, model: Any) -> Run:
        """The run a generation request belongs to."""
        for key in (run_header, model):
            if isinstance(key, str) and key in self.runs:
                return self.runs[key]
        return self.runs[""]


def sent_token(headers: Any) -> str:
    given = headers.get("Authorization", "")
    return given[7:] if given[:7].lower() == "bearer " else ""


def fleet_token_ok(headers: Any, token: SecretStr | None) -> bool:
    """Whether a request has the fleet's own rights: its token, or any caller when the fleet has none."""
    if token is None:
        return True
    return hmac.compare_digest(
        sent_token(headers).encode("utf-8", "surrogateescape"), token.get_secret_value().encode()
    )


class Meter:
    """Integrates the slots in flight, per run and fleet-wide, over time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = self._last = clock()
        self.slot_seconds = 0.0
        self.completion_tokens = 0

    def tick(self, runs: dict[str, Run]) -> None:
        now = self.clock()
        dt, self._last = now - self._last, now
        for run in runs.values():
            run.slot_seconds += run.in_flight * dt
            self.slot_seconds += run.in_flight * dt

    def used(self, run: Run, answer: Any) -> None:
        """Counts one answer (its `usage` and whose adapter generated each choice) against its run."""
        if not isinstance(answer, dict):
            return
        for choice in answer.get("choices") or []:
            adapter = choice.get("adapter") if isinstance(choice, dict) else None
            run.choices["base" if adapter is None else "adapter" if adapter == run.name else "foreign"] += 1
        usage = answer.get("usage")
        if not isinstance(usage, dict):
            return
        for key in ("prompt_tokens", "completion_tokens"):
            value = usage.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                setattr(run, key, getattr(run, key) + value)
                if key == "completion_tokens":
                    self.completion_tokens += value


class FairShare:
    """Admits requests while slots are free; beyond that, per-run queues served by weighted deficit round robin."""

    def __init__(self, tenants: Tenants, meter: Meter, capacity: Callable[[], int | None]) -> None:
        self.tenants, self.meter, self.capacity = tenants, meter, capacity
        self.in_flight = 0
        self.queued_total = 0
        """Requests that ever had to wait for a slot (a /metrics counter)."""
        self._order: deque[str] = deque()
        """Runs with waiting requests, in round-robin order; the head has the turn."""
        self._earned = False
        """Whether the head has earned its quantum this turn."""

    def _fits(self, slots: int) -> bool:
        cap = self.capacity()
        # A request larger than the whole fleet still goes, alone, rather than waiting forever.
        return cap is None or self.in_flight + slots <= cap or self.in_flight == 0

    async def acquire(self, run: Run, slots: int) -> None:
        """Waits for `slots` slots for one of `run`'s requests (at once when free and nobody waits)."""
        waiting = any(r.queue and not r.paused for r in self.tenants.runs.values())
        if not run.paused and not waiting and self._fits(slots):
            self._take(run, slots)
            return
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        run.queue.append((slots, fut))
        self.queued_total += 1
        if run.name not in self._order:
            self._order.append(run.name)
        self.dispatch()
        try:
            await fut
        except asyncio.CancelledError:  # the client went away while waiting: give back a slot granted meanwhile
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(run, slots)
            elif (slots, fut) in run.queue:
                run.queue.remove((slots, fut))
            raise

    def _take(self, run: Run, slots: int) -> None:
        self.meter.tick(self.tenants.runs)
        run.in_flight += slots
        self.in_flight += slots

    def release(self, run: Run, slots: int) -> None:
        self.meter.tick(self.tenants.runs)
        run.in_flight -= slots
        self.in_flight -= slots
        self.dispatch()

    def dispatch(self) -> None:
        """Lets waiting requests through, by weighted deficit round robin, while their slots fit: the run at the
        head of the rotation earns `weight` x QUANTUM once per turn and spends it on its queue's head requests."""
        passed = 0  # paused runs passed over in a row: a whole round of them ends the dispatch
        while self._order and passed <= len(self._order):
            run = self.tenants.runs.get(self._order[0])
            if run is None or not run.queue:
                self._order.popleft()
                self._earned = False
                if run is not None:
                    run.deficit = 0.0  # an idle run does not bank credit
                continue
            slots, fut = run.queue[0]
            if fut.done():  # its client went away while it waited
                run.queue.popleft()
                continue
            if run.paused:
                self._next_turn()
                passed += 1
                continue
            passed = 0
            if run.deficit >= slots:
                if not self._fits(slots):
                    return
                run.queue.popleft()
                run.deficit -= slots
                self._take(run, slots)
                fut.set_result(None)
            elif self._earned:
                self._next_turn()
            else:
                run.deficit += QUANTUM * run.weight
                self._earned = True

    def _next_turn(self) -> None:
        self._order.rotate(-1)
        self._earned = False


def metric_lines(prefix: str, tenants: Tenants, meter: Meter, slots: int | None) -> list[str]:
    """The fleet's use and each run's, as Prometheus lines: tokens, tokens/s and utilisation (slot-seconds over
    slots x seconds; only with `backend_slots` set) since the fleet started or the run registered."""
    meter.tick(tenants.runs)
    now = meter.clock()
    uptime = max(now - meter.started, 1e-9)
    lines = [
        f"{prefix}uptime_s {uptime:.3f}",
        f"{prefix}completion_tokens {meter.completion_tokens}",
        f"{prefix}slot_seconds {meter.slot_seconds:.3f}",
        f"{prefix}runs {len(tenants.runs) - 1}",
    ]
    if slots:
        lines += [f"{prefix}slots {slots}", f"{prefix}utilisation {meter.slot_seconds / (slots * uptime):.6f}"]
    for run in tenants.runs.values():
        age = max(now - (meter.started if not run.name else run.registered), 1e-9)
        label = f'{{run="{run.name}"}}'
        figures = {
            "requests": run.requests,
            "prompt_tokens": run.prompt_tokens,
            "completion_tokens": run.completion_tokens,
            "tokens_per_s": f"{run.completion_tokens / age:.3f}",
            "slot_seconds": f"{run.slot_seconds:.3f}",
            "in_flight": run.in_flight,
            "queued": len(run.queue),
            "weight": run.weight,
            "seconds": f"{age:.3f}",
            **{f"{kind}_choices": count for kind, count in run.choices.items()},
        }
        if slots:
            figures["utilisation"] = f"{run.slot_seconds / (slots * age):.6f}"
        lines += [f"{prefix}run_{key}{label} {value}" for key, value in figures.items()]
    return lines
