"""arbor.loopwatch: blocking code on the event loop is named while it blocks, once per place, and every stall
is counted; a loop that only awaits is never reported."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from arbor.loopwatch import LoopWatch


async def blocking_score() -> float:
    time.sleep(0.8)  # the mistake: a blocking call inside a coroutine
    return 1.0


@pytest.mark.slow
def test_blocking_code_is_named_once_per_place_and_every_stall_counts(caplog) -> None:
    async def scenario() -> tuple[float, float]:
        async with LoopWatch(threshold=0.3) as watch:
            await asyncio.sleep(0.3)
            for _ in range(2):
                await blocking_score()
                await asyncio.sleep(0.3)  # the stamp after a stall
            first = watch.take()
            await asyncio.sleep(0.5)
            return first, watch.take()

    with caplog.at_level(logging.WARNING, logger="arbor.loopwatch"):
        blocked, after = asyncio.run(scenario())
    named = [r.getMessage() for r in caplog.records if "has been blocked" in r.getMessage()]
    assert len(named) == 1, named  # the same place twice: logged once
    assert "blocking_score (" in named[0] and "test_loopwatch.py" in named[0] and "`time.sleep(0.8)" in named[0]
    assert 1.4 < blocked < 2.0 and after == 0.0
    assert sum("ran again after" in r.getMessage() for r in caplog.records) == 1  # the stall that was named


def test_a_loop_that_awaits_is_never_reported(caplog) -> None:
    async def scenario() -> float:
        async with LoopWatch(threshold=0.3) as watch:
            await asyncio.gather(*(asyncio.sleep(0.2 * i) for i in range(6)))
            await asyncio.to_thread(time.sleep, 0.8)  # blocking work the right way: in a thread
            return watch.take()

    with caplog.at_level(logging.WARNING, logger="arbor.loopwatch"):
        assert asyncio.run(scenario()) == 0.0
    assert not caplog.records
