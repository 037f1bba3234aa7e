"""What verifying a checkpoint costs a resume: seconds per GiB of `arbor.checkpoint_manifest.verify_files`.

A checkpoint directory of `--files` shard files, `--mib` MiB in all (random bytes), gets its manifest written
(`write_manifest`: size + CRC-32 of every file) and is then verified `--repeats` times with 1 and `--threads`
threads; a plain read of the same files (no hashing) is timed beside it, the floor any check that reads every
byte pays. The files were just written, so they are read from the page cache: the figure is the hashing's cost,
not the disk's (a cold read adds the disk's own seconds per GiB, which the load that follows pays anyway).
Reported: seconds per GiB to verify (the fastest repeat, `--threads` threads), with 1 thread, of a plain read,
and of writing the manifest. Target: verification under 1 s/GiB, small against loading the same state.

    uv run python benchmarks/ckpt_verify.py [--mib 1024] [--files 8] [--threads 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from smoke import parse_args

from arbor.checkpoint_manifest import CHUNK, verify_files, write_manifest

TARGET_S_PER_GIB = 1.0


def write_files(root: Path, mib: int, files: int) -> int:
    """`files` files of random bytes, `mib` MiB in all; returns the bytes written."""
    per = mib * 2**20 // files
    block = os.urandom(min(per, CHUNK)) or b"\0"
    for i in range(files):
        with open(root / f"__{i}_0.distcp", "wb") as f:
            left = per
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
    return per * files


def read_all(root: Path, threads: int) -> None:
    def one(p: Path) -> None:
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(CHUNK)
            while f.readinto(buf):
                pass

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, sorted(root.glob("*.distcp"))))


def fastest(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB")
    ap.add_argument("--files", type=int, default=8, help="shard files (one per rank, as DCP writes them)")
    ap.add_argument("--threads", type=int, default=4, help="threads verifying in parallel")
    ap.add_argument("--repeats", type=int, default=3)
    a = parse_args(ap, mib=8, files=2, repeats=1)
    root = Path(tempfile.mkdtemp(prefix="arbor-bench-ckpt-", dir="/tmp"))
    try:
        gib = write_files(root, a.mib, a.files) / 2**30
        t0 = time.perf_counter()
        write_manifest(root, threads=a.threads)
        manifest_s = time.perf_counter() - t0
        read_s = fastest(lambda: read_all(root, a.threads), a.repeats)
        one_s = fastest(lambda: verify_files(root, threads=1), a.repeats)
        many_s = fastest(lambda: verify_files(root, threads=a.threads), a.repeats)
        assert verify_files(root) is None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    value = many_s / gib
    print(
        f"{a.mib} MiB in {a.files} files: verify {value:.3f} s/GiB with {a.threads} threads, "
        f"{one_s / gib:.3f} with 1; plain read {read_s / gib:.3f}; manifest written at {manifest_s / gib:.3f} "
        f"s/GiB (page cache warm; {os.cpu_count()} cores on this machine)"
    )
    result = {
        "benchmark": "ckpt_verify",
        "value": round(value, 4),
        "target": TARGET_S_PER_GIB,
        "ok": value <= TARGET_S_PER_GIB,
        "verify_s_per_gib_1_thread": round(one_s / gib, 4),
        "read_s_per_gib": round(read_s / gib, 4),
        "manifest_s_per_gib": round(manifest_s / gib, 4),
        "mib": a.mib,
        "threads": a.threads,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
