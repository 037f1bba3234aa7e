"""End-to-end `rl` on checkpoints users bring: 3 synchronous RL steps with the local engine for every tiny family
of tests/hf_tiny.py (checkpoints written locally, `model.impl = "auto"` as users run it: arbor's native family
where it has one that reads the checkpoint, transformers' modules otherwise), trainer and engine agreeing
(mismatch KL < 1e-3)."""

from __future__ import annotations

import json
import os

import pytest
from hf_tiny import TINY_HF, write_tiny
from test_rl_e2e import _finish, _rl

from arbor.models.family import choose_family
from arbor.monitor.metrics import read_jsonl

pytestmark = pytest.mark.slow

EVERY_PATH = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3_5ForCausalLM", "GptOssForCausalLM")
"""One family per path `auto` takes, which the default suite runs: native (Llama), transformers after the native
family refused a setting (Mistral's window), transformers with recurrent layers (Qwen3.5: one sample per forward,
recomputing engine), transformers MoE with sinks and windows (gpt-oss). Each `rl` run costs about a minute of
CI's two cores; the other six run with ARBOR_FULL_MATRIX=1 (the per-family logprob, engine and FSDP2 tests cover
all ten in the default suite)."""
FULL = os.environ.get("ARBOR_FULL_MATRIX") == "1"
MATRIX = [
    arch
    if arch in EVERY_PATH or FULL
    else pytest.param(arch, marks=pytest.mark.skip(reason="the full family matrix: ARBOR_FULL_MATRIX=1"))
    for arch in TINY_HF
]


@pytest.mark.parametrize("arch", MATRIX)
def test_three_rl_steps_with_the_local_engine(arch, tmp_path):
    model = write_tiny(arch, tmp_path / "model")
    out = tmp_path / "run"
    rc, stdout, stderr = _finish(
        _rl(out, "--model.name", str(model), "--max-steps", "3", "--orchestrator.scheduler.mode", "sync"), 480
    )
    assert rc == 0, stderr + stdout
    config = json.loads((model / "config.json").read_text())
    assert f"model: {choose_family(arch, 'auto', str(model), config)[1]}" in stdout  # the path it took, said
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["mismatch_kl"] < 1e-3, (arch, r["mismatch_kl"])


def test_an_architecture_the_transformers_path_cannot_mask_stops_rl_in_one_line(tmp_path):
    """A checkpoint whose layers do not take arbor's mask (Moshi's decoder drops the layers' keywords) passes the
    config check (its config.json names a causal LM transformers builds) and is refused where it is first built:
    the process stops on one line (arbor.checkpoint_manifest.stop_cleanly) and `rl` shows that line, exiting 2 as
    on a config error, with no traceback."""
    model = write_tiny("MoshiForCausalLM", tmp_path / "model")
    rc, stdout, stderr = _finish(_rl(tmp_path / "run", "--model.name", str(model), "--max-steps", "2"), 240)
    assert rc == 2, stderr + stdout
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("rl: error: ") and " stopped: model.name: MoshiForCausalLM failed a two-token" in error
    assert "Traceback" not in stdout + stderr, stderr
