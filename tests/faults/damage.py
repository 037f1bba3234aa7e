"""How the checkpoint-trust tests damage a file the way a disk or a network filesystem would: bytes inverted in
the middle, the size unchanged (tests/e2e/test_ckpt_trust_e2e.py, and the broadcast faults of sitecustomize.py)."""

from __future__ import annotations

from pathlib import Path


def invert_middle(path: Path, n: int = 4096) -> None:
    """Inverts `n` bytes in the middle of the file at `path`, in place."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(data)
