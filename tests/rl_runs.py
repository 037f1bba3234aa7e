"""The quick start as tests run it: `rl @ examples/reverse_text/rl.toml` with a test's overrides, from the
repository root, in a subprocess whose output the test reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/reverse_text/rl.toml"


def run_example(*args: str, timeout: float = 1100) -> subprocess.CompletedProcess[str]:
    """`rl @ examples/reverse_text/rl.toml *args` (later `@` files and flags win over the example's keys)."""
    argv = [sys.executable, "-m", "arbor.launch.rl", "@", EXAMPLE, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def check_ran(res: subprocess.CompletedProcess[str]) -> None:
    """Fails with the ends of the run's stderr and stdout unless it exited 0."""
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
