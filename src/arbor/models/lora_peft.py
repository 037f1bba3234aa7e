"""LoRA adapters in PEFT's directory layout: `adapter_config.json` + `adapter_model.safetensors`.

Keys are `base_model.model.<Hugging Face module path>.lora_A.weight` (`[r, in]`) and `...lora_B.weight`
(`[out, r]`), module paths as arbor's Hugging Face mapping names them (arbor.models.hf): MoE experts per expert,
`...mlp.experts.{e}.{gate,up,down}_proj`. `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read this
layout; the trainer publishes it (arbor.weights.publish) and the local engine loads it
(arbor.inference.engine.adapters).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.lora_(A|B)\.weight$")
_LINEAR_KEY = re.compile(r"^(.*)\.lora_(A|B)\.weight$")


def peft_tensors(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """arbor's adapter parameters (`<path>.lora_A`, experts' `<path>.lora_gate_A [E, r, in]`, ...) under PEFT's
    keys, experts split per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in adapters.items():
        path, leaf = name.rsplit(".", 1)
        if leaf in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{path}.{leaf}.weight"] = t.contiguous()
            continue
        _, proj, ab = leaf.split("_")  # lora_{proj}_{A|B}
        for e in range(t.shape[0]):
            out[f"{PEFT_PREFIX}{path}.{e}.{proj}_proj.lora_{ab}.weight"] = t[e].contiguous()
    return out


def arbor_tensors(peft: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `peft_tensors`: experts stacked back into `[E, ...]` tensors. Raises ValueError on a key
    outside PEFT's LoRA layout or an incomplete set of experts."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for key, t in peft.items():
        if not key.startswith(PEFT_PREFIX):
            raise ValueError(f"adapter tensor {key!r} is not under {PEFT_PREFIX!r}")
        key = key[len(PEFT_PREFIX) :]
        if (m := _EXPERT_KEY.match(key)) is not None:
            experts.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = t
        elif (m := _LINEAR_KEY.match(key)) is not None:
            out[f"{m.group(1)}.lora_{m.group(2)}"] = t
        else:
            raise ValueError(f"adapter tensor {PEFT_PREFIX}{key!r} is neither a lora_A nor a lora_B weight")
    for (path, proj, ab), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"adapter experts under {path} ({proj}_proj lora_{ab}) are incomplete")
        out[f"{path}.lora_{proj}_{ab}"] = torch.stack([per[e] for e in range(len(per))])
    return out


def target_leaves(adapters: dict[str, torch.Tensor]) -> list[str]:
    """PEFT's `target_modules`: the last name component of every adapted module (expert projections by their
    per-expert names)."""
    leaves = set()
    for name in adapters:
        path, leaf = name.rsplit(".", 1)
        if leaf in ("lora_A", "lora_B"):
            leaves.add(path.rsplit(".", 1)[-1])
        else:
            leaves.add(f"{leaf.split('_')[1]}_proj")
    return sorted(leaves)


def adapter_config(cfg: Any, base_model: str, adapters: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`adapter_config.json` for `cfg` (a `LoRAConfig`) over `base_model` (its name or path)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": target_leaves(adapters),
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
    }


def save_adapter(path: str | Path, config: dict[str, Any], adapters: dict[str, torch.Tensor]) -> Path:
    """Writes arbor's adapter tensors as a PEFT directory at `path` (not atomic: tools and tests)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    save_file(
        peft_tensors({k: v.detach() for k, v in adapters.items()}),
        str(path / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    """A PEFT directory's `adapter_config.json`, checked to describe a LoRA adapter."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise ValueError(f"{file}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def load_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, arbor-named adapter tensors) of a PEFT directory (no checksum check: see
    `arbor.inference.engine.adapters`, which reads published directories through the weight transport)."""
    return read_config(path), arbor_tensors(load_file(str(Path(path) / ADAPTER_WEIGHTS)))


def lora_scale(config: dict[str, Any]) -> float:
    """The adapter's output scale, alpha / r (rsLoRA: alpha / sqrt(r))."""
    r = config["r"]
    return config["lora_alpha"] / (r**0.5 if config.get("use_rslora") else r)
