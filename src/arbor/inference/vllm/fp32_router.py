"""fp32 router logits in vLLM's MoE layers: a vLLM general plugin (entry point `arbor_fp32_router`).

arbor's MoE router (arbor.models.qwen3_moe) computes its logits in fp32 whatever the compute dtype, in the trainer
and the local engine alike: bf16 router logits flip near-tied top-k choices between trainer and inference, a known
source of MoE mismatch that grows as training sharpens the router. vLLM builds every MoE gate as a `GateLinear`,
whose logits come out in the weights' dtype (bf16 when serving bf16) unless the model asks for more. This plugin,
which vLLM loads in each of its processes before it builds the model, makes a `GateLinear` default to
`out_dtype = float32` and `force_fp32_compute = True`. On Hopper and Blackwell vLLM's router GEMMs then take the
bf16 activations and weights and return fp32 logits accumulated in fp32, which is the trainer's
`F.linear(x.float(), w.float())` up to summation order; elsewhere the gate keeps its weights in fp32 (a bf16
checkpoint's values exactly) and its plain linear computes in fp32. A model that sets either argument itself
keeps its choice, and a gate whose quantisation method quantises it keeps that (its output is cast to fp32).

The plugin acts only in the vLLM servers arbor starts: `arbor.inference.vllm.launch.serve_env` sets
`FP32_ROUTER_ENV` unless `inference.vllm.fp32_router = false`. An installed entry point is seen by every vLLM in
the environment, and must change nothing in a `vllm serve` that arbor did not start; for the same reason the
module stays light (the standard library only, and the arbor package's light `__init__`s), and imports vLLM and
torch only once the plugin acts.
"""

from __future__ import annotations

import functools
import inspect
import os

FP32_ROUTER_ENV = "ARBOR_VLLM_FP32_ROUTER"
"""Set to "1" in a vLLM server's environment by arbor.inference.vllm.launch.serve_env where
`inference.vllm.fp32_router` is on."""


def register() -> None:
    """vLLM's `vllm.general_plugins` hook: patches `GateLinear` in this process when FP32_ROUTER_ENV is "1"."""
    if os.environ.get(FP32_ROUTER_ENV) != "1":
        return
    # Imported only now: vLLM loads this plugin in every process of every server in the environment.
    import torch  # see above
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear  # see above

    fp32_gate_defaults(GateLinear, torch.float32)


_PATCHED: set[type] = set()
"""The classes `fp32_gate_defaults` patched in this process (each once)."""


def fp32_gate_defaults(cls: type, fp32: object) -> None:
    """Makes `cls.__init__` default `out_dtype` to `fp32` (torch.float32) and `force_fp32_compute` to True where
    the caller passed neither (module docstring). Idempotent: vLLM may load a plugin more than once in a
    process."""
    if cls in _PATCHED:
        return
    init = cls.__init__
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params[1:]):
        raise TypeError(
            f"{cls.__qualname__}.__init__{signature}: arbor's fp32 router defaults expect named "
            "arguments only (a vLLM whose GateLinear changed)"
        )

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        named = signature.bind_partial(self, *args, **kwargs).arguments  # only what the caller passed
        del named[params[0].name]
        if named.get("out_dtype") is None:
            named["out_dtype"] = fp32
        named.setdefault("force_fp32_compute", True)
        init(self, **named)

    cls.__init__ = __init__
    _PATCHED.add(cls)
