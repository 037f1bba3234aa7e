"""Preparation for the GPU evidence kit, run on a networked machine: downloads the wheels arbor needs that a GPU
host with its own torch lacks into `.gpu-wheels/` (ignored by git; it travels with the tree to the host, where
`scripts/gpu_check.sh` installs it with no network).

Which packages: arbor's locked runtime dependencies (`uv export --frozen`, no dev group) for the host's Python and
platform (CPython 3.12, x86-64 Linux), less the big binaries a GPU image brings itself (torch, triton, nvidia-*,
cuda-*, vLLM) and the compiled packages such images carry (numpy, safetensors, tokenizers, aiohttp's, ...):
pure-Python wheels (`py3-none-any`) are taken, compiled ones only where `CARRY_COMPILED` names them. Each wheel
is fetched from the URL uv.lock records and checked against its sha256. The folder must stay under 64 MiB (what a
device run carries): the script fails loudly past it.

    uv run python scripts/gpu_prepare.py [--dest .gpu-wheels] [--python 3.12]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

from packaging.markers import Marker

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 1024 * 1024
NEVER = re.compile(r"^(torch|triton|vllm.*|nvidia-.*|cuda-.*|xformers|flashinfer.*|deep-?gemm|deep-?ep)$")
"""Big binaries the GPU host brings in its own build (torch 2.11 there) or that arbor's GPU runs do without."""
CARRY_COMPILED = {"pydantic-core"}
"""Compiled packages taken although compiled: the host's image lacks them (pydantic's core, ~2 MB)."""
EXTRA = ["pytest-timeout"]
"""Dev packages the kit's `pytest -m gpu` needs beyond the runtime ones (taken when pure Python)."""


def host_env(python: str) -> dict[str, str]:
    """Marker environment of the GPU host's interpreter."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def pinned(requirements: str, python: str) -> dict[str, str]:
    """`name -> version` of the `uv export` lines whose markers hold on the host."""
    out: dict[str, str] = {}
    for line in requirements.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        spec, _, marker = line.partition(";")
        name, _, version = spec.strip().partition("==")
        if marker.strip() and not Marker(marker.strip()).evaluate(host_env(python)):
            continue
        out[name.strip().lower()] = version.strip()
    return out


def wheel_for(lock: dict, name: str, version: str, python: str) -> dict | None:
    """The uv.lock wheel entry ({url, hash, size}) to carry for `name==version`, or None when it is not carried:
    a big binary, or compiled without being in `CARRY_COMPILED`."""
    if NEVER.match(name):
        return None
    pkg = next((p for p in lock["package"] if p["name"] == name and p["version"] == version), None)
    if pkg is None:
        raise ValueError(f"uv.lock has no {name}=={version}")
    wheels = pkg.get("wheels", [])
    pure = [w for w in wheels if w["url"].endswith("-none-any.whl")]
    if pure:
        return pure[0]
    if name not in CARRY_COMPILED:
        return None
    tag = f"-cp{python.replace('.', '')}-"
    built = [w for w in wheels if tag in w["url"] and "manylinux" in w["url"] and "x86_64" in w["url"]]
    if not built:
        raise ValueError(f"uv.lock has no CPython {python} manylinux x86-64 wheel of {name}=={version}")
    return built[0]


def select(lock: dict, requirements: str, python: str) -> dict[str, dict]:
    """Wheel file name -> its uv.lock entry, for every package the host needs carried."""
    chosen = {}
    for name, version in sorted(pinned(requirements, python).items()):
        wheel = wheel_for(lock, name, version, python)
        if wheel is not None:
            chosen[wheel["url"].rsplit("/", 1)[1]] = wheel
    return chosen


def export(extra: list[str]) -> str:
    """`uv export` of the runtime dependencies, plus the `extra` packages at their locked versions."""
    base = ["uv", "export", "--frozen", "--no-hashes", "--no-emit-project", "--no-default-groups"]
    runtime = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    dev = subprocess.run([*base, "--only-group", "dev"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    keep = [line for line in dev.splitlines() if line.split("==")[0].strip().lower() in extra]
    return runtime + "\n".join(keep) + "\n"


def fetch(url: str, sha256: str, dest: Path) -> None:
    with urllib.request.urlopen(url, timeout=120) as r:
        data = r.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{url}: sha256 {digest} != uv.lock's {sha256}")
    dest.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    p.add_argument("--python", default="3.12", help="the GPU host's Python (major.minor)")
    a = p.parse_args(argv)
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    chosen = select(lock, export(EXTRA), a.python)
    shutil.rmtree(a.dest, ignore_errors=True)
    a.dest.mkdir(parents=True)
    for fname, wheel in chosen.items():
        fetch(wheel["url"], wheel["hash"].removeprefix("sha256:"), a.dest / fname)
    total = sum(f.stat().st_size for f in a.dest.iterdir())
    print(f"{len(chosen)} wheels, {total / 2**20:.1f} MiB in {a.dest}")
    if total >= LIMIT_BYTES:
        print(f"error: {a.dest} holds {total / 2**20:.1f} MiB, over the 64 MiB a device run carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
