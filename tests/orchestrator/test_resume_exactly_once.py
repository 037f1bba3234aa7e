"""Exactly-once across a crash, on the orchestrator's real parts (task source, assembler, experience buffer,
step writer) with a simulated fleet and trainer: a run killed at any point of a step and resumed from a trainer
checkpoint trains, step by step, the same tasks as an uninterrupted run, each once, with the buffer on or off."""

from __future__ import annotations

import asyncio
import collections
import types
from pathlib import Path

import pytest
from orch_fakes import FakeEnv, FakeTokenizer, make_cfg

from arbor.orchestrator.assembler import StepAssembler, open_buffer
from arbor.orchestrator.counts import Counts
from arbor.orchestrator.group import GroupSpec
from arbor.orchestrator.main import slice_config
from arbor.orchestrator.rollout import Rollout
from arbor.orchestrator.state import OrchestratorState, load_state
from arbor.orchestrator.step_writer import StepWriter
from arbor.orchestrator.tasks import TaskSource
from arbor.run_dir import DONE, checkpoint_dir

STEPS = 8
TASKS = 40  # more than the run launches: a task id names one task instance, so "twice" is visible


class SourcePool:
    """Launches groups from the real task source and finishes them at once, keeping one more group than a step
    takes in flight, so every saved state has a pending task to relaunch."""

    def __init__(self, source: TaskSource) -> None:
        self.source = source
        self.flight: collections.deque[tuple[GroupSpec, int]] = collections.deque()

    def use(self, client) -> None:
        pass

    def admit(self, step: int, kept: int, need: int, version: int, launched: int) -> int:
        n = 0
        while len(self.flight) < need + 1:
            self.flight.append((self.source.next_spec(step, launched + n), version))
            n += 1
        return n

    def take(self, limit: int) -> list[list[Rollout]]:
        out = []
        while self.flight and len(out) < limit:
            spec, version = self.flight.popleft()
            out.append(
                [
                    Rollout(
                        spec.task["id"],
                        spec.prompt_ids,
                        [65, 66],
                        [-0.1, -0.2],
                        [version, version],
                        "ab",
                        "stop",
                        reward=r,
                        group_id=spec.group_id,
                    )
                    for r in (1.0, 0.0)
                ]
            )
        return out

    async def wait(self, step: int, kept: int, need: int, version: int) -> None:
        raise RuntimeError("the pool always has groups ready")

    async def end_step(self) -> None:
        pass


class Attempt:
    """One orchestrator process: the parts `Orchestrator` composes, in its step order (main.py)."""

    def __init__(self, out: Path, buffer: bool, start: int, resume: bool) -> None:
        cfg = make_cfg(output_dir=str(out), resume=resume, buffer={"enabled": buffer})
        parts = slice_config(cfg)
        state = load_state(out, start) if start else OrchestratorState()
        self.source = TaskSource(parts.tasks, FakeEnv([4] * TASKS), FakeTokenizer(), state)
        self.assembler = StepAssembler(parts.assembler, SourcePool(self.source), self.source, Counts())
        self.writer = StepWriter(parts.writer, 0)
        self.buffer = open_buffer(cfg.buffer, cfg.output_dir, start, cfg.resume)

    def step(self, step: int, crash_after: str | None = None) -> list[int] | None:
        """The task ids of the step's batch (one per group), or None when the crash comes after `crash_after`."""
        fleet = types.SimpleNamespace(loaded_version=step, changed=asyncio.Event())
        groups = asyncio.run(self.assembler.collect(step, "client", fleet))
        if crash_after == "collect":
            return None
        if self.buffer is not None:
            groups = self.assembler.through_buffer(step, groups, self.buffer)
        if crash_after == "buffer":
            return None
        self.writer.save_state(step, self.source)
        if crash_after == "state":
            return None
        return [g[0].task_id for g in groups]  # the batch: what the trainer trains at this step

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()


def _checkpoint(out: Path, step: int) -> None:
    (checkpoint_dir(out, step) / DONE).parent.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir(out, step) / DONE).touch()


def _uninterrupted(out: Path, buffer: bool) -> list[list[int]]:
    attempt = Attempt(out, buffer, 0, resume=False)
    trained = [attempt.step(s) for s in range(STEPS)]
    attempt.close()
    return trained


@pytest.mark.parametrize("buffer", [False, True], ids=["no_buffer", "buffer"])
@pytest.mark.parametrize("crash_step, checkpoint", [(5, 4), (5, 2), (2, 0)])
@pytest.mark.parametrize("crash_after", ["collect", "buffer", "state", None])
def test_a_crash_anywhere_trains_every_task_once(
    tmp_path: Path, buffer: bool, crash_step: int, checkpoint: int, crash_after: str | None
) -> None:
    reference = _uninterrupted(tmp_path / "reference", buffer)
    out = tmp_path / "run"
    first = Attempt(out, buffer, 0, resume=False)
    trained = [first.step(s) for s in range(crash_step)]
    if checkpoint:
        _checkpoint(out, checkpoint)  # the trainer's newest complete checkpoint: steps before it are trained
    first.step(crash_step, crash_after)  # the kill: this step's work, and the lost steps', go with it
    first.close()
    resumed = Attempt(out, buffer, checkpoint, resume=True)
    trained = trained[:checkpoint] + [resumed.step(s) for s in range(checkpoint, STEPS)]
    resumed.close()
    assert trained == reference
    flat = [t for batch in trained for t in batch]
    assert len(flat) == len(set(flat)) == STEPS * 2  # no task trained twice, none skipped
