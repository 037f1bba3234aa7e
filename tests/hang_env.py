"""A test-only environment whose scoring hangs (blocks the orchestrator's event loop), for the watchdog test."""

from __future__ import annotations

import time

from arbor.environments.reverse_text import ReverseTextEnv


class HangingReverseText(ReverseTextEnv):
    name = "hanging_reverse_text"

    def __init__(self, hang_after: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.hang_after, self.calls = hang_after, 0

    async def score(self, task, completion):
        self.calls += 1
        if self.calls > self.hang_after:
            time.sleep(3600)  # a blocking call in async code: the classic silent hang
        return await super().score(task, completion)


def hanging(**kw) -> HangingReverseText:
    return HangingReverseText(**kw)
