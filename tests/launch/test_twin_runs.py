"""`rl --twin` runs the multi-node and GPU recipes here, one run per distinct shape: Qwen3-235B-A22B (MoE top-8, ep 2
on 2 gloo ranks, bfloat16, GSPO, vLLM's CPU build serving with FP8 quantisation on load), GLM-5 (DSA + MoE, ep 2 x
cp 2 with DSA context parallelism, block FP8, CISPO, multi-turn swe_agent, the local engine: vLLM's CPU build has no
sparse attention) and GSM8K (dense Qwen3, one GPU's vLLM, DAPO, prefix merging, the shipped problems for the hub
dataset). Each prints what it changed, then finishes its 3 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_tiny import write_big_config

from arbor.monitor.metrics import read_jsonl

# vLLM's CPU build starts in 1 to 6 minutes (2 cores, idle to busy), then a twin's 3 steps take about a minute: past
# the suite's 600 s default on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]


def _run_twin(recipe: str, tmp_path: Path, *args: str) -> tuple[str, Path]:
    """Runs `rl @ <recipe> --twin *args` offline; its printed output and the twin's run directory."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "@", recipe, "--twin", "--output-dir", str(out), *args],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    twin = Path(f"{out}-twin")
    assert [r["step"] for r in read_jsonl(twin / "metrics.jsonl")] == [0, 1, 2]
    assert (twin / "twin_model" / "config.json").is_file() and not out.exists()
    return res.stdout, twin


@pytest.mark.vllm
def test_qwen3_235b_twin_runs_with_vllm_serving(tmp_path):
    printed, twin = _run_twin("examples/qwen3_235b/rl.toml", tmp_path)
    assert "  trainer.parallel.ep: 8 -> 2 (" in printed and "16 experts top-8" in printed
    assert "vLLM" in (twin / "logs" / "inference.log").read_text()


def test_glm5_swe_twin_runs_with_dsa_context_and_expert_parallelism(tmp_path):
    printed, twin = _run_twin("examples/glm5_swe/rl.toml", tmp_path)
    assert "  trainer.parallel.cp: 4 -> 2 (" in printed and "GlmMoeDsaForCausalLM" in printed
    trainer = (twin / "configs" / "trainer.toml").read_text()
    assert 'fp8 = "block"' in trainer and 'dtype = "bfloat16"' in trainer and 'name = "cispo"' in trainer


@pytest.mark.vllm
def test_gsm8k_twin_runs_with_vllm_serving(tmp_path):
    printed, twin = _run_twin("examples/gsm8k/rl.toml", tmp_path)
    assert "orchestrator.environment.args.dataset: " in printed
    assert "vLLM" in (twin / "logs" / "inference.log").read_text()


def test_a_users_gpt_oss_twin_runs_on_the_transformers_path_in_bf16(tmp_path):
    """A checkpoint arbor has no native family for (gpt-oss-120b's config.json as published: 128 experts top-4,
    sliding and full attention layers, MXFP4 quantisation; no weights needed) twins into a tiny random
    GptOssForCausalLM written by transformers, on the transformers path, and trains 3 steps in bfloat16."""
    real = tmp_path / "gpt-oss-120b"
    write_big_config(real, "gpt_oss", "GptOssForCausalLM", num_local_experts=128, num_experts_per_tok=4)
    config = json.loads((real / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (real / "config.json").write_text(json.dumps(config))
    printed, twin = _run_twin(
        "examples/reverse_text/rl.toml", tmp_path, "--model.name", str(real), "--model.dtype", "bfloat16"
    )
    assert (
        "a tiny random GptOssForCausalLM, 2 layers (1 sliding_attention, 1 full_attention), hidden 64, 8 experts"
        in printed
    )
    assert "model: GptOssForCausalLM: transformers' own modules (no native family" in printed
    tiny = json.loads((twin / "twin_model" / "config.json").read_text())
    assert tiny["num_experts_per_tok"] == 4 and "quantization_config" not in tiny
