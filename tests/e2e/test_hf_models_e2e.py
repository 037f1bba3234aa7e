"""End-to-end `rl` on checkpoints users bring: 3 synchronous RL steps with the local engine for every tiny family
of tests/hf_tiny.py (checkpoints written locally, `model.impl = "auto"` as users run it: arbor's native family
where it has one that reads the checkpoint, transformers' modules otherwise), trainer and engine agreeing
(mismatch KL < 1e-3)."""

from __future__ import annotations

import json
import os

import pytest
from hf_tiny import TINY_HF, write_gemma_chat, write_tiny
from rl_runs import check_ran, run_example
from test_rl_e2e import _finish, _rl

from arbor.environments.reverse_text import ReverseTextEnv
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


def test_a_gemma_like_chat_model_warmed_up_on_chat_rows_ends_its_completions_at_its_turn_end(tmp_path):
    """A chat model whose template closes a turn with a token other than its eos (Gemma's <end_of_turn>; its eos
    is <eos>), warmed up on the user's own chat rows (`sft.data`, each assistant turn a target up to the turn end
    the template writes) and trained by the quick start: the rows load (they were refused as a template "that does
    not extend its prefixes"), and the engine stops at the turn end the warm-up taught, so completions are the
    answer's few letters and almost none runs to max_tokens (the model would go on past <end_of_turn> otherwise)."""
    model = write_gemma_chat(tmp_path / "model")
    env = ReverseTextEnv(min_len=2, max_len=5, alphabet="abcdefgh")
    rows = tmp_path / "chat.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"messages": [*env.prompt(t), {"role": "assistant", "content": t["answer"]}]}) + "\n"
            for t in env.dataset(1)[:3000]
        )
    )
    out = tmp_path / "run"
    args = ["--model.name", str(model), "--sft.data", str(rows), "--sft.steps", "40", "--max-steps", "3"]
    check_ran(run_example(*args, "--output-dir", str(out), timeout=600))
    rows_ = read_jsonl(out / "metrics.jsonl")
    assert len(rows_) == 3
    for r in rows_:  # answers of 2..5 letters (a token or a few each) and the turn end; 16 tokens at most
        assert r["truncated/frac"] <= 0.25 and r["completion_len/mean"] < 9, r
