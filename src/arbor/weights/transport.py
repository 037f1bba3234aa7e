"""Weight transfer from the trainer to the inference fleet, behind one small interface (`WeightTransport`).

Version N is `broadcasts/step_N/` (`STABLE` written last), moved in buckets: `FilesystemTransport` writes a
checksummed Hugging Face checkpoint (or a PEFT adapter), `NCCLTransport` a bucket list followed by a broadcast
from trainer rank 0 to the vLLM workers. Both time out rather than hang (docs/weights.md).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from arbor.config.transport import WeightTransportConfig
from arbor.models.args import ModelArgs
from arbor.models.hf import hf_config, hf_state_dict
from arbor.models.lora_peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from arbor.models.tokenizer import Tokenizer
from arbor.run_dir import STABLE, broadcast_dir, broadcast_staging_dir, prune_published
from arbor.weights.buckets import (
    TensorSpec,
    decode_specs,
    encode_specs,
    nbytes,
    plan_buckets,
    spec_of,
)
from arbor.weights.comm import (
    SenderGroup,
    WeightTransferError,
    WeightTransferTimeout,
    deadline_call,
    send_buckets,
)
from arbor.weights.shards import INDEX, MANIFEST, NCCL_SPEC, hasher, read_verified, write_shard

__all__ = [
    "INDEX",
    "MANIFEST",
    "NCCL_SPEC",
    "FilesystemTransport",
    "NCCLTransport",
    "Publication",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightTransport",
    "make_transport",
    "publish_weights",
    "read_nccl_layout",
    "read_nccl_spec",
    "read_verified",
    "wait_stable",
]  # re-exported for callers


def split_buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    items = list(tensors.items())
    groups = plan_buckets([t.numel() * t.element_size() for _, t in items], bucket_bytes)
    return [dict(items[i] for i in g) for g in groups]


def _stage(output_dir: str | Path, step: int, args: ModelArgs, tokenizer: Tokenizer | None, fp8: bool) -> Path:
    """A fresh staging directory holding config.json (and the tokenizer)."""
    tmp = broadcast_staging_dir(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf_config(args, fp8), indent=2))
    if tokenizer is not None:
        tokenizer.save(tmp)
    return tmp


def _stage_adapter(output_dir: str | Path, step: int, config: dict[str, Any]) -> Path:
    """A fresh staging directory holding the PEFT `adapter_config.json`."""
    tmp = broadcast_staging_dir(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return tmp


def _make_visible(output_dir: str | Path, step: int) -> Path:
    tmp, final = broadcast_staging_dir(output_dir, step), broadcast_dir(output_dir, step)
    (tmp / STABLE).write_text(str(step))
    if final.exists():  # a resumed run republishes the step it resumed from
        shutil.rmtree(final)
    tmp.rename(final)
    return final


class Publication(ABC):
    """One version on its way out, on one trainer rank. `put(i, tensors)` / `skip(i, previous)` are called on
    `owner(i)` only; `finish(records)` on rank 0 with every rank's `records()` (the trainer gathers them)."""

    def __init__(
        self, output_dir: str | Path, step: int, layout: list[list[TensorSpec]], rank: int, world: int
    ) -> None:
        self.output_dir, self.step, self.layout, self.rank, self.world = output_dir, step, layout, rank, world
        self.bytes_moved = 0

    def owner(self, index: int) -> int:
        return 0

    @abstractmethod
    def put(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Hands bucket `index` (the tensors `layout[index]` names, in that order) to the transport."""

    def skip(self, index: int, previous: int) -> None:
        """Bucket `index` is unchanged since version `previous` (a delta update)."""

    def records(self) -> list[Any]:
        return []

    @abstractmethod
    def finish(
        self, records: list[Any], args: ModelArgs, tokenizer: Tokenizer | None = None, fp8: bool = False
    ) -> Path:
        """Rank 0: completes the version (STABLE, receivers' confirmation), prunes old ones; the step directory."""


class WeightTransport(ABC):
    """Trainer side: `begin` (streamed, every rank) or `publish` (one process). Inference side: `load`."""

    def __init__(self, keep: int = 3, timeout: float = 600.0, bucket_mb: float = 64.0) -> None:
        self.keep, self.timeout = keep, timeout
        self.bucket_bytes = int(bucket_mb * 2**20)

    @abstractmethod
    def prepare(
        self, output_dir: str | Path, step: int, args: ModelArgs, tokenizer: Tokenizer | None = None, fp8: bool = False
    ) -> None:
        """Rank 0, before any rank's `begin`: creates what every rank writes into."""

    @abstractmethod
    def begin(
        self,
        output_dir: str | Path,
        step: int,
        layout: list[list[TensorSpec]],
        rank: int = 0,
        world: int = 1,
        sent: list[bool] | None = None,
    ) -> Publication:
        """Starts publishing version `step` whose buckets are `layout` (HF names, inference dtypes); `sent[i]`
        False marks a bucket that will be skipped (delta)."""

    def publish(
        self,
        output_dir: str | Path,
        step: int,
        state: dict[str, torch.Tensor],
        args: ModelArgs,
        tokenizer: Tokenizer | None = None,
        fp8: bool = False,
    ) -> Path:
        """Publishes a whole state dict from one process: `broadcasts/step_{step}/` atomically, old steps pruned.
        `fp8`: DeepSeek's FP8 checkpoint format (float8 weights + `weight_scale_inv`, `quantization_config`)."""
        groups = split_buckets(hf_state_dict(state, args, fp8), self.whole_bucket_bytes())
        self.prepare(output_dir, step, args, tokenizer, fp8)
        pub = self.begin(output_dir, step, [spec_of(g) for g in groups])
        deadline_call(
            lambda: self._put_all(pub, groups),
            self.timeout,
            f"writing weights to {broadcast_staging_dir(output_dir, step)}",
        )
        return pub.finish(pub.records(), args, tokenizer, fp8)

    def whole_bucket_bytes(self) -> int:
        return self.bucket_bytes

    def _put_all(self, pub: Publication, groups: list[dict[str, torch.Tensor]]) -> None:
        for i, g in enumerate(groups):
            pub.put(i, g)

    @abstractmethod
    def load(self, path: str | Path) -> dict[str, torch.Tensor]:
        """Every tensor of a published step directory, checked; raises WeightTransferError."""


def wait_stable(path: str | Path, timeout: float) -> Path:
    """Waits until `path/STABLE` exists (a publish may still be renaming into place)."""
    path = Path(path)
    deadline = time.monotonic() + timeout
    while not (path / STABLE).exists():
        if time.monotonic() > deadline:
            raise WeightTransferTimeout(f"{path} has no {STABLE} marker after {timeout:.0f}s")
        time.sleep(0.05)
    return path


# ---- filesystem ----


def _shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _shard_keys(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


class FilePublication(Publication):
    def __init__(
        self,
        transport: "FilesystemTransport",
        output_dir: str | Path,
        step: int,
        layout: list[list[TensorSpec]],
        rank: int,
        world: int,
        names: list[str] | None = None,
    ) -> None:
        super().__init__(output_dir, step, layout, rank, world)
        self.transport, self.tmp = transport, broadcast_staging_dir(output_dir, step)
        self.names = _shard_names(len(layout)) if names is None else names
        self._done: dict[int, tuple[str, str, list[str], int]] = {}

    def owner(self, index: int) -> int:
        return index % self.world

    def put(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        name = self.names[index]
        digest = write_shard(self.tmp / name, tensors, self.transport.checksum)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        self._done[index] = (name, digest, list(tensors), size)
        self.bytes_moved += size

    def skip(self, index: int, previous: int) -> None:
        name, before = self.names[index], broadcast_dir(self.output_dir, previous)
        manifest = json.loads((before / MANIFEST).read_text())
        if manifest["algorithm"] != self.transport.checksum or name not in manifest["files"]:
            raise WeightTransferError(f"{before} does not hold {name} as this update lays it out: cannot reuse it")
        os.link(before / name, self.tmp / name)  # same bytes, no copy; pruning the old step keeps this link
        self._done[index] = (
            name,
            manifest["files"][name],
            _shard_keys(self.tmp / name),
            sum(nbytes(s) for s in self.layout[index]),
        )

    def records(self) -> list[Any]:
        return [(i, *v) for i, v in sorted(self._done.items())]

    def finish(
        self, records: list[Any], args: ModelArgs, tokenizer: Tokenizer | None = None, fp8: bool = False
    ) -> Path:
        done = sorted(records)
        if [r[0] for r in done] != list(range(len(self.names))):
            raise WeightTransferError(
                f"publish of step {self.step}: shards {[r[0] for r in done]} written, {len(self.names)} expected"
            )
        if len(done) > 1:
            weight_map = {k: name for _, name, _, keys, _ in done for k in keys}
            total = sum(r[4] for r in done)
            (self.tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
            )
        files = {name: digest for _, name, digest, _, _ in done}
        (self.tmp / MANIFEST).write_text(json.dumps({"algorithm": self.transport.checksum, "files": files}, indent=1))
        final = _make_visible(self.output_dir, self.step)
        prune_published(self.output_dir, self.transport.keep)
        return final


class FilesystemTransport(WeightTransport):
    def __init__(
        self,
        keep: int = 3,
        timeout: float = 600.0,
        max_shard_gb: float = 0.5,
        verify: bool = True,
        threads: int = 4,
        checksum: str = "crc32",
        bucket_mb: float = 64.0,
    ) -> None:
        super().__init__(keep, timeout, bucket_mb)
        hasher(checksum)  # an unknown name fails here, not after the first shard is written
        self.checksum = checksum
        self.max_shard_bytes = int(max_shard_gb * 2**30)
        self.bucket_bytes = min(self.bucket_bytes, self.max_shard_bytes)  # one shard file per bucket
        self.verify, self.threads = verify, threads

    def whole_bucket_bytes(self) -> int:
        return self.max_shard_bytes  # the whole state is in memory already: shards as large as allowed

    def _put_all(self, pub: Publication, groups: list[dict[str, torch.Tensor]]) -> None:
        with ThreadPoolExecutor(max(1, min(self.threads, len(groups)))) as pool:
            list(pool.map(lambda i: pub.put(i, groups[i]), range(len(groups))))

    def prepare(
        self, output_dir: str | Path, step: int, args: ModelArgs, tokenizer: Tokenizer | None = None, fp8: bool = False
    ) -> None:
        _stage(output_dir, step, args, tokenizer, fp8)

    def begin(
        self,
        output_dir: str | Path,
        step: int,
        layout: list[list[TensorSpec]],
        rank: int = 0,
        world: int = 1,
        sent: list[bool] | None = None,
    ) -> Publication:
        return FilePublication(self, output_dir, step, layout, rank, world)

    def prepare_adapter(self, output_dir: str | Path, step: int, config: dict[str, Any]) -> None:
        """Like `prepare`, for a LoRA adapter version: the staging directory with `adapter_config.json`."""
        _stage_adapter(output_dir, step, config)

    def begin_adapter(self, output_dir: str | Path, step: int, spec: list[TensorSpec]) -> Publication:
        """Publishes an adapter version as one bucket, PEFT's `adapter_model.safetensors` (rank 0 writes it)."""
        return FilePublication(self, output_dir, step, [spec], 0, 1, [ADAPTER_WEIGHTS])

    def load(self, path: str | Path) -> dict[str, torch.Tensor]:
        return deadline_call(
            lambda: read_verified(Path(path), self.verify, self.threads), self.timeout, f"loading weights from {path}"
        )


# ---- NCCL ----


def read_nccl_layout(path: str | Path) -> tuple[int, list[list[TensorSpec]]]:
    """(version, buckets) of an NCCL step directory: what rank 0 broadcasts, bucket by bucket, in order."""
    spec_path = Path(path) / NCCL_SPEC
    if not spec_path.exists():
        raise WeightTransferError(f"{path} has no {NCCL_SPEC}: it was not published for NCCL transfer")
    spec = json.loads(spec_path.read_text())
    return int(spec["version"]), decode_specs(spec["buckets"])


def read_nccl_spec(path: str | Path) -> list[TensorSpec]:
    """Every tensor an NCCL update sends, in broadcast order."""
    return [s for bucket in read_nccl_layout(path)[1] for s in bucket]


class NCCLPublication(Publication):
    def __init__(
        self,
        transport: "NCCLTransport",
        output_dir: str | Path,
        step: int,
        layout: list[list[TensorSpec]],
        rank: int,
        world: int,
    ) -> None:
        super().__init__(output_dir, step, layout, rank, world)
        self.transport = transport
        self.comm = transport.group().begin(step) if rank == 0 else None

    def put(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        assert self.comm is not None, "NCCL buckets are sent by trainer rank 0"
        self.bytes_moved += send_buckets(self.comm, [list(tensors.values())], self.transport.device())

    def finish(
        self, records: list[Any], args: ModelArgs, tokenizer: Tokenizer | None = None, fp8: bool = False
    ) -> Path:
        assert self.comm is not None, "NCCL updates are finished by trainer rank 0"
        self.comm.barrier(f"weight update {self.step}: the receivers' confirmation")
        self.transport.group().finish(self.step)
        prune_published(self.output_dir, self.transport.keep)
        return broadcast_dir(self.output_dir, self.step)


class NCCLTransport(WeightTransport):
    """Trainer rank 0 is rank 0 of a group with every vLLM worker: one group per run, re-formed only when a
    worker restarted (arbor.weights.comm). `backend` "gloo" runs the same protocol on CPU."""

    def __init__(
        self,
        host: str,
        port: int,
        inference_ranks: int,
        keep: int = 3,
        timeout: float = 600.0,
        bucket_mb: float = 64.0,
        backend: str = "nccl",
    ) -> None:
        super().__init__(keep, timeout, bucket_mb)
        self.host, self.port, self.world, self.backend = host, port, inference_ranks + 1, backend
        self._group: SenderGroup | None = None

    def device(self) -> torch.device:
        if self.backend == "gloo":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise WeightTransferError("weights.kind = 'nccl' needs a CUDA device on trainer rank 0")
        return torch.device("cuda", torch.cuda.current_device())

    def group(self) -> SenderGroup:
        """The run's weight group (its store opens on the first update)."""
        if self._group is None:
            self._group = SenderGroup(self.host, self.port, self.world - 1, self.backend, self.timeout, self.device())
        return self._group

    def prepare(
        self, output_dir: str | Path, step: int, args: ModelArgs, tokenizer: Tokenizer | None = None, fp8: bool = False
    ) -> None:
        _stage(output_dir, step, args, tokenizer, fp8)

    def begin(
        self,
        output_dir: str | Path,
        step: int,
        layout: list[list[TensorSpec]],
        rank: int = 0,
        world: int = 1,
        sent: list[bool] | None = None,
    ) -> Publication:
        """Rank 0 makes the directory (the bucket list) visible, then waits for every receiver to join."""
        if rank == 0:
            buckets = [b for i, b in enumerate(layout) if sent is None or sent[i]]
            tmp = broadcast_staging_dir(output_dir, step)
            (tmp / NCCL_SPEC).write_text(
                json.dumps({"kind": "nccl", "version": step, "buckets": encode_specs(buckets)})
            )
            _make_visible(output_dir, step)
        return NCCLPublication(self, output_dir, step, layout, rank, world)

    def publish(
        self,
        output_dir: str | Path,
        step: int,
        state: dict[str, torch.Tensor],
        args: ModelArgs,
        tokenizer: Tokenizer | None = None,
        fp8: bool = False,
    ) -> Path:
        tensors = hf_state_dict(state, args, fp8)
        self.prepare(output_dir, step, args, tokenizer, fp8)
        groups = split_buckets(tensors, self.bucket_bytes)
        tmp = broadcast_staging_dir(output_dir, step)
        (tmp / NCCL_SPEC).write_text(
            json.dumps({"kind": "nccl", "version": step, "buckets": encode_specs([spec_of(g) for g in groups])})
        )
        final = _make_visible(output_dir, step)
        self._send(final, tensors)
        prune_published(output_dir, self.keep)
        return final

    def _send(self, final: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Sends a whole state over the group, bucket by bucket, and waits for the receivers' confirmation."""
        device = self.device()
        version = read_nccl_layout(final)[0]
        comm = self.group().begin(version)
        send_buckets(comm, [list(g.values()) for g in split_buckets(tensors, self.bucket_bytes)], device)
        comm.barrier(f"weight update {version}: the receivers' confirmation")
        self.group().finish(version)

    def load(self, path: str | Path) -> dict[str, torch.Tensor]:
        raise WeightTransferError(
            f"{path} was published for NCCL transfer: only vLLM workers (arbor.inference.vllm.worker) receive it; "
            "the local backend needs weights.kind = 'filesystem'"
        )


def make_transport(cfg: WeightTransportConfig, keep: int = 3) -> WeightTransport:
    if cfg.kind == "nccl":
        return NCCLTransport(cfg.nccl_host, cfg.nccl_port, cfg.nccl_inference_ranks, keep, cfg.timeout, cfg.bucket_mb)
    return FilesystemTransport(
        keep, cfg.timeout, cfg.max_shard_gb, cfg.verify_checksums, checksum=cfg.checksum, bucket_mb=cfg.bucket_mb
    )


def publish_weights(
    output_dir: str | Path,
    step: int,
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    tokenizer: Tokenizer | None = None,
    keep: int = 3,
) -> Path:
    """Filesystem publish with default settings (tests, tools)."""
    return FilesystemTransport(keep).publish(output_dir, step, state, args, tokenizer)
