"""The trainer's wait for a step's rollouts, during which it answers the orchestrator's republish requests.

Between steps every rank waits for its rollout file. When the fleet refuses a published version N, the
orchestrator withdraws it and asks for it again (arbor.transport.republish); a trainer waiting for the rollouts of
step S holds the weights of version S, so it publishes them again, as a full update (a delta one could hard-link
the damaged shard back). Publishing is collective, so the ranks first agree: each rank waits until its file
exists or it sees a request it has not answered, then one all-reduce tells every rank whether all files are
there and the newest request any rank saw. A request is answered by rank 0's look at `broadcasts/` (broadcast to
the others, so every rank takes the same branch): published again when no version >= N is there and N <= S,
otherwise it is moot (a newer version the trainer published meanwhile serves the orchestrator as well); either way
every rank remembers it as answered. A rank that has its file waits in the next all-reduce for the others, as it
would wait in the step's first collective. In the common case (no request) the wait costs one small all-reduce.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from arbor.monitor.heartbeat import beat
from arbor.run_dir import latest_published
from arbor.transport.batch import StepBatch
from arbor.transport.files import wait_for_step
from arbor.transport.republish import read_republish_request


class RolloutWait:
    """Every rank's wait for its rollouts of each step, answering republish requests meanwhile (module
    docstring). `republish(version)` is the collective publish of the trainer's weights as `version`."""

    def __init__(
        self,
        output_dir: str | Path,
        data_rank: int,
        timeout: float,
        republish: Callable[[int], object],
        start: int,
        device: torch.device,
    ) -> None:
        self.output_dir, self.data_rank, self.timeout, self.device = output_dir, data_rank, timeout, device
        self.republish = republish
        self.answered = start
        """The newest request version answered; a resume at `start` has just published `start` itself."""
        self.republished = 0
        """Versions published again on request (the `weights/republished` figure)."""

    def batch(self, step: int) -> StepBatch:
        """This rank's batch of `step`, once every rank has its own; TimeoutError naming the file after
        `timeout` seconds."""
        batch: StepBatch | None = None
        t0 = time.monotonic()
        while True:
            if batch is None:
                # None: a request showed before the file
                batch = wait_for_step(
                    self.output_dir, step, self.data_rank, self.timeout, lambda: self._unanswered() > 0, t0
                )
            ready, asked = self._agree(batch is not None, self._unanswered())
            if asked > self.answered:
                self._answer(asked, step)
            if ready:
                assert batch is not None  # every rank, this one included, has its file
                return batch

    def _unanswered(self) -> int:
        """The version of a pending request not yet answered, or 0."""
        request = read_republish_request(self.output_dir)
        return request.version if request is not None and request.version > self.answered else 0

    def _agree(self, have: bool, asked: int) -> tuple[bool, int]:
        """(every rank has its file, the newest unanswered request any rank saw): one all-reduce."""
        if _world() == 1:
            return have, asked
        flags = torch.tensor([0 if have else 1, asked], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags[0].item() == 0, int(flags[1].item())

    def _answer(self, asked: int, step: int) -> None:
        """Publishes the weights held now again, as version `step`, unless the request for `asked` is moot; rank 0
        decides for every rank. Collective."""
        go = [self._decide(asked, step) if _world() == 1 or dist.get_rank() == 0 else False]
        if _world() > 1:
            dist.broadcast_object_list(go, src=0)
        self.answered = asked
        if go[0]:
            beat(f"publishing weights version {step} again (the fleet refused version {asked})")
            self.republish(step)
            self.republished += 1
            beat(f"waiting for rollouts step {step}")

    def _decide(self, asked: int, step: int) -> bool:
        """Rank 0: whether the request for `asked` needs a publish (none >= it is published, and the weights held,
        version `step`, are not older); says which in one line."""
        newest = latest_published(self.output_dir)
        if newest is not None and newest >= asked:
            say(f"republish request for version {asked} is moot: version {newest} is published")
            return False
        if asked > step:  # not this attempt's (a trainer started alone on an old run directory)
            say(f"republish request for version {asked} is moot: this trainer holds version {step}")
            return False
        request = read_republish_request(self.output_dir)
        reason = request.reason if request is not None and request.version == asked else "no reason given"
        say(f"the fleet refused weights version {asked} ({reason}); publishing version {step} again")
        return True


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def say(message: str) -> None:
    print(f"[trainer] {message}", file=sys.stderr, flush=True)
