"""Safetensors shard files of a published step directory: written straight from tensor memory and read back
into one buffer per file, each hashed on the way (crc32 or sha256) against the step's manifest.

Writing builds no serialized copy of a shard; reading returns tensors that view the file's buffer. Hashing runs
in a helper thread over the chunk just written or read while the next one moves (hashlib, zlib and file I/O
release the GIL). The files are ordinary safetensors.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from arbor import checkpoint_manifest
from arbor.run_dir import room_for
from arbor.weights.comm import WeightTransferError

MANIFEST = "manifest.json"
NCCL_SPEC = "transport.json"
INDEX = "model.safetensors.index.json"

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}
_CHUNK = 32 * 2**20  # bytes hashed in one thread while the next are written/read in another


def hasher(algorithm: str) -> Any:
    """The checkpoints' hash objects (arbor.checkpoint_manifest), an unknown name a WeightTransferError."""
    try:
        return checkpoint_manifest.hasher(algorithm)
    except ValueError as e:
        raise WeightTransferError(str(e)) from None


def write_shard(path: Path, tensors: dict[str, torch.Tensor], algorithm: str = "crc32") -> str:
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
    h = hasher(algorithm)
    chunks = [memoryview(len(head).to_bytes(8, "little")), memoryview(head)]
    for v in views:
        mv = memoryview(v.numpy())
        chunks += [mv[i : i + _CHUNK] for i in range(0, len(mv), _CHUNK)]
    with room_for(path, 8 + len(head) + at), open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        pending = None
        for chunk in chunks:  # hash chunk i while writing it: both release the GIL
            if pending is not None:
                pending.result()
            pending = pool.submit(h.update, chunk)
            f.write(chunk)
        if pending is not None:
            pending.result()
    return h.hexdigest()


def read_shard(path: Path, expected: str | None, algorithm: str = "crc32") -> dict[str, torch.Tensor]:
    """Reads one safetensors file into one buffer, checks its checksum, and returns tensors viewing that buffer."""
    size = path.stat().st_size
    buf = bytearray(size)
    h = hasher(algorithm)
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as pool:
        view, got, pending = memoryview(buf), 0, None
        while got < size:  # hash the chunk just read while reading the next one
            n = f.readinto(view[got : got + _CHUNK])
            if not n:
                raise WeightTransferError(f"{path}: file ended after {got} of {size} bytes")
            if expected is not None:
                if pending is not None:
                    pending.result()
                pending = pool.submit(h.update, view[got : got + n])
            got += n
        if pending is not None:
            pending.result()
    if expected is not None:
        digest = h.hexdigest()
        if digest != expected:
            raise WeightTransferError(
                f"{path}: {algorithm} {digest[:12]}... does not match the manifest "
                f"({expected[:12]}...): the copy is corrupted or incomplete"
            )
    try:
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightTransferError(f"{path}: not a safetensors file ({e})") from None
    data = torch.frombuffer(buf, dtype=torch.uint8)[8 + n :] if size > 8 + n else torch.empty(0, dtype=torch.uint8)
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
        return read_shard(path / name, manifest[name] if verify and manifest is not None else None, algorithm)

    state: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        for part in pool.map(one, files):
            state.update(part)
    return state
