"""`rl @ examples/reverse_text/rl.toml --inference.backend vllm` on CPU, shortened for CI: SFT warm-up, then
RL (on-policy here, so each step checks the weights vLLM loaded) with vLLM's server behind arbor's proxy, loading every
published step from the filesystem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arbor.monitor.metrics import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLE = Path(__file__).parents[2] / "examples" / "reverse_text" / "rl.toml"


def test_reverse_text_with_the_vllm_backend(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbor.launch.rl",
            "@",
            str(EXAMPLE),
            "--inference.backend",
            "vllm",
            "--output-dir",
            str(out),
            "--max-steps",
            "4",
            "--sft.steps",
            "10",
            "--orchestrator.batch-size",
            "32",
            "--orchestrator.scheduler.mode",
            "sync",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        # On-policy (scheduler.mode sync): every step's rollouts come from the weights the trainer starts the step
        # with, loaded into vLLM from the published directory, so trainer and vLLM agree (fp32).
        assert r["staleness/max"] == 0 and r["mismatch_kl"] < 1e-3, r
    assert "vLLM" in (out / "logs" / "inference.log").read_text()
    assert (out / "broadcasts" / "step_4" / "STABLE").exists()
