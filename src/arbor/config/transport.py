"""`weights` config: how the trainer hands new weights to the inference fleet (filesystem or NCCL)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from arbor.config.base import Config, FixedPort, Float, Ranks, Seconds


class WeightTransportConfig(Config):
    """Shared by trainer and inference (`rl` pushes the top-level `[weights]` table into both)."""

    kind: Literal["filesystem", "nccl"] = "filesystem"
    """"filesystem": sharded safetensors under `broadcasts/step_N/` with a checksum manifest and `STABLE`;
    "nccl": buckets of tensors broadcast from trainer rank 0 to every vLLM worker over one long-lived group (GPU,
    vLLM backend only); the step directory then holds only the bucket list."""
    max_shard_gb: Float = Field(0.5, gt=0)
    """Largest safetensors shard; bigger models get several shards and `model.safetensors.index.json`."""
    bucket_mb: Float = Field(64.0, gt=0)
    """Size of one bucket of a streamed weight update: the trainer gathers, casts (or FP8-quantises) and sends
    this many MiB of parameters at a time, so the extra memory of a publish on any rank is about one bucket (a
    tensor larger than a bucket travels alone). Filesystem shards are one bucket each (at most `max_shard_gb`)."""
    delta: bool = False
    """Skip buckets whose parameters did not change since the previous version (frozen embeddings, a frozen
    base): the filesystem transport hard-links the previous shard, NCCL sends only the changed buckets. The
    trainer's metrics report the bytes each update moved (`weights/bytes_moved`)."""
    verify_checksums: bool = True
    """Check every shard's checksum against the manifest before loading it."""
    checksum: Literal["crc32", "sha256"] = "crc32"
    """Shard checksum written to the manifest and verified on load: crc32 catches torn and corrupted copies at
    a fraction of sha256's CPU cost (which, on a few cores, halves transfer throughput); sha256 also catches
    deliberate changes."""
    timeout: Seconds = Field(600.0, gt=0)
    """Seconds a publish or a load may take (waiting for `STABLE`, for every NCCL receiver to check in, for the
    group to form, one broadcast) before it fails loudly, naming what it waited for, instead of hanging."""
    nccl_host: str = "127.0.0.1"
    """NCCL: address of trainer rank 0, where the weight-update group rendezvouses."""
    nccl_port: FixedPort = 29551
    """NCCL: rendezvous port of the weight-update group."""
    nccl_inference_ranks: Ranks = Field(1, ge=1)
    """NCCL: inference workers in the group (replicas x tensor x data parallel); the trainer is rank 0."""


def check_lora_transport(model: Any, weights: WeightTransportConfig) -> None:
    """A LoRA run (`model.lora`) publishes its adapter as files: vLLM's and the local engine's adapter loading
    read a directory, so the adapter never travels over NCCL."""
    if model.lora is not None and weights.kind == "nccl":
        raise ValueError(
            "model.lora needs weights.kind = 'filesystem' (an adapter is published as a PEFT directory, "
            "which inference loads through /v1/load_lora_adapter)"
        )
