"""The typed wire format of one training step: per trainer rank, a list of packed micro-batches.

A micro-batch is one packed row of several samples. Every per-token array has the length of `input_ids`;
`seq_lens` gives the packed samples' lengths (their sum may be shorter than the row: the rest is padding).
Token `t`'s `inference_logprobs[t]`, `advantages[t]` and `loss_mask[t]` describe the prediction *of* token
`t` from the tokens before it, so the trainer shifts logits by one. `policy_versions[t]` is the trainer step
whose weights sampled token `t` (-1 for prompt tokens). `loss_weights[t]` multiplies token `t`'s loss: it makes
the step's normalisation explicit (token: 1; sequence and group: see arbor.orchestrator.batcher). A file
written without it (an older writer) reads as all ones. The optional `routed_experts [T, moe_layers, top_k]`
(uint8 or int16) holds the experts the inference engine routed each token to (router replay); absent for dense
models or with replay off.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

PER_TOKEN = (
    "input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "policy_versions", "loss_weights"
)
DTYPES = {
    "input_ids": torch.int64,
    "position_ids": torch.int64,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "inference_logprobs": torch.float32,
    "policy_versions": torch.int32,
    "seq_lens": torch.int32,
    "loss_weights": torch.float32,
}


@dataclasses.dataclass
class MicroBatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    seq_lens: torch.Tensor
    loss_weights: torch.Tensor | None = None
    """Per-token loss multipliers; None (the default) means all ones."""
    routed_experts: torch.Tensor | None = None
    """Router replay: the engine's experts per token `[T, moe_layers, top_k]`; None for dense models."""

    def __post_init__(self) -> None:
        n = self.input_ids.shape[0]
        if self.loss_weights is None:
            self.loss_weights = torch.ones(n, dtype=torch.float32)
        if self.routed_experts is not None and (self.routed_experts.dim() != 3 or self.routed_experts.shape[0] != n):
            raise ValueError(
                f"micro-batch field routed_experts has shape {tuple(self.routed_experts.shape)}, expected ({n}, layers, top_k)"
            )
        for name in PER_TOKEN:
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"micro-batch field {name} has shape {tuple(t.shape)}, expected ({n},)")
        if int(self.seq_lens.sum()) > n:
            raise ValueError(f"seq_lens sum to {int(self.seq_lens.sum())}, more than the row's {n} tokens")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclasses.dataclass
class StepBatch:
    """What one trainer rank trains on in one step, plus the step-wide facts every rank needs."""

    step: int
    micro_batches: list[MicroBatch]
    loss_tokens_total: int
    """Loss tokens across all ranks in this step: the token-level normaliser, identical on every rank."""
    num_samples_total: int
    """Samples across all ranks in this step: the sequence-level normaliser."""
    temperature: float
    """Sampling temperature the tokens were generated with; the trainer scales its logits by it."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for i, mb in enumerate(self.micro_batches):
            for f in dataclasses.fields(MicroBatch):
                t = getattr(mb, f.name)
                if t is None:  # optional field
                    continue
                t = (t.to(DTYPES[f.name]) if f.name in DTYPES else t).contiguous()
                if t.data_ptr() in seen:  # safetensors refuses aliased tensors (e.g. one micro-batch reused)
                    t = t.clone()
                seen.add(t.data_ptr())
                tensors[f"{i}.{f.name}"] = t
        header = {
            "step": self.step,
            "num_micro_batches": len(self.micro_batches),
            "loss_tokens_total": self.loss_tokens_total,
            "num_samples_total": self.num_samples_total,
            "temperature": self.temperature,
            "metadata": self.metadata,
        }
        return tensors, {"arbor": json.dumps(header)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> "StepBatch":
        header = json.loads(meta["arbor"])
        mbs = [
            MicroBatch(**{f.name: tensors[k] for f in dataclasses.fields(MicroBatch) if (k := f"{i}.{f.name}") in tensors})
            for i in range(header["num_micro_batches"])
        ]
        return cls(
            step=header["step"],
            micro_batches=mbs,
            loss_tokens_total=header["loss_tokens_total"],
            num_samples_total=header["num_samples_total"],
            temperature=header["temperature"],
            metadata=header.get("metadata", {}),
        )


def encode_routes(routes: "np.ndarray") -> dict[str, Any]:
    """Router-replay payload for JSON: `{"dtype", "shape", "data": base64 of the raw bytes}` (no per-element work)."""
    import base64

    return {"dtype": str(routes.dtype), "shape": list(routes.shape), "data": base64.b64encode(routes.tobytes()).decode()}


def decode_routes(payload: dict[str, Any] | list) -> "np.ndarray":
    """Inverse of `encode_routes`; raises ValueError naming the field on a malformed payload.

    A plain nested list `[tokens][layers][top_k]` (how a vLLM server returns routed experts) is accepted too."""
    import base64

    import numpy as np

    if isinstance(payload, list):
        arr = np.asarray(payload)
        if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"routed_experts: expected a [tokens, layers, top_k] integer array, got shape {arr.shape}")
        return arr.astype(np.int16 if arr.max(initial=0) > 255 else np.uint8)
    try:
        dtype = np.dtype(payload["dtype"])
        if dtype not in (np.uint8, np.int16):
            raise ValueError(f"dtype {dtype} is not uint8 or int16")
        arr = np.frombuffer(base64.b64decode(payload["data"]), dtype=dtype)
        return arr.reshape([int(n) for n in payload["shape"]])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"routed_experts payload is malformed: {e}") from None
