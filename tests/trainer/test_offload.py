"""A colocated trainer's state (arbor.trainer.offload): the optimizer stepped one parameter at a time with its
state in host memory updates exactly as the plain step does, and offloading frees the gradients and leaves the
parameters and optimizer state where they were (a CPU trainer's device is the host)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from arbor.config.trainer import OptimConfig
from arbor.trainer.offload import Offloader
from arbor.trainer.optim import build_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(model: nn.Module, optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(5, 8, generator=gen)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_stepping_with_the_state_on_the_host_matches_the_plain_step():
    plain, hosted = _model(), _model()
    cfg = OptimConfig(lr=1e-2)
    _train(plain, build_optimizer(plain, cfg))
    optimizer = build_optimizer(hosted, cfg)
    optimizer.state_on_host = True
    _train(hosted, optimizer)
    for a, b in zip(plain.parameters(), hosted.parameters()):
        assert torch.equal(a, b)
    state = [v for o in optimizer.optimizers for s in o.state.values() for v in s.values()]
    assert state and all(v.device.type == "cpu" for v in state)


def test_offload_frees_gradients_and_onload_restores_the_step():
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    offloader = Offloader([model], optimizer, torch.device("cpu"))
    assert optimizer.state_on_host
    _train(model, optimizer, steps=1)
    reference = copy.deepcopy(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    held = offloader.device_bytes()
    offloader.offload()
    assert all(p.grad is None for p in model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())  # bytes of the float32 weights (= of the gradients)
    assert held - offloader.device_bytes() == params  # the gradients went; weights and Adam moments stay (CPU)
    assert offloader.device_bytes() >= 3 * params
    offloader.onload()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    figures = offloader.figures("train")
    assert figures["train_device_bytes"] == held - params and figures["train_rss_bytes"] > 0
