"""Streamed weight publishing: the trainer's side of a weight update, one bucket of parameters at a time.

Every rank walks the model's parameters in the same order and groups them into buckets of `weights.bucket_mb`
(sizes in the inference dtype, from the global shapes, so no gather is needed to plan). For each bucket every
rank gathers its parameters (`DTensor.full_tensor()`: FSDP2 shards and ep-sharded experts alike), casts them to
`model.dtype` on the device, turns them into Hugging Face tensors (experts split, tied head dropped, FP8
quantised with `model.fp8 = "block"`) and, on the rank that owns the bucket, hands them to the transport's
`Publication`; then the bucket is dropped. Peak extra memory on any rank is one bucket, not the model.

With `weights.delta`, a bucket none of whose parameters changed since the previous publish from this process
(each parameter's in-place version counter, agreed across ranks) is skipped: not gathered, not sent.

A LoRA run (`model.lora`) publishes its adapter only (`stream_publish_adapter`): every rank gathers the adapter
parameters (small: one bucket), rank 0 writes them as a PEFT directory (arbor.models.lora_peft) through the same
transport's `Publication`, with the manifest, checksums and `STABLE` marker of every published version.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from arbor.models.hf import hf_state_dict
from arbor.models.lora import lora_parameters
from arbor.models.lora_peft import adapter_config, peft_tensors
from arbor.models.tokenizer import Tokenizer
from arbor.weights.buckets import TensorSpec, nbytes, plan_buckets, spec_of
from arbor.weights.comm import WeightTransferError
from arbor.weights.transport import Publication, WeightTransport

HANDSHAKE_MARGIN_S = 60.0
"""How much longer than `weights.timeout` the other trainer ranks wait for rank 0's handshake with the receivers."""
_handshake_groups: dict[float, Any] = {}


def publish_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or buffer) in state-dict order, as the published checkpoint names them (tied head once)."""
    tied = model.args.tie_word_embeddings
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items() if not (tied and k == "lm_head.weight")]


# DTensors are told apart by their methods: importing torch.distributed.tensor costs seconds of start-up (sympy),
# which the trainer spends while it already waits for rollouts instead (see arbor.trainer.checkpoint).
def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()


class DeltaTracker:
    """Remembers each parameter's version counter at the last publish, to tell which buckets changed. (The
    counter of the parameter itself: a DTensor's in-place updates, the optimizer's included, move the wrapper's
    counter, not its local shard's.)"""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.version: int | None = None
        self._seen: dict[str, int] = {}

    def changed(
        self, params: list[tuple[str, torch.Tensor]], groups: list[list[int]], device: torch.device
    ) -> list[bool]:
        """Per bucket: must it be sent? Every rank gets the same answer (a MAX all-reduce of the local flags)."""
        if not self.enabled or self.version is None:
            return [True] * len(groups)
        local = [any(self._seen.get(params[i][0]) != params[i][1]._version for i in g) for g in groups]
        flags = torch.tensor(local, dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [bool(f) for f in flags.tolist()]

    def record(self, params: list[tuple[str, torch.Tensor]], version: int) -> None:
        if self.enabled:
            self._seen = {k: v._version for k, v in params}
            self.version = version


def plan(
    model: nn.Module, dtype: torch.dtype, fp8: bool, bucket_bytes: int
) -> tuple[list[tuple[str, torch.Tensor]], list[list[int]], list[list[TensorSpec]]]:
    """The parameters, their buckets (indices) and each bucket's published tensors (HF names, dtypes, shapes),
    worked out on meta tensors: the same on every rank, nothing gathered."""
    params = publish_params(model)
    groups = plan_buckets([v.numel() * dtype.itemsize for _, v in params], bucket_bytes)
    layout = [
        spec_of(
            hf_state_dict(
                {params[i][0]: torch.empty(params[i][1].shape, dtype=dtype, device="meta") for i in g}, model.args, fp8
            )
        )
        for g in groups
    ]
    return params, groups, layout


def _handshake_group(timeout: float) -> Any:
    """A gloo group of the trainer ranks whose collectives wait `timeout` (made on first use, by every rank)."""
    if timeout not in _handshake_groups:
        _handshake_groups[timeout] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    return _handshake_groups[timeout]


def _begin_together(
    transport: WeightTransport,
    output_dir: str | Path,
    version: int,
    layout: list[list[TensorSpec]],
    rank: int,
    world: int,
    send: list[bool],
) -> Publication:
    """Starts the publication on every rank, and lets no rank gather a bucket before rank 0's has started.

    The NCCL transport's rank 0 waits for the receivers to join (up to `weights.timeout`) inside `begin`; a rank
    already in a bucket's all-gather meanwhile would sit in an NCCL collective whose watchdog (the trainer's
    process-group timeout) fires first. So every rank waits here, in a gloo collective whose timeout covers rank
    0's wait, and learns whether it succeeded: a failed handshake fails every rank in one line, none hangs."""
    error: WeightTransferError | None = None
    try:
        pub = transport.begin(output_dir, version, layout, rank, world, send)
    except WeightTransferError as e:
        error = e
    if world > 1:
        failed = torch.tensor([0 if error is None else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=_handshake_group(transport.timeout + HANDSHAKE_MARGIN_S))
        if failed.item() and error is None:
            error = WeightTransferError(f"weight update {version}: trainer rank 0 could not start it (see its log)")
    if error is not None:
        raise error
    return pub


def stream_publish(
    model: nn.Module,
    transport: WeightTransport,
    output_dir: str | Path,
    version: int,
    dtype: torch.dtype,
    fp8: bool,
    tokenizer: Tokenizer,
    tracker: DeltaTracker,
    device: torch.device,
) -> dict[str, float]:
    """Collective (every rank): publishes `broadcasts/step_{version}/` bucket by bucket; returns rank 0's
    figures (`weights/bytes_moved`, `weights/bytes_total`, `weights/buckets_skipped`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params, groups, layout = plan(model, dtype, fp8, transport.bucket_bytes)
    send = tracker.changed(params, groups, device)
    if rank == 0:
        transport.prepare(output_dir, version, model.args, tokenizer, fp8)
    if world > 1:
        dist.barrier()  # the staging directory exists before any rank writes into it
    pub = _begin_together(transport, output_dir, version, layout, rank, world, send)
    # One bucket is handed over (written, sent) in a helper thread while the next one is gathered and cast:
    # at most two buckets are alive at once.
    with ThreadPoolExecutor(1, thread_name_prefix="arbor-publish") as handover:
        pending: Future | None = None
        for i, g in enumerate(groups):
            if not send[i]:
                if rank == pub.owner(i):
                    pub.skip(i, tracker.version)  # type: ignore[arg-type]  # send[i] False: a previous version exists
                continue
            full = {params[j][0]: _full(params[j][1]).to(dtype) for j in g}
            tensors = hf_state_dict(full, model.args, fp8) if rank == pub.owner(i) else None
            del full
            if pending is not None:
                pending.result()
                pending = None
            if tensors is not None:
                pending = handover.submit(pub.put, i, tensors)
            del tensors
        if pending is not None:
            pending.result()
    records: list[Any] = [pub.records()]
    if world > 1:
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(records[0], gathered if rank == 0 else None, dst=0)
        records = gathered
    if rank == 0:
        pub.finish([r for part in records for r in part], model.args, tokenizer, fp8)
    tracker.record(params, version)
    moved = sum(nbytes(s) for i, b in enumerate(layout) if send[i] for s in b)
    return {
        "weights/bytes_moved": float(moved),
        "weights/bytes_total": float(sum(nbytes(s) for b in layout for s in b)),
        "weights/buckets_skipped": float(send.count(False)),
    }


def stream_publish_adapter(
    model: nn.Module,
    transport: Any,
    output_dir: str | Path,
    version: int,
    dtype: torch.dtype,
    lora: Any,
    base_model: str,
) -> dict[str, float]:
    """Collective (every rank): publishes the adapter of `lora` (a `LoRAConfig`) over `base_model` as
    `broadcasts/step_{version}/` in PEFT's layout; returns rank 0's figures (as `stream_publish`)."""
    # the same parameter order on every rank, so the gathers of sharded adapters pair up
    full = {name: _full(p).to(dtype) for name, p in lora_parameters(model)}
    size = float(sum(t.numel() * t.element_size() for t in full.values()))
    if dist.get_rank() == 0:
        tensors = peft_tensors(full)
        transport.prepare_adapter(output_dir, version, adapter_config(lora, base_model, full))
        pub = transport.begin_adapter(output_dir, version, spec_of(tensors))
        pub.put(0, tensors)
        pub.finish(pub.records(), model.args)
    return {"weights/bytes_moved": size, "weights/bytes_total": size, "weights/buckets_skipped": 0.0}
