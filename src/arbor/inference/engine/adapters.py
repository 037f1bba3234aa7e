"""Per-request LoRA adapters in the local engine: adapter slots on the model's layers and the name registry.

Every layer some loaded adapter targets gets a bank of `max_loras + 1` slots (slot 0: no adapter, all zeros),
installed on first use by changing the layer's class in place (as `arbor.models.lora.apply_lora` does for the
trainer): a linear layer holds `lora_A_bank [S, R, in]` and `lora_B_bank [S, out, R]`, MoE experts one bank per
projection `[S, E, R, in]` / `[S, E, out, R]`, with R = `max_lora_rank` (an adapter of lower rank is zero-padded,
which changes nothing) and the adapter's scale folded into B. Before each forward the runner says which slot
each batch row uses (`AdapterSlots.rows`); a layer then adds `B[slot] A[slot] x` row by row (one gather per
layer), so requests for different adapters share one decode batch. A forward whose rows all use one slot (every
prefill, most decodes) takes that slot's matrices directly.

Slots are written by the engine thread only, between forwards: loading a new version of a loaded adapter
overwrites its slot in place; other adapters' requests keep running. MLA's absorbed `kv_b_proj` is read as a
weight (arbor.models.qwen3.linear_weight), which one forward can hold for one slot only: with such a layer
adapted the runner decodes rows grouped by slot (`uniform_rows`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from arbor.models.lora import expert_shapes
from arbor.models.lora_peft import lora_scale, read_config
from arbor.models.qwen3_moe import GroupedExperts, MoE, combine, grouped_mm, sort_by_expert

WEIGHT_READ = ("kv_b_proj",)
"""Layers whose weight is read directly rather than through their forward (MLA's absorbed `kv_b_proj`)."""


class AdapterError(ValueError):
    """An adapter that cannot be loaded into this engine (unknown layer, shape, rank, no free slot)."""


class RowSlots:
    """Which slot each row of the current forward uses, shared by every banked layer of one model."""

    def __init__(self) -> None:
        self.single: int | None = 0
        """The one slot all rows use (0: no adapter), or None when rows differ (`token_rows` then says)."""
        self.token_rows: torch.Tensor | None = None
        """Slot of every flattened token `[B*T]` when rows differ."""
        self.pair_rows: torch.Tensor | None = None
        """Slot of every (token, expert) pair in expert order, set by `slotted_dispatch` for the experts."""


class SlottedLinearMixin:
    """In front of a linear layer's own class: adds its row's adapter slot to the output."""

    lora_A_bank: torch.Tensor
    lora_B_bank: torch.Tensor
    lora_rows: RowSlots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # type: ignore[misc]
        rows = self.lora_rows
        if rows.single == 0:
            return y
        if rows.single is not None:
            return y + F.linear(F.linear(x, self.lora_A_bank[rows.single]), self.lora_B_bank[rows.single])
        flat = x.reshape(-1, x.shape[-1])
        a, b = self.lora_A_bank[rows.token_rows], self.lora_B_bank[rows.token_rows]
        delta = torch.einsum("nr,nor->no", torch.einsum("ni,nri->nr", flat, a), b)
        return y + delta.reshape(*y.shape)

    def lora_weight_delta(self) -> torch.Tensor:
        """The current slot's `B A` (read by `arbor.models.qwen3.linear_weight`); all rows must share one slot."""
        s = self.lora_rows.single
        if s is None:
            raise RuntimeError("a layer read as a weight cannot serve rows of different adapters in one forward")
        return self.lora_B_bank[s] @ self.lora_A_bank[s]


class SlottedExperts(GroupedExperts):
    """MoE experts with adapter banks on the projections in `lora_banks`."""

    lora_banks: dict[str, tuple[torch.Tensor, torch.Tensor]]
    lora_rows: RowSlots

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_mm(x, self.gate_up_proj, counts).chunk(2, dim=-1)
        gate = gate + self._delta("gate", x, counts)
        up = up + self._delta("up", x, counts)
        h = F.silu(gate) * up
        return grouped_mm(h, self.down_proj, counts) + self._delta("down", h, counts)

    def _delta(self, proj: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | float:
        rows = self.lora_rows
        if proj not in self.lora_banks or rows.single == 0:
            return 0.0
        a, b = self.lora_banks[proj]
        if rows.single is not None:
            return grouped_mm(grouped_mm(x, a[rows.single], counts), b[rows.single], counts)
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
        sa, sb = a[rows.pair_rows, expert], b[rows.pair_rows, expert]
        return torch.einsum("nr,nor->no", torch.einsum("ni,nri->nr", x, sa), sb)


def slotted_dispatch(rows: RowSlots):
    """`local_dispatch` that also tells the experts each (token, expert) pair's slot."""

    def dispatch(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: GroupedExperts):
        order, token, counts = sort_by_expert(indices, experts.num_experts)
        rows.pair_rows = None if rows.single is not None else rows.token_rows[token]
        return combine(x, experts(x[token], counts), weights, order, token)

    return dispatch


@dataclasses.dataclass
class Loaded:
    """An adapter in a slot: its version tags the tokens it samples."""

    slot: int
    version: int
    path: str


class AdapterSlots:
    """The engine's adapters: `max_loras` slots of rank up to `max_rank` on `model`. Engine thread only, except
    `version_of` / `names` (reads of a dict, safe from the HTTP thread)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.rows_state = RowSlots()
        self.loaded: dict[str, Loaded] = {}
        self.uniform_rows = False
        """True once a layer read as a weight holds a bank, or for a recurrent model (the runner sets it): decode
        then groups rows by slot."""
        self._banked: dict[str, nn.Module] = {}
        self._modules = dict(model.named_modules())

    def names(self) -> list[str]:
        return list(self.loaded)

    def version_of(self, name: str) -> int | None:
        entry = self.loaded.get(name)
        return None if entry is None else entry.version

    def slot_of(self, name: str | None) -> int:
        if name is None:
            return 0
        if name not in self.loaded:
            raise AdapterError(f"adapter {name!r} is not loaded")
        return self.loaded[name].slot

    def load(self, name: str, path: str, tensors: dict[str, torch.Tensor], version: int) -> int:
        """Puts adapter `name` (arbor-named tensors, arbor.models.lora_peft.arbor_tensors) into its slot (a new
        one, or the one its previous version held); returns the slot. Checked in full before anything is written."""
        config = read_config(path)
        scale = lora_scale(config)
        plan = self._plan(tensors, int(config["r"]))
        slot = self.loaded[name].slot if name in self.loaded else self._free_slot()
        for path_, parts in plan.items():
            self._bank(path_, set(parts))
        with torch.no_grad():
            for module in self._banked.values():  # layers the new version no longer adapts: zero in this slot
                for a, b in _banks_of(module):
                    a[slot].zero_()
                    b[slot].zero_()
            for path_, parts in plan.items():
                module = self._banked[path_]
                for proj, (a, b) in parts.items():
                    bank_a, bank_b = module.lora_banks[proj] if proj else (module.lora_A_bank, module.lora_B_bank)
                    r = a.shape[-2]
                    bank_a[slot, ..., :r, :].copy_(a.to(bank_a.dtype))
                    bank_b[slot, ..., :, :r].copy_((b * scale).to(bank_b.dtype))
        self.loaded[name] = Loaded(slot, version, path)
        return slot

    def unload(self, name: str) -> int:
        """Frees the adapter's slot (zeroed); returns it. Raises AdapterError when it is not loaded."""
        slot = self.slot_of(name)
        with torch.no_grad():
            for module in self._banked.values():
                for a, b in _banks_of(module):
                    a[slot].zero_()
                    b[slot].zero_()
        del self.loaded[name]
        return slot

    @contextlib.contextmanager
    def rows(self, slots: list[int], tokens_per_row: int) -> Iterator[None]:
        """The slots of the next forward's rows (each `tokens_per_row` tokens long)."""
        state = self.rows_state
        if len(set(slots)) == 1:
            state.single, state.token_rows = slots[0], None
        else:
            state.single = None
            device = next(self.model.parameters()).device
            state.token_rows = torch.tensor(slots, device=device).repeat_interleave(tokens_per_row)
        try:
            yield
        finally:
            state.single, state.token_rows, state.pair_rows = 0, None, None

    def _free_slot(self) -> int:
        used = {e.slot for e in self.loaded.values()}
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if not free:
            raise AdapterError(f"all {self.max_loras} adapter slots are in use (inference max_loras): unload one first")
        return free[0]

    def _plan(
        self, tensors: dict[str, torch.Tensor], rank: int
    ) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Module path -> projection ("" for a linear layer) -> (A, B), every shape checked against the model."""
        if rank > self.max_rank:
            raise AdapterError(f"adapter rank {rank} exceeds the engine's max_lora_rank {self.max_rank}")
        plan: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for name in sorted(tensors):
            path, leaf = name.rsplit(".", 1)
            if not leaf.endswith("_A"):
                continue
            proj = "" if leaf == "lora_A" else leaf.split("_")[1]
            other = name[:-1] + "B"
            if other not in tensors:
                raise AdapterError(f"adapter has {name} without {other}")
            a, b = tensors[name], tensors[other]
            module = self._modules.get(path)
            if proj:
                if not isinstance(module, GroupedExperts):
                    raise AdapterError(f"adapter targets experts at {path}, which the model does not have")
                out_f, in_f = expert_shapes(module)[proj]
                want_a, want_b = (module.num_experts, a.shape[-2], in_f), (module.num_experts, out_f, a.shape[-2])
            else:
                if not isinstance(module, nn.Linear):
                    raise AdapterError(f"adapter targets {path}, which is not a linear layer of the model")
                want_a, want_b = (a.shape[-2], module.in_features), (module.out_features, a.shape[-2])
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b or a.shape[-2] > self.max_rank:
                raise AdapterError(
                    f"adapter {path} {proj or ''}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                    f"the model ({want_a} / {want_b}, rank at most {self.max_rank})"
                )
            plan.setdefault(path, {})[proj] = (a, b)
        if not plan:
            raise AdapterError("adapter holds no lora_A / lora_B pair")
        return plan

    def _bank(self, path: str, projs: set[str]) -> None:
        """Installs zero banks on the layer at `path` (for `projs` of experts) unless it has them."""
        module = self._modules[path]
        p = next(module.parameters())
        S, R = self.max_loras + 1, self.max_rank
        if isinstance(module, GroupedExperts):
            if not isinstance(module, SlottedExperts):
                module.__class__ = SlottedExperts
                module.lora_banks, module.lora_rows = {}, self.rows_state
                self._install_dispatch(path)
            shapes = expert_shapes(module)
            for proj in projs - set(module.lora_banks):
                out_f, in_f = shapes[proj]
                E = module.num_experts
                module.lora_banks[proj] = (p.new_zeros(S, E, R, in_f), p.new_zeros(S, E, out_f, R))
        elif not isinstance(module, SlottedLinearMixin):
            module.__class__ = _slotted_class(type(module))
            module.lora_A_bank = p.new_zeros(S, R, module.in_features)
            module.lora_B_bank = p.new_zeros(S, module.out_features, R)
            module.lora_rows = self.rows_state
            self.uniform_rows |= path.rsplit(".", 1)[-1] in WEIGHT_READ
        self._banked[path] = module

    def _install_dispatch(self, experts_path: str) -> None:
        moe = self._modules[experts_path.rsplit(".", 1)[0]]
        if isinstance(moe, MoE):
            moe.dispatcher = slotted_dispatch(self.rows_state)


def _banks_of(module: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(module, SlottedExperts):
        return list(module.lora_banks.values())
    return [(module.lora_A_bank, module.lora_B_bank)]


_CLASSES: dict[type, type] = {}


def _slotted_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Slotted{base.__name__}", (SlottedLinearMixin, base), {})
    return _CLASSES[base]
