"""Run under torchrun (2 ranks, gloo, CPU) by tests/weights/test_weight_stream.py: streamed publish vs the full state
dict.

For each case (dense; MoE with ep = 2; dense with block FP8) it builds the parallelised model as the trainer does,
publishes it through `arbor.weights.publish.stream_publish` with small buckets (so both ranks write shards), and
rank 0 compares every published tensor bit for bit with `get_model_state_dict(full_state_dict=True)` turned into
the Hugging Face tensors the old path published. The dense case also publishes two delta updates. Rank 0 writes
the outcome to `<out>/result.json`.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/publish_dist_check.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from arbor.config.loader import load_config
from arbor.config.trainer import TrainerConfig
from arbor.models.hf import hf_state_dict
from arbor.run_dir import broadcast_dir
from arbor.trainer.loop import build_training
from arbor.trainer.parallel import init_distributed
from arbor.weights.publish import DeltaTracker, stream_publish
from arbor.weights.transport import MANIFEST, FilesystemTransport, read_verified

CASES = {
    "dense": ["--model.name", "qwen3-test"],
    "moe_ep2": ["--model.name", "qwen3-moe-test", "--parallel.ep", "2"],
    "fp8": ["--model.name", "qwen3-test", "--model.fp8", "block"],
}


def mismatches(path: Path, expected: dict[str, torch.Tensor]) -> list[str]:
    got = read_verified(path)
    bad = sorted(set(got) ^ set(expected))
    for k in set(got) & set(expected):
        a, b = got[k], expected[k]
        if (
            a.dtype != b.dtype
            or a.shape != b.shape
            or not torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
        ):
            bad.append(k)
    return bad


def check(out: Path, name: str, extra: list[str], device: torch.device) -> dict:
    cfg = load_config(
        TrainerConfig, ["--output-dir", str(out / name), "--parallel.nproc", "2", "--model.dtype", "bfloat16", *extra]
    )
    model, *_ = build_training(cfg, device)
    fp8 = cfg.model.fp8 == "block"
    transport = FilesystemTransport(keep=5, bucket_mb=0.01)  # several buckets: both ranks write shards
    tracker = DeltaTracker(name == "dense")
    figures = [stream_publish(model, transport, cfg.output_dir, 1, torch.bfloat16, fp8, None, tracker, device)]
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result: dict = {}
    if dist.get_rank() == 0:
        expected = hf_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()}, model.args, fp8)
        result = {
            "shards": len(json.loads((broadcast_dir(cfg.output_dir, 1) / MANIFEST).read_text())["files"]),
            "mismatches": mismatches(broadcast_dir(cfg.output_dir, 1), expected),
            "tensors": len(expected),
        }
    if name == "dense":  # delta: nothing changed, then one parameter changed in place
        figures.append(stream_publish(model, transport, cfg.output_dir, 2, torch.bfloat16, fp8, None, tracker, device))
        with torch.no_grad():
            dict(model.named_parameters())["model.norm.weight"].add_(1.0)
        figures.append(stream_publish(model, transport, cfg.output_dir, 3, torch.bfloat16, fp8, None, tracker, device))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            expected3 = hf_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()}, model.args, fp8)
            result["delta_mismatches"] = [
                mismatches(broadcast_dir(cfg.output_dir, 2), expected),
                mismatches(broadcast_dir(cfg.output_dir, 3), expected3),
            ]
    result["figures"] = figures
    return result


def main() -> None:
    out = Path(sys.argv[1])
    device, _ = init_distributed("gloo")
    results = {name: check(out, name, extra, device) for name, extra in CASES.items()}
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
