"""scripts/install_deep_kernels.sh: valid bash, and its --dry-run prints the plan without changing anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_deep_kernels.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_prints_the_plan(tmp_path):
    res = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--src", str(tmp_path / "src"), "--deepep-ref", "abc123"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=SCRIPT.parents[1],
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for line in (
        "-- DeepGEMM @ ",
        "-- DeepEP @ abc123",
        "git -C",
        "--no-build-isolation",
        "nvidia-nvshmem-cu",
        "dry run: nothing was changed",
    ):
        assert line in out, f"{line!r} missing from:\n{out}"
    assert not (tmp_path / "src").exists(), "a dry run must not create anything"
    bad = subprocess.run(["bash", str(SCRIPT), "--only", "nccl"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--only must be deepgemm or deepep" in bad.stderr
