"""The orchestrator's half of a colocated run (`inference.colocate`, arbor.colocate): it decides when the device
changes hands. Before a step whose policy the fleet does not serve yet, each untrained step K in turn: the fleet
sleeps (`/sleep`: KV cache and weights released), `colocate/train_K` hands the device to the trainer, whose
`colocate/generated_K` hands it back once step K is trained, published and offloaded; the fleet wakes
(`/wake_up`) and the weight watcher, held meanwhile, loads the new version into it. Every wait is bounded
(`weight_update_timeout`) and ends in one line naming the file that never came.

Each hand-over's figures (the trainer's, from its turn file, and the engine's, from its sleep and wake answers) are
the step's `colocate/*` metrics and a line of `colocate/turns.jsonl`: what each side held in each phase, so that
the colocated peak is measured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from arbor.colocate import generate_turn, hand_over, train_turn, turns_log, wait_turn_async
from arbor.monitor.heartbeat import beat
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.weight_sync import WeightSync

log = logging.getLogger("arbor.orchestrator.colocated")


def _summed(answers: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """The numeric fields of the servers' answers, summed over servers, as `colocate/<prefix><field>`."""
    out: dict[str, float] = {}
    for answer in answers:
        for key, value in answer.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "sleeping":
                out[f"colocate/{prefix}{key}"] = out.get(f"colocate/{prefix}{key}", 0.0) + float(value)
    return out


class ColocatedFleet:
    """Takes turns with the trainer on the fleet's devices; `trained`: the steps the trainer has trained."""

    def __init__(
        self, client: InferenceClient, weights: WeightSync, output_dir: str | Path, timeout: float, trained: int
    ) -> None:
        self.client, self.weights, self.output_dir, self.timeout = client, weights, Path(output_dir), timeout
        self.trained = trained
        self.awake = asyncio.Event()
        self.awake.set()
        weights.awake = self.awake
        self.figures: dict[str, float] = {}
        """The hand-overs' figures since the last `take_figures`."""

    async def train_until(self, version: int) -> None:
        """Hands the device to the trainer until it has trained the steps policy `version` needs."""
        while self.trained < version:
            await self._train_turn(self.trained)
            self.trained += 1

    async def _train_turn(self, step: int) -> None:
        t0 = time.perf_counter()
        self.awake.clear()
        beat(f"colocated: putting the fleet to sleep for step {step}'s training")
        asleep = await self.client.sleep()
        hand_over(train_turn(self.output_dir, step))
        beat(f"colocated: waiting for the trainer to train step {step} and hand the device back")
        trainer = await wait_turn_async(generate_turn(self.output_dir, step), self.timeout, "the trainer")
        t1 = time.perf_counter()
        awake = await self.client.wake_up()
        self.awake.set()  # the weight watcher loads the version the trainer just published into the woken fleet
        self.figures = {
            **_summed(asleep, "engine_"),
            **_summed(awake, "engine_"),
            **{f"colocate/trainer_{k}": float(v) for k, v in trainer.items() if k != "time"},
            "colocate/train_phase_s": t1 - t0,
            "colocate/wake_s": time.perf_counter() - t1,
        }
        with open(turns_log(self.output_dir), "a") as f:
            f.write(json.dumps({"step": step, **self.figures}) + "\n")
        log.info("colocated: step %d trained in %.2fs; the fleet is awake again", step, t1 - t0)

    def take_figures(self) -> dict[str, float]:
        figures, self.figures = self.figures, {}
        return figures
