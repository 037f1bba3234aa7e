"""fp32 router logits in vLLM's MoE gates (arbor.inference.vllm.fp32_router): the servers arbor starts switch the plugin
on (inference.vllm.fp32_router), a real vLLM build of a bf16 MoE then has fp32 gates whose logits are the
trainer's `F.linear(x.float(), w.float())`, and without the switch the plugin changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arbor.config.inference import InferenceConfig
from arbor.inference.vllm.fp32_router import FP32_ROUTER_ENV
from arbor.inference.vllm.launch import serve_env

PROBE = Path(__file__).parents[1] / "vllm_router_probe.py"


def test_servers_arbor_starts_switch_the_plugin_on_unless_configured_off():
    assert serve_env(base={}, cfg=InferenceConfig())[FP32_ROUTER_ENV] == "1"
    assert serve_env(base={})[FP32_ROUTER_ENV] == "1"
    off = InferenceConfig.model_validate({"vllm": {"fp32_router": False}})
    assert FP32_ROUTER_ENV not in serve_env(base={}, cfg=off)


def _gates(dtype: str, plugin: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != FP32_ROUTER_ENV}
    if plugin:
        env[FP32_ROUTER_ENV] = "1"
    proc = subprocess.run(
        [sys.executable, str(PROBE), "qwen3-moe-tiny", dtype], env=env, capture_output=True, text=True, timeout=600
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GATES ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    found = json.loads(line[len("GATES ") :])
    assert len(found) == 4  # one gate per MoE layer of the preset
    return found


@pytest.mark.slow
@pytest.mark.vllm
def test_a_bf16_moe_served_by_vllm_gets_the_trainers_fp32_router_logits():
    for gate in _gates("bfloat16", plugin=True):
        assert gate["out_dtype"] == "torch.float32", gate
        assert gate["max_diff"] <= 1e-5 * max(1.0, gate["scale"]), gate
    # without the plugin vLLM's CPU build computes them in bf16, ~1e-2 away: the check above can tell
    for gate in _gates("bfloat16", plugin=False):
        assert gate["out_dtype"] == "torch.bfloat16" and gate["max_diff"] > 1e-3, gate


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.gpu(reason="vLLM's CUDA router GEMMs (bf16 in, fp32 out on Hopper and Blackwell)")
def test_vllm_cuda_router_gemms_return_fp32_logits_of_the_served_weights():
    for gate in _gates("bfloat16", plugin=True):
        assert gate["out_dtype"] == "torch.float32", gate
        assert gate["max_diff"] <= 1e-4 * max(1.0, gate["scale"]), gate
