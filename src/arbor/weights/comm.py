"""The weight-update group: one long-lived communicator per run between trainer rank 0 and every receiver.

`WeightComm` is the small interface the update code uses (broadcast a bucket from rank 0, barrier, close), each
call bounded by the transport's timeout. `TorchComm` implements it with a standalone torch ProcessGroup built
straight on a store (no default process group needed, so it coexists with the trainer's FSDP world and with a
vLLM worker's own): NCCL on GPU, gloo on CPU. The gloo twin runs the very same publish/receive/rejoin code in CI.

Rejoining: trainer rank 0 hosts a TCPStore at (`weights.nccl_host`, `weights.nccl_port`) for the whole run. At
every update (version v) each receiver writes `v{v}/rank{r}` = its incarnation (random per process) and waits
for `v{v}/gen`. The trainer waits until every receiver has checked in; if the set of incarnations is the one its
communicator was built with, it answers with the same generation and every side reuses its communicator. If a
receiver restarted (a new incarnation), the trainer answers with a new generation and every side builds a fresh
communicator under the store prefix `gen/{generation}/`, so a restarted replica rejoins at the next update and
blocks nobody (asked to catch up on an update already sent, it is told at once to wait for the next one). A
receiver that never checks in fails the update within the timeout, naming it, on the trainer and (through an
`error:` answer) on every receiver that did arrive.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from arbor.weights.buckets import TensorSpec, flat_size, flatten, unflatten

T = TypeVar("T")
ERROR = "error:"


class WeightTransferError(RuntimeError):
    """A step directory that cannot be loaded (incomplete, corrupted, or of the wrong kind)."""


class WeightTransferTimeout(WeightTransferError, TimeoutError):
    """A publish or load that did not finish within the configured timeout."""


def deadline_call(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Runs `fn` in a daemon thread; raises WeightTransferTimeout if it is not done in `timeout` seconds.

    A collective that never completes cannot be cancelled from Python, but the caller learns of it and fails
    (the process then exits, which tears the communicator down) instead of waiting forever.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"arbor-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise WeightTransferTimeout(f"{what} did not finish within {timeout:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class WeightComm(ABC):
    """Rank 0 (trainer) and ranks 1.. (receivers) of one weight-update group generation."""

    rank: int
    world: int

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, what: str) -> None:
        """Rank 0's `buf` into every other rank's `buf` (same size), or WeightTransferTimeout naming `what`."""

    @abstractmethod
    def barrier(self, what: str) -> None:
        """Returns once every rank reached it, or raises WeightTransferTimeout naming `what`."""

    def close(self) -> None:
        """Releases the communicator (a new generation replaces it)."""


class TorchComm(WeightComm):
    """A torch ProcessGroup (`backend` "nccl" or "gloo") built on `store`, outside any default process group."""

    def __init__(self, backend: str, store: Any, rank: int, world: int, timeout: float, device: torch.device) -> None:
        self.rank, self.world, self.timeout, self.device = rank, world, timeout, device
        td = datetime.timedelta(seconds=timeout)
        if backend == "gloo":
            self.pg: Any = dist.ProcessGroupGloo(store, rank, world, td)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            raise ValueError(f"unknown weight-update backend {backend!r} (nccl or gloo)")

    def _wait(self, work: Any, what: str) -> None:
        def done() -> None:
            work.wait(datetime.timedelta(seconds=self.timeout))
            if self.device.type == "cuda":  # NCCL's wait only orders the stream: wait for the transfer itself
                torch.cuda.current_stream(self.device).synchronize()

        deadline_call(done, self.timeout, what)

    def broadcast(self, buf: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.pg.broadcast([buf], opts), what)

    def barrier(self, what: str) -> None:
        if self.device.type == "cuda":  # a one-byte all-reduce: NCCL's barrier guesses the device
            self._wait(self.pg.allreduce([torch.zeros(1, device=self.device)]), what)
        else:
            self._wait(self.pg.barrier(), what)

    def close(self) -> None:
        self.pg = None


def _store(host: str, port: int, master: bool, timeout: float) -> Any:
    return dist.TCPStore(
        host, port, is_master=master, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )


class SenderGroup:
    """Trainer rank 0's side: hosts the rendezvous store and keeps one communicator until the receivers change."""

    def __init__(
        self, host: str, port: int, receivers: int, backend: str, timeout: float, device: torch.device
    ) -> None:
        self.host, self.port, self.receivers = host, port, receivers
        self.backend, self.timeout, self.device = backend, timeout, device
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted trainer's generations never match the old ones
        self.generation, self.generations_formed = "", 0
        self.store: Any = None
        self.comm: WeightComm | None = None
        self._members: list[str] | None = None
        self._old_keys: list[str] = []

    def begin(self, version: int) -> WeightComm:
        """Waits for every receiver to check in for `version`; returns the communicator to send it over."""
        if self.store is None:
            self.store = _store(self.host, self.port, True, self.timeout)
        for key in self._old_keys:  # the previous update's rendezvous keys
            self.store.delete_key(key)
        keys = [f"v{version}/rank{r}" for r in range(1, self.receivers + 1)]
        gen_key = f"v{version}/gen"
        self._old_keys = [*keys, gen_key, f"v{version}/done"]
        deadline = time.monotonic() + self.timeout
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys, 1) if not self.store.check([k])]
                message = (
                    f"weight update {version}: receiver rank(s) {missing} of {self.receivers} did not join "
                    f"the weight group at {self.host}:{self.port} within {self.timeout:.0f}s"
                )
                self.store.set(gen_key, f"{ERROR}{message}")
                raise WeightTransferTimeout(message)
            time.sleep(0.01)
        members = [self.store.get(k).decode() for k in keys]
        if self.comm is None or members != self._members:
            if self.comm is not None:
                self.comm.close()
            self.generations_formed += 1
            self.generation = f"{self.incarnation}.{self.generations_formed}"
            self.store.set(gen_key, self.generation)
            prefixed = dist.PrefixStore(f"gen/{self.generation}/", self.store)
            self.comm = deadline_call(
                lambda: TorchComm(self.backend, prefixed, 0, self.receivers + 1, self.timeout, self.device),
                self.timeout,
                f"forming weight group {self.generation} for update {version}",
            )
            self._members = members
        else:
            self.store.set(gen_key, self.generation)
        return self.comm

    def finish(self, version: int) -> None:
        """Marks `version` as sent: a receiver arriving for it late (a replica restarted after the rendezvous)
        is told so at once instead of waiting for a group that will not form."""
        self.store.set(f"v{version}/done", "1")


ANSWER_GRACE = 10.0
"""Seconds a receiver waits for the trainer's answer beyond the shared timeout: the trainer decides whether a
group forms (its clock starts as it publishes, about when the receivers check in) and, past its timeout, answers
which rank did not join; the grace lets that answer, not a bare timeout of the receiver's own, reach every
receiver that did (under load the two clocks used to tie)."""


class ReceiverGroup:
    """A receiver's side (a vLLM worker, a test process): rank `rank` of `world`, rejoining when told to."""

    def __init__(
        self, host: str, port: int, rank: int, world: int, backend: str, timeout: float, device: torch.device
    ) -> None:
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.backend, self.timeout, self.device = backend, timeout, device
        self.incarnation = uuid.uuid4().hex[:12]
        self.generation: str | None = None
        self.comm: WeightComm | None = None

    def join(self, version: int) -> WeightComm:
        """Checks in for `version`; returns the communicator of the generation the trainer answers with."""
        where = f"the weight group at {self.host}:{self.port}"
        wait = self.timeout + ANSWER_GRACE
        try:  # a fresh client per update: a restarted trainer serves a new store
            store = _store(self.host, self.port, False, wait)
            store.set(f"v{version}/rank{self.rank}", self.incarnation)
            generation = store.get(f"v{version}/gen").decode()
            late = store.check([f"v{version}/done"])
        except dist.DistStoreError as e:
            raise WeightTransferTimeout(
                f"weight update {version}: rank {self.rank} got no answer from {where} within {wait:.0f}s ({e})"
            ) from None
        if generation.startswith(ERROR):
            raise WeightTransferError(generation.removeprefix(ERROR))
        if late:
            raise WeightTransferError(
                f"weight update {version} was sent before rank {self.rank} checked in (it "
                "restarted since): it rejoins at the next update"
            )
        if generation != self.generation:
            if self.comm is not None:
                self.comm.close()
            self.comm = None
            prefixed = dist.PrefixStore(f"gen/{generation}/", store)
            self.comm = deadline_call(
                lambda: TorchComm(self.backend, prefixed, self.rank, self.world, self.timeout, self.device),
                self.timeout,
                f"joining weight group {generation} as rank {self.rank}/{self.world}",
            )
            self.generation = generation
        assert self.comm is not None
        return self.comm


def send_buckets(comm: WeightComm, buckets: Iterable[Sequence[torch.Tensor]], device: torch.device) -> int:
    """Broadcasts each bucket as one flat buffer on `device`; returns the bytes sent."""
    sent = 0
    for i, tensors in enumerate(buckets):
        buf = flatten(tensors, device)
        comm.broadcast(buf, f"broadcasting weight bucket {i}")
        sent += buf.numel()
    return sent


def receive_buckets(
    comm: WeightComm, buckets: Sequence[Sequence[TensorSpec]], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: yields (name, tensor) bucket by bucket as rank 0's broadcasts land, then meets rank 0 at
    the closing barrier (so the trainer knows every receiver got the whole update)."""
    for i, specs in enumerate(buckets):
        buf = torch.empty(flat_size(specs), dtype=torch.uint8, device=device)
        comm.broadcast(buf, f"receiving weight bucket {i}")
        yield from unflatten(buf, specs)
    comm.barrier("the end of the weight update")
