"""Filesystem weight transfer throughput: publish + load of a ~1 GB model as a ratio of a raw copy.

The raw baseline writes the same tensor bytes to one file (flushed) and reads them back: the least any
filesystem transfer must do. `FilesystemTransport` additionally serializes safetensors, hashes every shard
(crc32 by default, on publish and again on load; the sha256 option is measured too), writes config/manifest/STABLE and
renames atomically. Target: the
ratio raw_seconds / transport_seconds >= 0.7. Files go under /tmp and are removed.

    uv run python benchmarks/weights.py [--gb 1.0] [--shard-gb 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from smoke import parse_args

from arbor.models.presets import PRESETS
from arbor.weights.transport import FilesystemTransport

TARGET = 0.7


def synthetic_state(gb: float) -> dict[str, torch.Tensor]:
    """Qwen-like bf16 matrices (2048 x 2048 per projection) adding up to `gb` GiB."""
    per = 2048 * 2048 * 2
    n = max(1, int(gb * 2**30 // per))
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i // 7}.w{i % 7}.weight": torch.randn(2048, 2048, generator=g).to(torch.bfloat16)
        for i in range(n)
    }


def raw_copy(state: dict[str, torch.Tensor], root: Path) -> float:
    t0 = time.perf_counter()
    path = root / "raw.bin"
    with open(path, "wb") as f:
        for t in state.values():
            f.write(t.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    data = path.read_bytes()
    seconds = time.perf_counter() - t0
    assert len(data) == sum(t.numel() * t.element_size() for t in state.values())
    return seconds


def transport_copy(state: dict[str, torch.Tensor], root: Path, shard_gb: float, checksum: str) -> float:
    args = PRESETS["qwen3-small"]
    t = FilesystemTransport(keep=1, max_shard_gb=shard_gb, checksum=checksum)
    t0 = time.perf_counter()
    path = t.publish(root / "run", 1, state, args)
    for f in path.glob("*.safetensors"):  # the same durability as the raw baseline
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    loaded = t.load(path)
    seconds = time.perf_counter() - t0
    assert loaded.keys() == state.keys()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--shard-gb", type=float, default=0.5)  # the config default (weights.max_shard_gb)
    ap.add_argument("--repeats", type=int, default=3)
    a = parse_args(ap, gb=0.02, shard_gb=0.01, repeats=1)
    state = synthetic_state(a.gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="arbor-bench-weights-", dir="/tmp"))
    try:
        raw, fs, crc = [], [], []
        for _ in range(a.repeats):  # alternate so page-cache state and machine load favour none
            raw.append(raw_copy(state, root))
            (root / "raw.bin").unlink()
            fs.append(transport_copy(state, root, a.shard_gb, "crc32"))
            shutil.rmtree(root / "run")
            crc.append(transport_copy(state, root, a.shard_gb, "sha256"))
            shutil.rmtree(root / "run")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw_s, fs_s, sha_s = min(raw), min(fs), min(crc)
    ratio = raw_s / fs_s
    print(
        f"raw copy {nbytes / raw_s / 2**30:.2f} GiB/s, publish+load {nbytes / fs_s / 2**30:.2f} GiB/s (crc32, the "
        f"default), {nbytes / sha_s / 2**30:.2f} GiB/s (sha256)"
    )
    print(
        json.dumps(
            {
                "benchmark": "weights",
                "value": round(ratio, 3),
                "target": TARGET,
                "ok": ratio >= TARGET,
                "unit": "raw_seconds / publish_load_seconds",
                "gib": round(nbytes / 2**30, 3),
                "raw_seconds": round(raw_s, 3),
                "publish_load_seconds": round(fs_s, 3),
                "shard_gb": a.shard_gb,
                "checksum": "crc32",
                "sha256_ratio": round(raw_s / sha_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
