"""Streamed weight publishing: rank 0's extra resident memory during a publish, and publish+load throughput.

A Qwen3-shaped model of ~1.1 GB in bf16 (fp32 master weights, as the trainer holds them) is published to the
filesystem transport, each measurement in a fresh child process (a world of one rank, gloo):

- `streamed`: arbor.weights.publish.stream_publish with `weights.bucket_mb` buckets (the trainer's path);
- `full` (today's path before streaming, for comparison): `get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`, cast to bf16, then `FilesystemTransport.publish` of the whole dict.

Memory: the peak resident set (VmHWM, reset through /proc/self/clear_refs just before the publish) minus the
resident set before it, divided by the model's size in bf16. Target <= 0.25 at 64 MB buckets; the full path
is >= 1. Throughput: the fastest of `--repeats` streamed publishes plus a verified load, as a ratio of a raw write+read
of the same
bytes (benchmarks/weights.py's baseline): target >= 0.7. Files go under /tmp and are removed.

    uv run python benchmarks/weight_publish.py [--layers 10] [--bucket-mb 64] [--skip-full]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from smoke import parse_args
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from weights import raw_copy  # benchmarks/weights.py: the raw write+read baseline (this script's directory)

from arbor.models.presets import PRESETS
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.run_dir import broadcast_dir
from arbor.weights.publish import DeltaTracker, stream_publish
from arbor.weights.transport import FilesystemTransport, read_verified

MEMORY_TARGET, THROUGHPUT_TARGET = 0.25, 0.7


def build(layers: int, hidden: int = 2048) -> Qwen3ForCausalLM:
    """At the default width ~0.1 GB per layer in bf16 plus a 131 MB tied embedding; fp32 parameters."""
    args = dataclasses.replace(
        PRESETS["qwen3-small"],
        vocab_size=32_000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=hidden // 16,
    )
    model = Qwen3ForCausalLM(args)
    model.init_weights(0)
    return model


def _status(field: str) -> int:
    """A /proc/self/status memory figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(mode: str, layers: int, hidden: int, bucket_mb: float, repeats: int, root: Path) -> dict:
    """One measurement process: memory from the first publish, the fastest of `repeats` for the times (a raw
    copy after each publish+load, so machine load favours neither)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build(layers, hidden)
    nbytes = sum(v.numel() * 2 for k, v in model.state_dict().items() if k != "lm_head.weight")
    transport = FilesystemTransport(keep=1, bucket_mb=bucket_mb)
    out: dict = {"mode": mode, "bytes": nbytes, "publish_seconds": [], "load_seconds": [], "raw_seconds": []}
    for version in range(1, repeats + 1 if mode == "streamed" else 2):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
        before = _status("VmRSS")
        t0 = time.perf_counter()
        if mode == "streamed":
            stream_publish(
                model, transport, root, version, torch.bfloat16, False, None, DeltaTracker(False), torch.device("cpu")
            )
        else:
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            transport.publish(root, version, {k: v.to(torch.bfloat16) for k, v in state.items()}, model.args)
            del state
        out["publish_seconds"].append(time.perf_counter() - t0)
        out.setdefault("extra_rss", _status("VmHWM") - before)
        if mode == "streamed":
            t1 = time.perf_counter()
            loaded = read_verified(broadcast_dir(root, version))
            out["load_seconds"].append(time.perf_counter() - t1)
            out["raw_seconds"].append(raw_copy(loaded, root))
            (root / "raw.bin").unlink()
            del loaded
    dist.destroy_process_group()
    return out


def run_child(mode: str, a: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="arbor-bench-publish-", dir="/tmp"))
    try:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--layers",
            str(a.layers),
            "--hidden",
            str(a.hidden),
            "--bucket-mb",
            str(a.bucket_mb),
            "--repeats",
            str(a.repeats),
            "--root",
            str(root),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=10)  # ~1.1 GB in bf16
    ap.add_argument("--hidden", type=int, default=2048, help="model width (a multiple of 16)")
    ap.add_argument("--bucket-mb", type=float, default=64.0)  # the config default (weights.bucket_mb)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-full", action="store_true", help="do not measure the whole-state-dict path")
    ap.add_argument("--child", choices=["streamed", "full"])
    ap.add_argument("--root", type=Path)
    a = parse_args(ap, layers=1, hidden=256, bucket_mb=1.0, repeats=1)
    if a.child:
        print(json.dumps(child(a.child, a.layers, a.hidden, a.bucket_mb, a.repeats, a.root)))
        return
    s = run_child("streamed", a)
    memory = s["extra_rss"] / s["bytes"]
    publish_load = min(p + load for p, load in zip(s["publish_seconds"], s["load_seconds"]))
    raw = min(s["raw_seconds"])
    throughput = raw / publish_load
    result = {
        "benchmark": "weight_publish",
        "value": round(memory, 3),
        "target": MEMORY_TARGET,
        "unit": "rank-0 extra peak RSS during publish / model bytes (bf16)",
        "ok": memory <= MEMORY_TARGET and throughput >= THROUGHPUT_TARGET,
        "gib": round(s["bytes"] / 2**30, 3),
        "bucket_mb": a.bucket_mb,
        "throughput_ratio": round(throughput, 3),
        "throughput_target": THROUGHPUT_TARGET,
        "publish_load_seconds": round(publish_load, 3),
        "raw_seconds": round(raw, 3),
    }
    if not a.skip_full:
        f = run_child("full", a)
        result["full_path_memory"] = round(f["extra_rss"] / f["bytes"], 3)
        result["full_path_publish_seconds"] = round(f["publish_seconds"][0], 3)
    print(
        f"streamed publish of {s['bytes'] / 2**30:.2f} GiB: extra peak RSS {s['extra_rss'] / 2**20:.0f} MiB "
        f"({memory:.3f} of the model), publish+load {throughput:.2f}x a raw copy's speed"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
