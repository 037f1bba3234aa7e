"""Builds a preset MoE with vLLM (offline `LLM`, engine in this process, CPU or CUDA build) and prints, as one JSON
line, each MoE gate's output and weight dtypes and the largest difference between its logits on bf16 activations
and the trainer's router logits (arbor.models.qwen3_moe: `F.linear(x.float(), w.float())`) on the weights it
serves (the checkpoint's where the CPU build packed them away).
Whether arbor's plugin acts is the caller's environment (arbor.inference.vllm.fp32_router.FP32_ROUTER_ENV); with
`off,on` the probe builds the model twice in this one process (one vLLM import, not two), first with the plugin's
switch unset, then with it set, vLLM loading its plugins anew (through their entry points) before each build, and
prints a line for each: `GATES off [...]`, then `GATES on [...]`.

    python tests/vllm_router_probe.py MODEL DTYPE [off,on]
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process: collective_rpc runs here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm.distributed import cleanup_dist_env_and_memory  # noqa: E402

from arbor.config.inference import InferenceConfig  # noqa: E402
from arbor.config.model import ModelConfig  # noqa: E402
from arbor.inference.vllm.fp32_router import FP32_ROUTER_ENV  # noqa: E402
from arbor.inference.vllm.model_dir import model_dir  # noqa: E402
from arbor.models import build_model  # noqa: E402

CHECKPOINT: dict[str, torch.Tensor] = {}
"""The served checkpoint's tensors (the preset as `model_dir` wrote it), by Hugging Face name."""


def gates(worker) -> list[dict]:
    """Every GateLinear of the worker's model: dtypes and the logits' largest deviation from the trainer's."""
    torch.manual_seed(0)
    device = getattr(worker, "device", "cpu")
    out = []
    for name, m in worker.model_runner.model.named_modules():
        if type(m).__name__ != "GateLinear":
            continue
        # The weights the gate holds, as the trainer's bf16 compute holds the published bf16 weights; the CPU
        # build drops m.weight once it has packed it: then the checkpoint's.
        served = getattr(m, "weight", None)
        full = served is not None and served.dim() == 2 and served.numel() > 0
        weight = served.detach() if full else CHECKPOINT[name + ".weight"].to(device)
        x = torch.randn(48, weight.shape[1], device=device).bfloat16()
        logits = m(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        reference = F.linear(x.float(), weight.float())
        out.append(
            {
                "name": name,
                "out_dtype": str(logits.dtype),
                "weight_dtype": str(m.weight.dtype),
                "max_diff": (logits.float() - reference).abs().max().item(),
                "scale": reference.abs().max().item(),
            }
        )
    return out


def main() -> None:
    name, dtype = sys.argv[1], sys.argv[2]
    path, _ = model_dir(InferenceConfig.model_validate({"model": {"name": name}, "seq_len": 128}))
    CHECKPOINT.update(build_model(ModelConfig(name=name)).state_dict())  # what model_dir saved (same seed)
    if len(sys.argv) < 4:  # the caller's environment decides
        llm = LLM(model=path, dtype=dtype, enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.3)
        print("GATES " + json.dumps(llm.collective_rpc(gates)[0]), flush=True)
        return
    modes = sys.argv[3].split(",")
    assert modes == ["off", "on"], modes  # the plugin patches GateLinear for good: off must come first
    for mode in modes:
        if mode == "on":
            os.environ[FP32_ROUTER_ENV] = "1"
        else:
            os.environ.pop(FP32_ROUTER_ENV, None)
        vllm.plugins.plugins_loaded = False  # vLLM loads the general plugins (ours: register()) again at the build
        llm = LLM(model=path, dtype=dtype, enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.3)
        print(f"GATES {mode} " + json.dumps(llm.collective_rpc(gates)[0]), flush=True)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


if __name__ == "__main__":
    main()
