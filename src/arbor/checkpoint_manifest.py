"""Checkpoints a resume can trust: every file's size and CRC-32 in a manifest, verified before anything loads.

A trainer checkpoint (`checkpoints/step_N/trainer/`) gets `manifest.json` (name -> size and checksum of every
shard and DCP's `.metadata`) after its shards and before `DONE`; the orchestrator's state beside it carries its own
checksum (arbor.orchestrator.state). `resume_step` walks the complete steps newest first and verifies each one
(files hashed in parallel threads, streamed in chunks, so a GiB costs about a second of one core per thread);
a damaged step (a checksum or size that does not match, a missing file, an unreadable state) is said in one line
naming the file and, with `ckpt.on_damage = "previous"`, moved aside to `step_N.damaged/` (never deleted) for the
next older step to be tried; with `"fail"` the resume stops on that line. The hashing is the one the published
weights use (arbor.weights.shards). Standard library only: the launcher verifies before it starts any process.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from arbor.models.family import UnsupportedArchitecture
from arbor.run_dir import (
    DISK_FULL_EXIT,
    DONE,
    PathLike,
    checkpoint_dir,
    completed_checkpoints,
    is_disk_full,
    orchestrator_state_path,
    set_aside,
    stop_line,
    write_text_atomic,
)

MANIFEST = "manifest.json"
"""Written into a trainer checkpoint directory after its shards, before `DONE`."""
CHUNK = 16 * 2**20
"""Bytes read and hashed at a time: a file of any size costs one buffer of memory."""
ON_DAMAGE = ("previous", "fail")


class CheckpointDamaged(RuntimeError):
    """A checkpoint failed verification (or its reader failed); the message is one line naming the file."""


class Crc32:
    """hashlib-shaped CRC-32 (zlib releases the GIL on large buffers): ~5x faster than sha256 on CPU."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def hasher(algorithm: str) -> Any:
    """A fresh hash object for `algorithm` ("crc32" or "sha256"); ValueError for any other name."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "crc32":
        return Crc32()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} in a manifest (sha256 or crc32)")


def file_digest(path: Path, algorithm: str = "crc32") -> tuple[int, str]:
    """(bytes read, checksum) of the file at `path`, streamed `CHUNK` bytes at a time."""
    h, size = hasher(algorithm), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _listed(directory: Path) -> list[str]:
    """The files a manifest covers: every plain file but the manifest, `DONE` and hidden temporaries."""
    skip = {MANIFEST, DONE}
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in skip and not _temp(p.name))


def _temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def write_manifest(directory: PathLike, algorithm: str = "crc32", threads: int = 4) -> dict[str, Any]:
    """Hashes every file of `directory` (in parallel) and writes `manifest.json` atomically; returns it."""
    directory = Path(directory)
    names = _listed(directory)
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        digests = list(pool.map(lambda n: file_digest(directory / n, algorithm), names))
    manifest = {"algorithm": algorithm, "files": {n: {"size": s, "checksum": c} for n, (s, c) in zip(names, digests)}}
    write_text_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: PathLike) -> dict[str, Any]:
    """The manifest of `directory`; CheckpointDamaged when it is missing or unreadable."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        manifest["files"].items()
        hasher(manifest["algorithm"])
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing: the checkpoint cannot be verified") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointDamaged(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    return manifest


def check_file(directory: Path, name: str, entry: dict[str, Any], algorithm: str) -> str | None:
    """What is wrong with one file against its manifest entry (one line), or None."""
    path = directory / name
    try:
        size, digest = file_digest(path, algorithm)
    except FileNotFoundError:
        return f"{path} is missing"
    if size != entry["size"]:
        return f"{path} holds {size} bytes, the manifest {entry['size']} (truncated or overwritten)"
    if digest != entry["checksum"]:
        return f"{path}: {algorithm} {digest} does not match the manifest's {entry['checksum']}"
    return None


def verify_files(directory: PathLike, names: list[str] | None = None, threads: int = 4) -> str | None:
    """Checks the files `names` of `directory` (all of its manifest's by default) in parallel: the first problem,
    one line, or None. Sharing the names out is how several ranks verify one checkpoint together."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    files, algorithm = manifest["files"], manifest["algorithm"]
    names = sorted(files) if names is None else names
    if not names:
        return None
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        problems = list(pool.map(lambda n: check_file(directory, n, files[n], algorithm), names))
    return next((p for p in problems if p is not None), None)


def verify_step(output_dir: PathLike, step: int, orchestrator: bool, threads: int = 4) -> str | None:
    """What is damaged in checkpoint `step` (its trainer files and, with `orchestrator`, the orchestrator state a
    resume at `step` reads), one line, or None when it is intact. A checkpoint written before manifests existed
    (`DONE` but no manifest: `DONE` now follows it) is taken as it is, DCP's reader its only check."""
    directory = checkpoint_dir(output_dir, step)
    if (directory / MANIFEST).exists() or not (directory / DONE).exists():
        try:
            problem = verify_files(directory, threads=threads)
        except CheckpointDamaged as e:
            return str(e)
        if problem is not None:
            return problem
    return verify_state_file(orchestrator_state_path(output_dir, step)) if orchestrator else None


def state_checksum(payload: dict[str, Any]) -> str:
    """The CRC-32 of a JSON state's canonical form (sorted keys, no spaces)."""
    h = Crc32()
    h.update(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def seal_state(payload: dict[str, Any]) -> str:
    """The text of a JSON state file that carries its own checksum (`verify_state_file` checks it)."""
    return json.dumps({"crc32": state_checksum(payload), "state": payload})


def open_state(path: Path) -> dict[str, Any]:
    """The state of a sealed JSON file; CheckpointDamaged (one line naming the file) when it is not intact."""
    try:
        sealed = json.loads(path.read_text())
        if isinstance(sealed, dict) and "crc32" not in sealed and "state" not in sealed:
            return sealed  # written before states were sealed: taken as it is
        payload, expected = sealed["state"], sealed["crc32"]
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    got = state_checksum(payload)
    if got != expected:
        raise CheckpointDamaged(f"{path}: crc32 {got} does not match the one it was written with, {expected}")
    return payload


def verify_state_file(path: Path) -> str | None:
    try:
        open_state(path)
    except CheckpointDamaged as e:
        return str(e)
    return None


def resume_step(
    output_dir: PathLike, on_damage: str, orchestrator: bool, say: Callable[[str], None], threads: int = 4
) -> int | None:
    """The newest complete checkpoint that verifies, or None. A damaged newer one is said in one line and moved
    aside (`on_damage = "previous"`), or raises CheckpointDamaged (`"fail"`)."""
    if on_damage not in ON_DAMAGE:
        raise ValueError(f"ckpt.on_damage: {on_damage!r} is not one of {', '.join(ON_DAMAGE)}")
    for step in reversed(completed_checkpoints(output_dir)):
        problem = verify_step(output_dir, step, orchestrator, threads)
        if problem is None:
            return step
        if on_damage == "fail":
            raise CheckpointDamaged(f"checkpoint step {step} is damaged: {problem} (ckpt.on_damage = 'fail')")
        aside = set_aside(output_dir, step)
        say(f"checkpoint step {step} is damaged: {problem}; moved to {aside}, resuming from the previous one")
    return None


def stop_cleanly(work: Callable[[], int], speak: bool = True) -> int:
    """Runs a process's `work`; a damaged checkpoint (exit 1), a full disk (exit `DISK_FULL_EXIT`) or a model the
    process cannot build (`UnsupportedArchitecture`, found when it is built: exit 2, as a config error) ends it with
    one line, `arbor.run_dir.stop_line` (printed when `speak`: rank 0 of the trainer), that `rl` shows as is."""
    try:
        return work()
    except CheckpointDamaged as e:
        code, error = 1, e
    except UnsupportedArchitecture as e:
        code, error = 2, e
    except Exception as e:
        if not is_disk_full(e):
            raise
        code, error = DISK_FULL_EXIT, e
    if speak:
        print(stop_line(error), file=sys.stderr, flush=True)
    return code
