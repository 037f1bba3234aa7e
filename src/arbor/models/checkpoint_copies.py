"""Copies of a checkpoint in the form a vLLM server is started from, written one safetensors file at a time (a
744B checkpoint never sits in memory whole) and shared by the servers of a machine (`write_once`):

- `write_dequantized`: a quantised checkpoint (block FP8, MXFP4) with its weights in the model's dtype, for a
  server that takes the trainer's unquantised updates (arbor.inference.vllm.model_dir);
- `write_block_fp8`: any checkpoint in the block-FP8 format vLLM serves under `model.fp8 = "block"` (the layers
  arbor runs in FP8 as e4m3 + `weight_scale_inv`, the rest in the model's dtype, the high-precision modules named
  in `modules_to_not_convert`), so trainer and inference compute alike (arbor.models.fp8).
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from arbor.models.fp8 import QUANTIZATION_CONFIG, SCALE_SUFFIX, dequantize_state, quantize_state
from arbor.models.hf import INDEX, checkpoint_layout, drop_mtp_layers, safetensors_files
from arbor.models.mxfp4 import dequantize_mxfp4_state
from arbor.models.quantization import high_precision_modules, without_quantization


def write_once(out: Path, write: Callable[[Path], None]) -> Path:
    """`out`, written by `write(partial)` into a sibling directory and renamed into place unless it is there: the
    processes of a machine that want the same copy (several replicas of a node) take a lock, so one writes it and
    the others wait and use it; a copy cut short (no config.json, which is written last) is written again."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            partial = out.with_name(out.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            write(partial)
            shutil.rmtree(out, ignore_errors=True)
            partial.rename(out)
    return out


def write_dequantized(src: str | Path, dst: str | Path, dtype: torch.dtype) -> None:
    """A copy of the quantised checkpoint `src` at `dst` with every block-FP8 or MXFP4 tensor dequantised to
    `dtype` (the others as stored), one safetensors file at a time (a dequantised tensor goes where its weight or
    blocks were); config.json without its `quantization_config`, and the checkpoint's other files (tokenizer,
    generation config) alongside. What a server loads when the run publishes unquantised weights into it
    (arbor.inference.vllm.model_dir)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f, state in _dequantized_files(src, dtype):
        save_file(state, str(dst / f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, f))
    config = without_quantization(json.loads((src / "config.json").read_text()))
    _finish(src, dst, weight_map, config)


def write_block_fp8(src: str | Path, dst: str | Path, args, dtype: torch.dtype) -> None:
    """A copy of the checkpoint `src` (unquantised, or block FP8 / MXFP4 as published) at `dst` in the block-FP8
    format vLLM serves with `model.fp8 = "block"` for the model `args` (ModelArgs or DSAArgs): every tensor in
    `dtype` but the layers arbor runs in FP8 (`quantize_state`), one file at a time; config.json is the
    checkpoint's own with DeepSeek's `quantization_config` and the modules arbor keeps in high precision. The MTP
    layers stored after the decoder are left out unless `args.mtp_depth` asks for them, as arbor's model does."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f, state in _dequantized_files(src, dtype):
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        if not getattr(args, "mtp_depth", 0):
            state = drop_mtp_layers(state, args.num_hidden_layers)
        if state:
            out = {k: v.contiguous() for k, v in quantize_state(state).items()}
            save_file(out, str(dst / f), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, f))
    config = without_quantization(json.loads((src / "config.json").read_text()))
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    if keep := high_precision_modules(args):
        config["quantization_config"]["modules_to_not_convert"] = keep
    if not getattr(args, "mtp_depth", 0) and config.get("num_nextn_predict_layers"):
        config["num_nextn_predict_layers"] = 0
    _finish(src, dst, weight_map, config)


def _dequantized_files(src: Path, dtype: torch.dtype):
    """(file name, its tensors with block-FP8 and MXFP4 ones dequantised to `dtype`) for each safetensors file of
    `src`: a dequantised tensor is read with its scales (wherever they are stored) and goes where its weight was."""
    layout = checkpoint_layout(src)
    for f in safetensors_files(src):
        written = [n for n, (file, _) in layout.items() if file == f and not _is_quantization_partner(n, layout)]
        read = written + [p for n in written for p in (n + SCALE_SUFFIX, _scales_of(n)) if p in layout and p != n]
        state = {}
        for g in sorted({layout[n][0] for n in read}):
            with safe_open(str(src / g), "pt") as fh:
                state.update({n: fh.get_tensor(n) for n in read if layout[n][0] == g})
        yield f, {k: v.contiguous() for k, v in dequantize_mxfp4_state(dequantize_state(state, dtype), dtype).items()}


def _finish(src: Path, dst: Path, weight_map: dict[str, str], config: dict) -> None:
    """The index (where `src` has one), the checkpoint's other files (tokenizer, generation config), and
    config.json last: a directory with config.json is complete (`write_once`)."""
    if (src / INDEX).exists():
        (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in ("config.json", INDEX):
            shutil.copy2(other, dst / other.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _scales_of(name: str) -> str:
    """An MXFP4 tensor's scales, named after its blocks (`name` itself when it is no blocks tensor)."""
    return name.removesuffix("_blocks") + "_scales" if name.endswith("_blocks") else name


def _is_quantization_partner(name: str, layout: dict) -> bool:
    """An FP8 weight's scale or an MXFP4 tensor's scales: read with their weight or blocks, never written."""
    blocks = name.removesuffix("_scales") + "_blocks"
    return name.endswith(SCALE_SUFFIX) or (name.endswith("_scales") and blocks in layout)
