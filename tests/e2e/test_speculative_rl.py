"""End-to-end `rl` on CPU with MTP drafts: speculative decoding leaves mismatch_kl as it is without it (same seed,
synchronous), the drafts train online (draft/kl) and the run's metrics carry the acceptance figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arbor.monitor.metrics import read_jsonl

pytestmark = pytest.mark.slow

RUN = [
    "--model.name",
    "qwen3-test-mtp",
    "--seq-len",
    "48",
    "--max-steps",
    "3",
    "--seed",
    "0",
    "--orchestrator.scheduler.mode",
    "sync",
    "--orchestrator.batch-size",
    "16",
    "--orchestrator.group-size",
    "4",
    "--orchestrator.sampling.max-tokens",
    "8",
    "--orchestrator.environment.args",
    "{ min_len = 2, max_len = 5, num_tasks = 200 }",
    "--trainer.num-threads",
    "1",
    "--inference.num-threads",
    "1",
    "--inference.max-batch-size",
    "32",
]


def _run(out: Path, *extra: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "--output-dir", str(out), *RUN, *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return read_jsonl(out / "metrics.jsonl")


def test_speculative_decoding_leaves_mismatch_kl_unchanged(tmp_path):
    plain = _run(tmp_path / "plain")
    spec = _run(
        tmp_path / "spec", "--inference.speculative.enabled", "true", "--inference.speculative.draft-tokens", "3"
    )
    assert [r["step"] for r in plain] == [r["step"] for r in spec] == [0, 1, 2]
    for a, b in zip(plain, spec):
        assert a["mismatch_kl"] == pytest.approx(b["mismatch_kl"], abs=1e-7)
        assert b["mismatch_kl"] < 1e-6
        assert "draft/kl" in a and "draft/kl" in b  # the drafts train in both runs
        assert 0 <= b["spec/acceptance_rate"] <= 1 and b["spec/mean_accepted_length"] >= 1
        assert "spec/acceptance_rate" not in a and a["inference/decode_tokens_per_s"] > 0
