"""`rl` starts its processes only after its own imports, config and preflight: it keeps them light (no torch, no
aiohttp, whose import was a fifth of `rl`'s CPU seconds before its first child started)."""

from __future__ import annotations

import subprocess
import sys


def test_rl_imports_neither_torch_nor_aiohttp_nor_transformers() -> None:
    code = (
        "import sys, arbor.launch.rl; "
        "heavy = sorted({'torch', 'aiohttp', 'transformers'} & set(sys.modules)); "
        "assert not heavy, f'arbor.launch.rl imported {heavy}'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
