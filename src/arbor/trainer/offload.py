"""The trainer's half of a colocated run (`inference.colocate`, arbor.colocate): between its steps the trainer
holds none of the device, so the inference engine generates with the whole of it.

`offload` frees the gradients and moves the parameters (every module it is given: the policy and the KL
reference) and the optimizer state to host memory; `onload` brings the parameters back before the next step. The
optimizer state stays on the host for good: the step brings one parameter's state at a time to the device
(arbor.trainer.optim.step_with_host_state), so the train phase holds parameters, gradients and activations only,
8 bytes per parameter rather than 16 (what lets `rl plan` fit Qwen3-8B on one 80 GB GPU colocated). On a CPU
trainer host and device are one memory: the moves are no-ops and the freed gradients are the release (the
engine's sleep is the larger one there). `figures` measures what each phase held: the bytes of parameters,
gradients and optimizer state on the device, the CUDA allocator's peak, and this process's resident memory
(arbor.colocate.host_memory), so that a colocated run's memory is measured rather than assumed.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from arbor.colocate import (
    generate_turn,
    hand_over,
    host_memory,
    ready_path,
    reset_peak,
    return_freed_memory,
    train_turn,
    wait_turn,
)
from arbor.monitor.heartbeat import beat


def _tensor_bytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard is what this rank holds
    return local.numel() * local.element_size()


class Offloader:
    """Moves `modules` and `optimizer`'s state between `device` and the host (see the module docstring)."""

    def __init__(self, modules: list[nn.Module], optimizer, device: torch.device) -> None:
        self.modules, self.optimizer, self.device = modules, optimizer, device
        self.host = torch.device("cpu")
        self.on_device = True
        if hasattr(optimizer, "state_on_host"):
            optimizer.state_on_host = True

    def _states(self) -> list[dict]:
        optimizers = getattr(self.optimizer, "optimizers", [self.optimizer])
        return [state for o in optimizers for state in o.state.values()]

    def _move(self, to: torch.device) -> None:
        for module in self.modules:
            module.to(to)
        for state in self._states():
            for key, value in state.items():
                # Adam's `step` counters stay where the optimizer keeps them (on the host unless fused/capturable)
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    state[key] = value.to(to, non_blocking=False)
        if to.type == "cpu" and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the allocator's cache is the engine's to use now

    def offload(self) -> None:
        """Gradients freed, parameters and optimizer state to host memory."""
        for module in self.modules:
            for p in module.parameters():
                p.grad = None
        self._move(self.host)
        return_freed_memory()
        self.on_device = False

    def onload(self) -> None:
        """Parameters back on the device, before a step; the optimizer state stays on the host, where the step
        updates one parameter's at a time (arbor.trainer.optim.step_with_host_state)."""
        for module in self.modules:
            module.to(self.device)
        self.on_device = True

    def device_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state on the compute device now (all of them on a CPU
        trainer, whose device is the host)."""
        on = lambda t: t.device.type == self.device.type  # noqa: E731
        total = 0
        for module in self.modules:
            for p in module.parameters():
                total += _tensor_bytes(p) if on(p) else 0
                total += _tensor_bytes(p.grad) if p.grad is not None and on(p.grad) else 0
        for state in self._states():
            total += sum(_tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and on(v))
        return total

    def grad_bytes(self) -> int:
        """Bytes the gradients take on the device while a step runs (freed at its end, `zero_grad(set_to_none)`)."""
        return sum(_tensor_bytes(p) for m in self.modules for p in m.parameters() if p.requires_grad)

    def figures(self, phase: str, reset: bool = True) -> dict[str, float]:
        """What this phase held, measured at its end (resident memory now and at its peak, tracked device bytes,
        on CUDA the allocator's peak); with `reset`, the peaks restart for the next phase."""
        mem = host_memory()
        out = {f"{phase}_{k}": v for k, v in mem.items()}
        out[f"{phase}_device_bytes"] = float(self.device_bytes())
        if self.device.type == "cuda":
            out[f"{phase}_cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        """Restarts the peaks (resident memory, and the CUDA allocator's) from what is held now."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        reset_peak()


class ColocatedTurns:
    """The trainer's turns: built state offloaded and `ready` written (`start`); before each step the device is
    waited for and the state onloaded (`before_step`); after it, once published and checkpointed, the state is
    offloaded and the device handed back with the phases' figures (`after_step`). Collective: every rank
    offloads before rank 0 hands the device over; every rank waits for the same turn file."""

    def __init__(self, offloader: Offloader, output_dir: str | Path, timeout: float) -> None:
        self.offloader, self.output_dir, self.timeout = offloader, output_dir, timeout
        self.rank = dist.get_rank()
        self._generate: dict[str, float] = {}

    def start(self) -> None:
        self.offloader.offload()
        dist.barrier()
        if self.rank == 0:
            hand_over(ready_path(self.output_dir), **self.offloader.figures("start"))

    def before_step(self, step: int) -> None:
        beat(f"waiting for the device (colocated: the engine asleep) step {step}")
        wait_turn(train_turn(self.output_dir, step), self.timeout, "the orchestrator")
        self._generate = self.offloader.figures("generate")  # what the trainer held while the engine generated
        self.offloader.onload()

    def after_step(self, step: int) -> None:
        figures = self.offloader.figures("train", reset=False)
        # the gradients existed during the step and were freed at its end: counted in the phase's tracked peak
        figures["train_device_peak_bytes"] = figures["train_device_bytes"] + self.offloader.grad_bytes()
        self.offloader.offload()
        self.offloader.reset()  # the generate phase's peaks start from the offloaded state
        dist.barrier()
        if self.rank == 0:
            hand_over(generate_turn(self.output_dir, step), **self._generate, **figures)
