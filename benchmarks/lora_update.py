"""LoRA weight updates: adapter publish + load time as a fraction of a full-weight publish + load of the same base.

One process (a world of one rank, gloo), a Qwen3-shaped model of ~135M parameters (fp32 master weights, as the
trainer holds them; bf16 on the wire and in the inference copy), both paths through the code the run uses:

- full: `arbor.weights.publish.stream_publish` (the streamed bucketed publish) to the filesystem transport, then
  the local engine's `ModelRunner.load_weights` (checksums verified, every tensor checked, copied in);
- adapter: the same model with a rank-`--rank` adapter on every attention and MLP projection
  (`arbor.models.lora.apply_lora`), `stream_publish_adapter` (a PEFT directory), then `ModelRunner.load_adapter`
  (checksums verified, written into the engine's adapter slot).

Each is timed `--repeats` times, alternating, and the fastest kept. Target: adapter / full <= 0.1 at rank 16.
Files go under /tmp and are removed.

    uv run python benchmarks/lora_update.py [--rank 16] [--layers 8] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from smoke import parse_args

from arbor.config.model import LoRAConfig
from arbor.inference.engine.runner import ModelRunner
from arbor.models.lora import apply_lora, lora_parameters
from arbor.models.presets import PRESETS
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.run_dir import broadcast_dir
from arbor.weights.publish import DeltaTracker, stream_publish, stream_publish_adapter
from arbor.weights.transport import FilesystemTransport

TARGET = 0.1


def build(layers: int) -> Qwen3ForCausalLM:
    """~12.6M parameters per layer plus a 32.8M tied embedding; fp32 parameters."""
    args = dataclasses.replace(
        PRESETS["qwen3-small"],
        vocab_size=32_000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
    )
    model = Qwen3ForCausalLM(args)
    model.init_weights(0)
    return model


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU configs run one per process)")
    a = parse_args(ap, rank=4, layers=1, repeats=1)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = build(a.layers)
    params = sum(p.numel() for p in trainer.parameters())
    lora_cfg = LoRAConfig(
        rank=a.rank,
        alpha=2.0 * a.rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    adapted = copy.deepcopy(trainer)
    apply_lora(adapted, lora_cfg, 0)
    with torch.no_grad():
        for _, p in lora_parameters(adapted):
            p.normal_(0, 0.01)
    runner = ModelRunner(
        copy.deepcopy(trainer).to(torch.bfloat16).eval(),
        seq_len=64,
        max_batch_size=1,
        weights=FilesystemTransport(keep=1),
        max_loras=1,
        max_lora_rank=max(a.rank, 1),
    )
    root = Path(tempfile.mkdtemp(prefix="arbor-bench-lora-", dir="/tmp"))
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    full_s, adapter_s, adapter_bytes, full_bytes = [], [], 0.0, 0.0
    try:
        with torch.inference_mode():
            for i in range(a.repeats):
                v_full, v_adapter = 2 * i + 1, 2 * i + 2
                t = {}

                def full() -> None:
                    t["fig"] = stream_publish(
                        trainer, runner.weights, root, v_full, bf16, False, None, DeltaTracker(False), cpu
                    )
                    runner.load_weights(broadcast_dir(root, v_full))

                def adapter() -> None:
                    t["afig"] = stream_publish_adapter(
                        adapted, runner.weights, root, v_adapter, bf16, lora_cfg, "bench"
                    )
                    runner.load_adapter("run", broadcast_dir(root, v_adapter), v_adapter)

                full_s.append(timed(full))
                adapter_s.append(timed(adapter))
                full_bytes, adapter_bytes = t["fig"]["weights/bytes_moved"], t["afig"]["weights/bytes_moved"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    ratio = min(adapter_s) / min(full_s)
    print(
        f"{params / 1e6:.0f}M-parameter model: full publish+load {min(full_s):.3f}s ({full_bytes / 2**20:.0f} MiB), "
        f"rank-{a.rank} adapter publish+load {min(adapter_s):.3f}s ({adapter_bytes / 2**20:.1f} MiB)"
    )
    print(
        json.dumps(
            {
                "benchmark": "lora_update",
                "value": round(ratio, 4),
                "target": TARGET,
                "unit": "adapter publish+load seconds / full-weight publish+load seconds",
                "ok": ratio <= TARGET,
                "rank": a.rank,
                "params_m": round(params / 1e6, 1),
                "full_seconds": round(min(full_s), 4),
                "adapter_seconds": round(min(adapter_s), 4),
                "full_mib": round(full_bytes / 2**20, 1),
                "adapter_mib": round(adapter_bytes / 2**20, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
