"""End-to-end `rl` with a mixture-of-experts model: 2 trainer ranks with FSDP2 + EP=2 and router replay."""

from __future__ import annotations

import pytest
from test_rl_e2e import _finish, _rl

from arbor.monitor.metrics import read_jsonl

pytestmark = pytest.mark.slow


def test_moe_run_with_expert_parallel_and_router_replay_matches_inference(tmp_path):
    """Synchronous RL (every token sampled by the weights being trained): with the engine's routing replayed, the
    trainer's logprobs equal the inference engine's, so mismatch_kl is ~0 (fp32) through HTTP, files and EP."""
    out = tmp_path / "run"
    rc, stdout, stderr = _finish(
        _rl(
            out,
            "--model.name",
            "qwen3-moe-test",
            "--model.router-replay",
            "true",
            "--max-steps",
            "3",
            "--orchestrator.scheduler.mode",
            "sync",
            "--trainer.parallel.nproc",
            "2",
            "--trainer.parallel.ep",
            "2",
        )
    )
    assert rc == 0, stderr + stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["staleness/max"] == 0
        assert r["mismatch_kl"] < 1e-6, r["mismatch_kl"]
        assert "aux_loss_mean" in r
