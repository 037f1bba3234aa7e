"""The scheduler on scripted completion orders: window bounds, head advance, blocking outside the window, and
the mapping of `[orchestrator.scheduler]` modes to lag and producer style."""

from __future__ import annotations

import pytest

from arbor.config.orchestrator import OrchestratorConfig
from arbor.orchestrator.main import slice_config
from arbor.orchestrator.modes.async_fifo import AsyncMode
from arbor.orchestrator.modes.sync import SyncMode
from arbor.orchestrator.scheduler import RolloutQueue, SchedulingMode, build_mode, staleness_histogram


def _mode(cfg: OrchestratorConfig) -> SchedulingMode:
    return build_mode(slice_config(cfg).mode)


def _queue(window, n):
    q = RolloutQueue(window)
    assert [q.launch() for _ in range(n)] == list(range(n))
    return q


def test_windowed_fifo_takes_inside_window_blocks_outside_and_advances_head():
    q = _queue(3, 8)  # window [H, H+3)
    q.finish(5, "e")  # outside [0, 3): invisible
    q.finish(2, "c")  # inside: taken at once although 0 and 1 are still running
    assert q.take() == [(2, "c")]
    assert q.head == 0  # the head did not move: position 0 is not consumed
    assert q.take() == []  # 5 is finished but blocked outside the window
    q.finish(1, "b")
    assert q.take() == [(1, "b")] and q.head == 0
    q.finish(0, "a")
    # Taking 0 advances H past the consumed 1 and 2 to 3: the window becomes [3, 6) and 5 becomes visible.
    assert q.take() == [(0, "a"), (5, "e")]
    assert q.head == 3 and q.in_flight == 4  # 3, 4, 6, 7 launched; 5 consumed above the head
    q.finish(7, "h")
    assert q.take() == []  # 7 is outside [3, 6)
    q.finish(3, "d")
    q.finish(4, "d2")
    assert q.take(limit=1) == [(3, "d")]  # limit respected, lowest position first
    assert q.take() == [(4, "d2"), (7, "h")]  # H 4 -> 6 (5 consumed): window [6, 9) shows 7
    assert q.head == 6 and q.in_flight == 1


def test_strict_fifo_and_greedy():
    fifo = _queue(1, 3)
    fifo.finish(2, "c")
    fifo.finish(1, "b")
    assert fifo.take() == []  # the head (0) is a straggler: everything waits
    fifo.finish(0, "a")
    assert fifo.take() == [(0, "a"), (1, "b"), (2, "c")]
    greedy = _queue(None, 100)
    greedy.finish(99, "z")
    assert greedy.take() == [(99, "z")] and greedy.head == 0  # first finished, first out, however far back
    greedy.discard(0)  # a failed launch is consumed without an item: the head moves on
    assert greedy.head == 1 and greedy.in_flight == 98


def test_queue_rejects_bad_positions():
    q = _queue(2, 2)
    with pytest.raises(ValueError, match="not in flight"):
        q.finish(5, "x")
    q.finish(0, "a")
    q.take()
    with pytest.raises(ValueError, match="not in flight"):
        q.finish(0, "again")
    with pytest.raises(ValueError, match="window"):
        RolloutQueue(0)


def test_policies_from_config():
    base = dict(batch_size=16, group_size=4, max_off_policy_steps=3)
    default = _mode(OrchestratorConfig(**base))
    assert (type(default).__name__, default.continuous, default.lag(7)) == ("OneStepOffMode", False, 1)
    sync = _mode(OrchestratorConfig(**base, scheduler={"mode": "sync", "sync_interval": 3}))
    assert [sync.lag(s) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.warns(DeprecationWarning, match="async_lag is deprecated"):  # the retired key keeps its meaning
        assert isinstance(_mode(OrchestratorConfig(**base, async_lag=0)), SyncMode)
        lagged = _mode(OrchestratorConfig(**base, async_lag=2))
    assert (isinstance(lagged, AsyncMode), lagged.continuous, lagged.window, lagged.lag(5)) == (True, True, 1, 2)
    explicit = _mode(OrchestratorConfig(**base, scheduler={"mode": "windowed_fifo", "lag": 1}))
    assert (explicit.slack, explicit.lag(5)) == (1, 1)  # an explicit lag is taken as given
    w = _mode(OrchestratorConfig(**base, scheduler={"mode": "windowed_fifo"}))
    # W = 2 of 4 groups per step: a group can be overtaken into the next step, so one step of the bound is kept free
    assert (w.continuous, w.window, w.max_in_flight, w.lag(5), w.slack) == (True, 2, 8, 2, 1)
    wide = _mode(OrchestratorConfig(**base, scheduler={"mode": "windowed_fifo", "window": 9}))
    assert (wide.slack, wide.lag(5)) == (3, 0)  # ceil(9 / 4) = 3 steps, never more than the bound itself
    g = _mode(OrchestratorConfig(**base, scheduler={"mode": "greedy", "max_in_flight": 5}))
    assert (g.window, g.max_in_flight) == (None, 5)
    a = _mode(OrchestratorConfig(**base, scheduler={"mode": "async"}))
    assert (a.window, a.slack, a.lag(5)) == (1, 0, 3)
    assert staleness_histogram([0, 1, 1, 2]) == {"staleness/hist_0": 1, "staleness/hist_1": 2, "staleness/hist_2": 1}
