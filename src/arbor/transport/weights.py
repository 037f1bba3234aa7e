"""Weight transfer from the trainer to the inference fleet, behind one small interface (`WeightTransport`).

Every version N (the weights after N optimizer steps; 0 is the initial model) gets a step directory
`broadcasts/step_N/`, written under a temporary name and renamed into place with `STABLE` written last, so a
directory with `STABLE` is always complete, and the newest `keep` are retained so disks do not fill (the layout,
the listing and the retention are arbor.run_dir's). The
orchestrator watches these directories and tells the fleet to load one (`/update_weights {path, version}`);
what the directory holds depends on the implementation:

- `FilesystemTransport`: a Hugging Face checkpoint: config.json, safetensors shards of at most
  `max_shard_gb` (with `model.safetensors.index.json` when there are several) and `manifest.json` with each
  shard's checksum (crc32 by default, ~5x cheaper than the sha256 option), verified on load (a torn or corrupted copy fails loudly instead of loading garbage).
  Shards are written straight from the tensors' memory and hashed on the way out, several at once (hashlib and
  file I/O release the GIL); loading reads each shard once into one buffer, hashes it, and returns tensors
  that view that buffer (no deserialization copy). The files are ordinary safetensors.
- `NCCLTransport` (GPU, vLLM backend): `transport.json` lists (name, dtype, shape) of every tensor; the
  trainer's rank 0 then broadcasts the tensors in that order over a vLLM `StatelessProcessGroup` +
  `PyNcclCommunicator` to the vLLM workers, which join in through the worker extension
  (`arbor.inference.vllm_worker`). vLLM is imported lazily, only on this path.

Both fail with `WeightTransferTimeout` after `timeout` seconds rather than hang (waiting for `STABLE`, for the
NCCL group to form, or for a broadcast to finish).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
import zlib
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch

from arbor.config.transport import WeightTransportConfig
from arbor.models.args import ModelArgs
from arbor.models.hf import hf_config, hf_state_dict
from arbor.run_dir import STABLE, broadcast_dir, broadcast_staging_dir, prune_published

MANIFEST = "manifest.json"
NCCL_SPEC = "transport.json"
INDEX = "model.safetensors.index.json"
T = TypeVar("T")


class WeightTransferError(RuntimeError):
    """A step directory that cannot be loaded (incomplete, corrupted, or of the wrong kind)."""


class WeightTransferTimeout(WeightTransferError, TimeoutError):
    """A publish or load that did not finish within the configured timeout."""


class WeightTransport(ABC):
    """Trainer side: `publish` (rank 0 only). Inference side: `load` (the local engine, vLLM's workers)."""

    def __init__(self, keep: int = 3, timeout: float = 600.0) -> None:
        self.keep, self.timeout = keep, timeout

    def publish(self, output_dir: str | Path, step: int, state: dict[str, torch.Tensor], args: ModelArgs,
                tokenizer: Any = None, fp8: bool = False) -> Path:
        """Writes `broadcasts/step_{step}/` atomically (STABLE last), sends the tensors, prunes old steps.
        `fp8`: DeepSeek's FP8 checkpoint format (float8 weights + `weight_scale_inv`, `quantization_config`)."""
        final = broadcast_dir(output_dir, step)
        tmp = broadcast_staging_dir(output_dir, step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(hf_config(args, fp8), indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
        tensors = hf_state_dict(state, args, fp8)
        _deadline_call(lambda: self._write(tmp, tensors), self.timeout, f"writing weights to {tmp}")
        (tmp / STABLE).write_text(str(step))
        if final.exists():  # a resumed run republishes the step it resumed from
            shutil.rmtree(final)
        tmp.rename(final)
        self._send(final, tensors)
        prune_published(output_dir, self.keep)
        return final

    @abstractmethod
    def _write(self, tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Writes the implementation's files into the step directory before it becomes visible."""

    def _send(self, final: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Pushes the tensors once the directory is visible (NCCL); the filesystem has nothing more to do."""

    @abstractmethod
    def load(self, path: str | Path) -> dict[str, torch.Tensor]:
        """Every tensor of a published step directory, checked; raises WeightTransferError."""


def _deadline_call(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Runs `fn` in a daemon thread; raises WeightTransferTimeout if it is not done in `timeout` seconds.

    A collective that never completes cannot be cancelled from Python, but the caller learns of it and fails
    (the process then exits, which tears the communicator down) instead of waiting forever.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"arbor-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise WeightTransferTimeout(f"{what} did not finish within {timeout:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


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

def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}
_CHUNK = 32 * 2**20  # bytes hashed in one thread while the next are written/read in another


class _Crc32:
    """hashlib-shaped CRC-32 (zlib releases the GIL on large buffers): ~5x faster than sha256 on CPU."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hasher(algorithm: str) -> Any:
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "crc32":
        return _Crc32()
    raise WeightTransferError(f"unknown checksum algorithm {algorithm!r} in a manifest (sha256 or crc32)")


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], algorithm: str = "crc32") -> str:
    """Writes one safetensors file straight from the tensors' memory, hashing as it goes; returns the checksum.

    No serialized copy of the shard is built (unlike `safetensors.torch.save`), so a 1 GB model costs one pass
    of hashing that overlaps with other shards' writes (hashlib and file writes release the GIL)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    views, at = [], 0
    for name, t in tensors.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + raw.numel()]}
        views.append(raw)
        at += raw.numel()
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    h = _hasher(algorithm)
    chunks = [memoryview(len(head).to_bytes(8, "little")), memoryview(head)]
    for v in views:
        mv = memoryview(v.numpy())
        chunks += [mv[i:i + _CHUNK] for i in range(0, len(mv), _CHUNK)]
    with open(path, "wb") as f, ThreadPoolExecutor(1) as hasher:
        pending = None
        for chunk in chunks:  # hash chunk i while writing it: both release the GIL
            if pending is not None:
                pending.result()
            pending = hasher.submit(h.update, chunk)
            f.write(chunk)
        if pending is not None:
            pending.result()
    return h.hexdigest()


def _read_shard(path: Path, expected: str | None, algorithm: str = "crc32") -> dict[str, torch.Tensor]:
    """Reads one safetensors file into one buffer, checks its checksum, and returns tensors viewing that buffer."""
    size = path.stat().st_size
    buf = bytearray(size)
    h = _hasher(algorithm)
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as hasher:
        view, got, pending = memoryview(buf), 0, None
        while got < size:  # hash the chunk just read while reading the next one
            n = f.readinto(view[got:got + _CHUNK])
            if not n:
                raise WeightTransferError(f"{path}: file ended after {got} of {size} bytes")
            if expected is not None:
                if pending is not None:
                    pending.result()
                pending = hasher.submit(h.update, view[got:got + n])
            got += n
        if pending is not None:
            pending.result()
    if expected is not None:
        digest = h.hexdigest()
        if digest != expected:
            raise WeightTransferError(f"{path}: {algorithm} {digest[:12]}... does not match the manifest "
                                      f"({expected[:12]}...): the copy is corrupted or incomplete")
    try:
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightTransferError(f"{path}: not a safetensors file ({e})") from None
    data = torch.frombuffer(buf, dtype=torch.uint8)[8 + n:] if size > 8 + n else torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        dtype = _ST_TORCH[meta["dtype"]]
        raw = data[start:end]
        if (8 + n + start) % dtype.itemsize:  # a misaligned view is not allowed: copy this one tensor
            raw = raw.clone()
        out[name] = raw.view(dtype).reshape(meta["shape"])
    return out


class FilesystemTransport(WeightTransport):
    def __init__(self, keep: int = 3, timeout: float = 600.0, max_shard_gb: float = 0.5, verify: bool = True,
                 threads: int = 4, checksum: str = "crc32") -> None:
        super().__init__(keep, timeout)
        _hasher(checksum)  # an unknown name fails here, not after the first shard is written
        self.checksum = checksum
        self.max_shard_bytes = int(max_shard_gb * 2**30)
        self.verify, self.threads = verify, threads

    def _write(self, tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
        shards = _shards(tensors, self.max_shard_bytes)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        with ThreadPoolExecutor(min(self.threads, len(shards))) as pool:
            digests = list(pool.map(lambda a: _write_shard(tmp / a[0], a[1], self.checksum), zip(names, shards)))
        if len(shards) > 1:
            weight_map = {k: n for n, shard in zip(names, shards) for k in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / MANIFEST).write_text(json.dumps({"algorithm": self.checksum, "files": dict(zip(names, digests))}, indent=1))

    def load(self, path: str | Path) -> dict[str, torch.Tensor]:
        return _deadline_call(lambda: self._load(Path(path)), self.timeout, f"loading weights from {path}")

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        return read_verified(path, self.verify, self.threads)


def read_verified(path: str | Path, verify: bool = True, threads: int = 4) -> dict[str, torch.Tensor]:
    """Reads a checkpoint directory; with a manifest, every shard's checksum must match (when `verify`)."""
    path = Path(path)
    if not path.is_dir():
        raise WeightTransferError(f"weights directory {path} does not exist")
    if (path / NCCL_SPEC).exists():
        raise WeightTransferError(f"{path} was published for NCCL transfer and holds no tensors")
    meta = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).exists() else {}
    manifest, algorithm = meta.get("files"), meta.get("algorithm", "sha256")
    if manifest is not None:
        files = sorted(manifest)
    elif (path / INDEX).exists():
        files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise WeightTransferError(f"no .safetensors files in {path}")

    def one(name: str) -> dict[str, torch.Tensor]:
        return _read_shard(path / name, manifest[name] if verify and manifest is not None else None, algorithm)

    state: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        for part in pool.map(one, files):
            state.update(part)
    return state


# ---- NCCL ----

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                        torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def nccl_spec(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
    """The broadcast order: (name, dtype, shape) per tensor; both sides allocate and receive in this order."""
    return [(k, str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in tensors.items()]


def read_nccl_spec(path: str | Path) -> list[tuple[str, torch.dtype, list[int]]]:
    spec_path = Path(path) / NCCL_SPEC
    if not spec_path.exists():
        raise WeightTransferError(f"{path} has no {NCCL_SPEC}: it was not published for NCCL transfer")
    spec = json.loads(spec_path.read_text())
    return [(name, _DTYPES[dtype], shape) for name, dtype, shape in spec["tensors"]]


def init_nccl_group(host: str, port: int, rank: int, world_size: int, device: Any, timeout: float) -> Any:
    """A vLLM PyNccl communicator over a StatelessProcessGroup (no torch.distributed world needed)."""
    try:  # vLLM is the optional `gpu` extra, needed on this path only
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as e:
        raise WeightTransferError(f"weights.kind = 'nccl' needs vLLM (the `gpu` extra): {e}") from None

    def make() -> Any:
        pg = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                          store_timeout=int(timeout))
        return PyNcclCommunicator(pg, device=device)

    return _deadline_call(make, timeout, f"joining the NCCL weight group at {host}:{port} as rank {rank}/{world_size}")


def nccl_receive(comm: Any, spec: list[tuple[str, torch.dtype, list[int]]], device: Any,
                 timeout: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side (a vLLM worker): yields (name, tensor) as each broadcast from rank 0 lands."""
    cuda = torch.device(device).type == "cuda"
    for name, dtype, shape in spec:
        buf = torch.empty(shape, dtype=dtype, device=device)

        def recv(buf: torch.Tensor = buf) -> None:
            stream = torch.cuda.current_stream() if cuda else None
            comm.broadcast(buf, src=0, stream=stream)
            if stream is not None:
                stream.synchronize()

        _deadline_call(recv, timeout, f"receiving {name} over NCCL")
        yield name, buf


class NCCLTransport(WeightTransport):
    """Trainer rank 0 is rank 0 of a group with every vLLM worker; the group forms on the first publish."""

    def __init__(self, host: str, port: int, inference_ranks: int, keep: int = 3, timeout: float = 600.0) -> None:
        super().__init__(keep, timeout)
        self.host, self.port, self.world = host, port, inference_ranks + 1
        self._comm: Any = None

    def _write(self, tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
        (tmp / NCCL_SPEC).write_text(json.dumps({"kind": "nccl", "tensors": nccl_spec(tensors)}))

    def _send(self, final: Path, tensors: dict[str, torch.Tensor]) -> None:
        if not torch.cuda.is_available():
            raise WeightTransferError("weights.kind = 'nccl' needs a CUDA device on trainer rank 0")
        device = torch.device("cuda", torch.cuda.current_device())
        if self._comm is None:  # the workers join when the fleet first loads an NCCL step directory
            self._comm = init_nccl_group(self.host, self.port, 0, self.world, device, self.timeout)
        for name, t in tensors.items():
            buf = t.to(device, non_blocking=True).contiguous()

            def send(buf: torch.Tensor = buf) -> None:
                self._comm.broadcast(buf, src=0, stream=torch.cuda.current_stream())
                torch.cuda.current_stream().synchronize()

            _deadline_call(send, self.timeout, f"broadcasting {name} over NCCL")

    def load(self, path: str | Path) -> dict[str, torch.Tensor]:
        raise WeightTransferError(
            f"{path} was published for NCCL transfer: only vLLM workers (arbor.inference.vllm_worker) receive it; "
            "the local backend needs weights.kind = 'filesystem'"
        )


def make_transport(cfg: WeightTransportConfig, keep: int = 3) -> WeightTransport:
    if cfg.kind == "nccl":
        return NCCLTransport(cfg.nccl_host, cfg.nccl_port, cfg.nccl_inference_ranks, keep, cfg.timeout)
    return FilesystemTransport(keep, cfg.timeout, cfg.max_shard_gb, cfg.verify_checksums, checksum=cfg.checksum)


def publish_weights(output_dir: str | Path, step: int, state: dict[str, torch.Tensor], args: ModelArgs,
                    tokenizer: Any = None, keep: int = 3) -> Path:
    """Filesystem publish with default settings (tests, tools)."""
    return FilesystemTransport(keep).publish(output_dir, step, state, args, tokenizer)
