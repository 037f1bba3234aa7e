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


def _gates(dtype: str, plugin: bool, *modes: str) -> dict[str, list[dict]]:
    """The probe's gates by mode: "" (the switch set in its environment or not: `plugin`), or with `modes`
    ("off", "on") each build of one probe process, the switch unset and then set (tests/vllm_router_probe.py)."""
    env = {k: v for k, v in os.environ.items() if k != FP32_ROUTER_ENV}
    if plugin:
        env[FP32_ROUTER_ENV] = "1"
    argv = [sys.executable, str(PROBE), "qwen3-moe-tiny", dtype] + ([",".join(modes)] if modes else [])
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for ln in proc.stdout.splitlines():
        if ln.startswith("GATES "):
            mode, _, gates = ln[len("GATES ") :].partition(" ") if modes else ("", "", ln[len("GATES ") :])
            found[mode] = json.loads(gates)
    assert list(found) == (list(modes) or [""]), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert all(len(g) == 4 for g in found.values())  # one gate per MoE layer of the preset
    return found


@pytest.mark.slow
@pytest.mark.vllm
def test_a_bf16_moe_served_by_vllm_gets_the_trainers_fp32_router_logits():
    # One probe process (one vLLM import, ~25 s of a 2-core machine) builds the model twice: without the switch,
    # then with it, vLLM loading its plugins (ours through its entry point) before each build.
    found = _gates("bfloat16", False, "off", "on")
    for gate in found["on"]:
        assert gate["out_dtype"] == "torch.float32", gate
        assert gate["max_diff"] <= 1e-5 * max(1.0, gate["scale"]), gate
    # without the plugin vLLM's CPU build computes them in bf16, ~1e-2 away: the check above can tell
    for gate in found["off"]:
        assert gate["out_dtype"] == "torch.bfloat16" and gate["max_diff"] > 1e-3, gate


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.gpu(reason="vLLM's CUDA router GEMMs (bf16 in, fp32 out on Hopper and Blackwell)")
def test_vllm_cuda_router_gemms_return_fp32_logits_of_the_served_weights():
    for gate in _gates("bfloat16", plugin=True)[""]:
        assert gate["out_dtype"] == "torch.float32", gate
        assert gate["max_diff"] <= 1e-4 * max(1.0, gate["scale"]), gate
