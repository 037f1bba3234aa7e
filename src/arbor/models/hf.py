"""Hugging Face checkpoint directories: config.json + safetensors (single file or sharded with an index).

`load_weights` reads a checkpoint one layer at a time into a model that may be sharded already (arbor.models.
materialize): every name and shape is checked on meta tensors from the safetensors headers before any data is
read, and each rank copies only its part of each tensor, so no process holds the whole checkpoint or model.

Checkpoints in DeepSeek's FP8 format (float8 `weight` + `weight_scale_inv` per 128x128 block, a
`quantization_config` in config.json: DeepSeek-V3, Qwen3-*-FP8, and what arbor publishes with `model.fp8 =
"block"`) and in OpenAI's MXFP4 (gpt-oss's experts, arbor.models.mxfp4) load by dequantisation into the
model's own dtype; `fp8=True` writes the FP8 format. The copies a vLLM server is started from (dequantised, or
block FP8) are arbor.models.checkpoint_copies.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from arbor.models.args import ModelArgs
from arbor.models.family import family_of
from arbor.models.fp8 import QUANTIZATION_CONFIG, dequantize_state, quantize_state
from arbor.models.lora import is_lora_param
from arbor.models.materialize import check_matches, copy_checked, local_slices, local_tensor, write_full
from arbor.models.mtp import has_mtp_weights, init_mtp_from_last_layer
from arbor.models.mxfp4 import dequantize_mxfp4_state
from arbor.models.quantization import high_precision_modules


def hf_config(args: ModelArgs, fp8: bool = False) -> dict:
    """config.json's contents as the model's family writes them (arbor.models.family); with `fp8`, the
    block-FP8 `quantization_config` vLLM and transformers read (with the layers arbor keeps in high precision,
    arbor.models.quantization.high_precision_modules)."""
    config = family_of(args).to_hf_config(args)
    if fp8:
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
        if keep := high_precision_modules(args):
            config["quantization_config"]["modules_to_not_convert"] = keep
    return config


def hf_state_dict(state: dict[str, torch.Tensor], args: ModelArgs, fp8: bool = False) -> dict[str, torch.Tensor]:
    """The state dict as a Hugging Face checkpoint stores it: the family's names and layouts (`to_hf_state`:
    fused MoE expert tensors split into per-expert `experts.{e}.{gate,up,down}_proj.weight`, the on-disk names
    transformers and vLLM read; MTP modules as the layers after the decoder's, arbor.models.mtp), tied heads
    written once, tensors contiguous; `fp8` quantises the FP8 layers' weights (arbor.models.fp8.quantize_state)."""
    state = family_of(args).to_hf_state({k: v.detach() for k, v in state.items()}, args)
    out = {k: v.contiguous() for k, v in state.items()}
    if args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return quantize_state(out) if fp8 else out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's fused `[E, 2I, H]` / `[E, H, I]` expert tensors -> per-expert checkpoint tensors (the MoE
    families' `to_hf_state`); other tensors unchanged."""
    out = {}
    for k, v in state.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
        elif k.endswith(".mlp.experts.down_proj"):
            prefix = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> the fused `[E, 2I, H]` / `[E, H, I]` tensors the model holds (the MoE
    families' `from_hf_state`)."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for k, v in state.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
        else:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
    for prefix, parts in groups.items():
        n = len(parts.get("down", {}))
        if any(sorted(parts.get(p, {})) != list(range(n)) for p in ("gate", "up", "down")):
            raise ValueError(f"checkpoint experts under {prefix} are incomplete")
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(n)])
        out[prefix + "down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    return out


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, in memory (published weights, adapters: small; a model's
    checkpoint loads layer by layer through `load_weights`)."""
    path = Path(path)
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        state.update(load_file(str(path / f)))
    return state


INDEX = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[str]:
    index = path / INDEX
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,  # MX block scales
}


def checkpoint_layout(path: str | Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (file, a meta tensor of its dtype and shape) for every tensor of a checkpoint directory, from the
    safetensors headers alone (no tensor data is read)."""
    path = Path(path)
    layout = {}
    for f in safetensors_files(path):
        with open(path / f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        header.pop("__metadata__", None)
        for name, info in header.items():
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"checkpoint {path}: {name} has dtype {info['dtype']}, which arbor does not read")
            layout[name] = (f, torch.empty(info["shape"], dtype=dtype, device="meta"))
    return layout


def checkpoint_groups(names: list[str]) -> list[list[str]]:
    """The checkpoint's tensor names in the groups `load_weights` reads at once: a layer's (every name up to its
    first number: `model.layers.3`, with its experts, FP8 scales and fused projections) or a module's."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), len(parts) - 1)
        groups.setdefault(".".join(parts[:cut]), []).append(name)
    return list(groups.values())


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Copies a checkpoint directory's tensors into `model` in place (names, mapped by the model's family, and
    shapes must match exactly); FP8 weights are dequantised with their `weight_scale_inv`. `model` may be
    sharded (DTensors: each rank writes its own part) and is read one layer at a time, after every name and
    shape matched; a rank reads only its own experts of a MoE layer sharded along them (`local_experts`), and
    no rank reads what the model does not hold. A model with MTP modules loads them from the checkpoint when it
    has them, else starts them from its last decoder layer."""
    path = Path(path)
    layout = checkpoint_layout(path)
    own = model_tensors(model)
    mapped = _model_state(model, {name: meta for name, (_, meta) in layout.items()})
    from_last_layer = any(k.startswith("mtp.") for k in own) and not has_mtp_weights(mapped)
    if from_last_layer:
        own = {k: v for k, v in own.items() if not k.startswith("mtp.")}
    check_matches(own, mapped, f"checkpoint {path}", "the model")
    spans = local_experts(own)
    for names in checkpoint_groups(list(layout)):
        if not _model_state(model, {n: layout[n][1] for n in names}):
            continue  # nothing the model holds (DeepSeek's MTP layer without `model.mtp_depth`): not read
        layer = _LAYER.match(names[0])
        span = spans.get(layer.group(0)) if layer else None
        state = _read(path, layout, names, span)
        for name, full in _model_state(model, state).items():
            if span is not None and _FUSED_EXPERTS.match(name):
                with torch.no_grad():  # the rank's own experts, renumbered from 0 (`_read`)
                    local_tensor(own[name]).copy_(full)
            else:
                write_full(own[name], full)
    if from_last_layer:
        init_mtp_from_last_layer(model)


_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.\d+\.")


def local_experts(own: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Per decoder layer (`model.layers.N.`), the experts [lo, hi) this rank holds of its fused expert tensors,
    where FSDP2 or expert parallelism shards them along the expert dimension alone (the loader then reads only
    those experts' checkpoint tensors); a layer whose experts the rank holds whole is absent."""
    found: dict[str, set[tuple[int, int, int] | None]] = {}
    for name, t in own.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None or not hasattr(t, "to_local"):
            continue
        experts, *rest = local_slices(t)
        by_expert = all(s == slice(0, n) for s, n in zip(rest, t.shape[1:]))
        found.setdefault(m.group(1), set()).add((experts.start, experts.stop, t.shape[0]) if by_expert else None)
    spans = {}
    for layer, kinds in found.items():
        if len(kinds) == 1 and (only := next(iter(kinds))) is not None and only[:2] != (0, only[2]):
            spans[layer] = only[:2]
    return spans


def _read(path: Path, layout: dict, names: list[str], span: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """A group's checkpoint tensors; with `span`, a MoE layer's experts outside [lo, hi) are not read and those
    inside are renumbered from 0 (the family fuses them into the rank's part of its expert tensors)."""
    keep = {n: n for n in names}
    if span is not None:
        lo, hi = span
        for n in names:
            if (m := _EXPERT_NUMBER.search(n)) is not None:
                e = int(m.group(1))
                keep[n] = f"{n[: m.start()]}.experts.{e - lo}.{n[m.end() :]}" if lo <= e < hi else None
    state = {}
    for f in sorted({layout[n][0] for n in names}):
        with safe_open(str(path / f), "pt") as fh:
            state.update({keep[n]: fh.get_tensor(n) for n in names if layout[n][0] == f and keep[n] is not None})
    return state


def _model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (any part of a checkpoint) under arbor's names, dequantised (block FP8, MXFP4); a tied
    head dropped."""
    out = family_of(model.args).from_hf_state(dequantize_mxfp4_state(dequantize_state(state)), model.args)
    if model.args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def drop_mtp_layers(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Without the multi-token-prediction layers stored after the decoder's `num_layers` (DeepSeek-V3.2, GLM-5)."""

    def layer(name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1

    return {k: v for k, v in state.items() if layer(k) < num_layers}


def copy_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Copies checkpoint tensors (Hugging Face names, dequantised) into `model`, mapped by its family. Checks
    every tensor against `model` before copying any, so a mismatched checkpoint leaves the model untouched (the
    inference engine keeps serving its old weights)."""
    copy_model_state(model, family_of(model.args).from_hf_state(state, model.args), source)


def copy_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """`copy_checked` of tensors already under arbor's names (parameters and persistent buffers, such as a
    transformers MoE router's expert bias); a tied head is the embedding's."""
    if model.args.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    copy_checked(model_tensors(model), state, f"checkpoint {source}", "the model")


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint fills: parameters and persistent buffers by name (a tied head is the embedding's; LoRA
    adapters are not the checkpoint's)."""
    own = {k: p for k, p in model.named_parameters() if not is_lora_param(k)}
    persistent = set(model.state_dict())
    own.update({k: b for k, b in model.named_buffers() if k in persistent})
    if model.args.tie_word_embeddings:
        own.pop("lm_head.weight", None)
    return own


def save_checkpoint_dir(
    state: dict[str, torch.Tensor], args: ModelArgs, path: str | Path, tokenizer=None, fp8: bool = False
) -> None:
    """Writes config.json, model.safetensors and the tokenizer into `path` (the caller makes it atomic);
    `fp8` writes DeepSeek's FP8 checkpoint format."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(args, fp8), indent=2))
    save_file(hf_state_dict(state, args, fp8), str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(path)
