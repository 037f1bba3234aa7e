"""LoRA adapters on arbor's models: a trainable low-rank pair added to each target linear layer of a frozen base.

`apply_lora(model, cfg, seed)` changes the class of every target layer in place (as `arbor.models.fp8.apply_fp8`
does), so base parameters keep their names and identity and the Hugging Face weight mapping is untouched:

- an `nn.Linear` (or `FP8Linear`: apply FP8 first, the adapter then wraps its FP8 forward) gains `lora_A [r, in]`
  and `lora_B [out, r]` and computes `base(x) + (alpha / r) * B A dropout(x)`;
- MoE experts (`GroupedExperts`, weights `[E, out, in]`) gain one pair per expert and projection,
  `lora_{gate,up,down}_A [E, r, in]` / `lora_{gate,up,down}_B [E, out, r]`, applied with the same grouped matmul;
- a layer whose weight is read directly instead of through its forward (MLA's absorbed `kv_b_proj`) reads it
  through `arbor.models.qwen3.linear_weight`, which adds the adapter's `B A` product (so does the head, `lm_head`,
  when a target names it).

A is drawn from `seed` (PEFT's Kaiming-uniform bound, the same on every rank), B starts at zero, so a fresh
adapter leaves the model's function unchanged. Every other parameter is frozen (`requires_grad` False): FSDP2
reduces and the optimizer steps the adapters only. Names: a Linear's pair is `<path>.lora_A` / `<path>.lora_B`;
PEFT's file layout is `arbor.models.lora_peft`'s.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from arbor.models.materialize import copy_checked
from arbor.models.qwen3_moe import GroupedExperts, grouped_mm

EXPERT_PROJS = ("gate", "up", "down")
"""The projections of a SwiGLU expert, in PEFT's per-expert module names (`experts.{e}.{proj}_proj`)."""


def matches(path: str, patterns: list[str]) -> bool:
    """PEFT's target rule: a pattern equal to the module's last name component, or a regular expression the
    module's full path matches whole."""
    leaf = path.rsplit(".", 1)[-1]
    return any(p == leaf or re.fullmatch(p, path) is not None for p in patterns)


def _init_a(shape: tuple[int, ...], fan_in: int, gen: torch.Generator) -> torch.Tensor:
    # PEFT's default: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound


class LoRALinearMixin:
    """Placed in front of a layer's own class (`nn.Linear`, `FP8Linear`) by `apply_lora`."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # type: ignore[misc]
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x  # type: ignore[attr-defined]
        return y + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.lora_scale

    def delta_weight(self) -> torch.Tensor:
        """`scale * B A`, the adapter as a change of the weight `[out, in]`."""
        return (self.lora_B @ self.lora_A) * self.lora_scale


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    """`LoRA<base>`: the mixin over `base`, one class per base class."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (LoRALinearMixin, base), {})
    return _CLASSES[base]


class LoRAGroupedExperts(GroupedExperts):
    """MoE experts with a LoRA pair per expert on the projections `lora_projs` names."""

    lora_projs: tuple[str, ...]
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_mm(x, self.local("gate_up_proj"), counts).chunk(2, dim=-1)
        gate = gate + self._delta("gate", x, counts)
        up = up + self._delta("up", x, counts)
        h = F.silu(gate) * up
        return grouped_mm(h, self.local("down_proj"), counts) + self._delta("down", h, counts)

    def _delta(self, proj: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | float:
        if proj not in self.lora_projs:
            return 0.0
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        a, b = self.local(f"lora_{proj}_A"), self.local(f"lora_{proj}_B")
        return grouped_mm(grouped_mm(h, a, counts), b, counts) * self.lora_scale

    def expert_delta(self, proj: str) -> torch.Tensor:
        """`scale * B_e A_e` for every expert, `[E, out, in]` (the full tensors: call on unsharded experts)."""
        return torch.bmm(getattr(self, f"lora_{proj}_B"), getattr(self, f"lora_{proj}_A")) * self.lora_scale


def expert_shapes(experts: GroupedExperts) -> dict[str, tuple[int, int]]:
    """(out, in) of each expert projection."""
    two_i, h = experts.gate_up_proj.shape[1:]
    return {"gate": (two_i // 2, h), "up": (two_i // 2, h), "down": (h, two_i // 2)}


def lora_targets(model: nn.Module, patterns: list[str]) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    """Module path -> (module, adapted expert projections; empty for a linear layer) for every target of
    `patterns` (`matches`). The head (`lm_head`) is a target only when a pattern names it exactly: a regular
    expression never picks it up (PEFT's "all-linear" leaves it out too). Routers, the embeddings and the MTP
    draft modules (the base model's drafts: speculative decoding serves the base's requests only) are never
    targets."""
    out: dict[str, tuple[nn.Module, tuple[str, ...]]] = {}
    for path, module in model.named_modules():
        if path == "mtp" or path.startswith("mtp."):
            continue
        if isinstance(module, GroupedExperts):
            projs = tuple(p for p in EXPERT_PROJS if matches(f"{path}.0.{p}_proj", patterns))
            if projs:
                out[path] = (module, projs)
        elif path == "lm_head":
            if isinstance(module, nn.Linear) and "lm_head" in patterns:
                out[path] = (module, ())
        elif isinstance(module, nn.Linear) and matches(path, patterns):
            out[path] = (module, ())
    return out


def apply_lora(model: nn.Module, cfg: Any, seed: int) -> list[str]:
    """Adds `cfg` (a `LoRAConfig`) adapters to `model` in place and freezes everything else; returns the adapted
    module paths. Raises ValueError when no module matches `cfg.target_modules`."""
    targets = lora_targets(model, list(cfg.target_modules))
    if not targets:
        raise ValueError(f"model.lora.target_modules {list(cfg.target_modules)} match no linear layer of the model")
    model.requires_grad_(False)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r, scale = cfg.rank, cfg.alpha / cfg.rank
    for path, (module, projs) in targets.items():
        dev = next(module.parameters()).device
        if dev.type == "meta":  # a model built without weights: adapters are drawn now and kept (materialize)
            dev = torch.device("cpu")
        if projs:
            module.__class__ = LoRAGroupedExperts
            shapes = expert_shapes(module)
            for p in projs:
                out_f, in_f = shapes[p]
                a = _init_a((module.num_experts, r, in_f), in_f, gen)
                setattr(module, f"lora_{p}_A", nn.Parameter(a.to(dev)))
                setattr(module, f"lora_{p}_B", nn.Parameter(torch.zeros(module.num_experts, out_f, r, device=dev)))
            module.lora_projs = projs
        else:
            module.__class__ = _lora_class(type(module))
            module.lora_A = nn.Parameter(_init_a((r, module.in_features), module.in_features, gen).to(dev))
            module.lora_B = nn.Parameter(torch.zeros(module.out_features, r, device=dev))
        module.lora_scale, module.lora_dropout = scale, cfg.dropout
    return list(targets)


def load_adapter_into(model: nn.Module, tensors: dict[str, torch.Tensor], source: object) -> None:
    """Copies arbor-named adapter tensors (arbor.models.lora_peft.arbor_tensors) into the model's adapters,
    checking every name and shape first (the adapter's rank must be the model's)."""
    copy_checked(dict(lora_parameters(model)), tensors, f"adapter {source}", "model.lora")


def is_lora_param(name: str) -> bool:
    """Whether a parameter name (model-relative) is an adapter's."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("lora_A", "lora_B") or (leaf.startswith("lora_") and leaf[-2:] in ("_A", "_B"))


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter, in the model's parameter order."""
    return [(n, p) for n, p in model.named_parameters() if is_lora_param(n)]


def check_mergeable(model: nn.Module) -> None:
    """Raises ValueError when `merged_state` cannot fold the adapters in: an adapter on a head tied to the
    embeddings changes the output projection only, which one shared weight cannot hold."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, LoRALinearMixin) and head.weight is model.model.embed_tokens.weight:
        raise ValueError(
            "model.lora.target_modules: an adapter on lm_head cannot be merged into a model whose head "
            "is tied to its embeddings (sft.adapter merges it): leave lm_head out, or set "
            "sft.adapter = false"
        )


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter folded into its base weight and the adapters left out: the
    full weights that compute what base + adapter computes."""
    check_mergeable(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not is_lora_param(k)}
    with torch.no_grad():
        for path, module in model.named_modules():
            if isinstance(module, LoRALinearMixin):
                key = f"{path}.weight"
                state[key] = state[key] + module.delta_weight().to(state[key].dtype)
            elif isinstance(module, LoRAGroupedExperts):
                if "gate" in module.lora_projs or "up" in module.lora_projs:
                    zeros = torch.zeros_like(state[f"{path}.down_proj"]).transpose(1, 2)
                    gate = module.expert_delta("gate") if "gate" in module.lora_projs else zeros
                    up = module.expert_delta("up") if "up" in module.lora_projs else zeros
                    state[f"{path}.gate_up_proj"] = state[f"{path}.gate_up_proj"] + torch.cat([gate, up], dim=1)
                if "down" in module.lora_projs:
                    state[f"{path}.down_proj"] = state[f"{path}.down_proj"] + module.expert_delta("down")
    return state
