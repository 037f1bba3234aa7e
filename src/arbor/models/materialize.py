"""Building a model without holding its weights on the host: parameters on the meta device, then each rank's own.

A trainer rank used to build the whole model in fp32 on the host before FSDP2 sharded it (a 235B model: ~940 GB
per rank). Now `params_on_meta` builds the modules with meta parameters (no memory) while buffers (RoPE
frequencies, which are computed, not loaded) are made as usual; `parallelize` shards the meta model;
`materialize` allocates each rank's shards on its device, keeping every tensor that was already real (those
buffers, LoRA adapters drawn before sharding); the loader then writes each checkpoint tensor's local part
(`write_full`), one layer at a time (arbor.models.hf.load_weights). torchtitan and FSDP2's documentation follow
the same order (meta init -> fully_shard -> to_empty -> load).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside it, a parameter registered on any module moves to the meta device at once (its initialisation in
    the module's constructor then costs nothing); buffers and other tensors are made as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = dict(param.__dict__)  # a Parameter subclass's own attributes
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocates every meta tensor of `model` on `device` (after `parallelize`, each rank's shards only); the
    tensors that were already real (computed buffers, adapters) keep their values. The meta ones hold garbage
    until the loader writes them."""
    keep = {
        name: local_tensor(t).detach().clone()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if not local_tensor(t).is_meta
    }
    shared: dict[int, list[tuple[nn.Module, str]]] = {}  # tied parameters (a head that is the embedding)
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, key))
    model.to_empty(device=device)
    for (owner, key), *others in (places for places in shared.values() if len(places) > 1):
        for module, other in others:  # a meta parameter's replacement is one new tensor per module: tie again
            module._parameters[other] = owner._parameters[key]
    with torch.no_grad():
        for name, value in keep.items():
            local_tensor(_tensor(model, name)).copy_(value)


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    return getattr(module, leaf)


def local_slices(t: torch.Tensor) -> tuple[slice, ...]:
    """The part of the whole tensor that `t` holds on this rank, a slice per dimension (`t` a DTensor sharded any
    way, or plain: all of it)."""
    if not hasattr(t, "to_local"):
        return tuple(slice(0, n) for n in t.shape)
    # the offsets FSDP2, expert parallelism and DCP agree on; private, but stable across torch releases
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tuple(t.shape), t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_part(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The slice of `full` (the whole tensor, any device) that `t` holds on this rank."""
    return full[local_slices(t)] if hasattr(t, "to_local") else full


def write_full(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copies this rank's part of the whole tensor `full` into `t` (cast to `t`'s dtype, moved to its device)."""
    with torch.no_grad():
        local_tensor(t).copy_(local_part(t, full))


def check_matches(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], what: str, target: str) -> None:
    """Raises, in one line, unless `state` has exactly `own`'s names, each of its shape (`what` and `target`
    name the two sides)."""
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{what} does not match {target}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{what}: {name} has shape {tuple(tensor.shape)}, model has {tuple(own[name].shape)}")


def copy_checked(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], what: str, target: str) -> None:
    """Copies `state` into the tensors `own` names once every name and shape matched (`check_matches`); the
    tensors may be sharded (each rank copies its part)."""
    check_matches(own, state, what, target)
    for name, tensor in state.items():
        write_full(own[name], tensor)
