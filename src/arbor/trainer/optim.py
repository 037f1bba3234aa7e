"""Optimizers (AdamW, Muon) and learning-rate schedules (constant / linear / cosine after linear warm-up).

Muon is torch's own `torch.optim.Muon`, which orthogonalises 2-D updates only; as its documentation and the
Muon paper advise, embeddings, the LM head, norms, routers and 3-D expert tensors go to an AdamW beside it.
Both live in one `Optimizers` container that steps, zeroes and checkpoints them together (torchtitan's
OptimizersContainer, reduced to what we use). The schedule is a pure function of the step, applied before each
optimizer step, so a resumed run needs no scheduler state.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from arbor.config.trainer import LRScheduleConfig, OptimConfig


class Optimizers:
    """One or more optimizers that act as one (step, zero_grad, param_groups, state dicts via DCP)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.state_on_host = False
        """A colocated run (arbor.trainer.offload): the state stays in host memory and `step` brings one
        parameter's state at a time to the device, so a step holds the parameters and gradients only."""

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            if self.state_on_host:
                step_with_host_state(o)
            else:
                o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def step_with_host_state(o: torch.optim.Optimizer) -> None:
    """`o.step()` one parameter at a time, its state (kept in host memory) on the parameter's device for the
    update only: the device holds one parameter's optimizer state at a time. Each parameter's update is the one
    `o.step()` computes for it (the single-tensor path; a CPU trainer takes it anyway); a new state (the first
    step) is created on the device, then moved to the host with the rest."""
    for group in o.param_groups:
        params = group["params"]
        try:
            for p in params:
                if p.grad is None:
                    continue
                state = o.state.get(p, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.ndim > 0:
                        state[key] = value.to(p.device)
                group["params"] = [p]
                o.step()
                state = o.state[p]
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.ndim > 0:
                        state[key] = value.to("cpu")
        finally:
            group["params"] = params


def _muon_eligible(name: str, p: nn.Parameter) -> bool:
    # Token embeddings and the head are lookup tables/classifiers, not hidden-layer matrices; the router is
    # tiny and its logits must stay calibrated.
    return p.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name and not name.endswith("mlp.gate.weight")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> Optimizers:
    adamw_kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    # Frozen parameters (a LoRA base) get no optimizer state.
    if cfg.name == "adamw":
        return Optimizers([torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adamw_kw)])
    seen: set[int] = set()
    muon, rest = [], []
    for name, p in model.named_parameters():  # tied weights appear once
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (muon if _muon_eligible(name, p) else rest).append(p)
    muon_lr = cfg.muon_lr if cfg.muon_lr is not None else cfg.lr
    opts: list[torch.optim.Optimizer] = [
        torch.optim.Muon(
            muon, lr=muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"
        )
    ]
    if rest:
        opts.append(torch.optim.AdamW(rest, **adamw_kw))
    for o in opts:
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    return Optimizers(opts)


def lr_factor(step: int, max_steps: int, cfg: LRScheduleConfig) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.name == "constant":
        return 1.0
    span = max(max_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    lo = cfg.min_lr_ratio
    if cfg.name == "linear":
        return lo + (1.0 - lo) * (1.0 - progress)
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: Optimizers, step: int, max_steps: int, cfg: LRScheduleConfig) -> float:
    """Applies the schedule for `step`; returns the first group's learning rate."""
    f = lr_factor(step, max_steps, cfg)
    for g in optimizer.param_groups:
        g["lr"] = g.setdefault("base_lr", g["lr"]) * f
    return optimizer.param_groups[0]["lr"]
