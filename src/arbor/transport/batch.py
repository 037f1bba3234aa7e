"""The typed wire format of one training step: per trainer rank, a list of packed micro-batches.

Per-token arrays (`input_ids`, `position_ids`, `loss_mask`, `advantages`, `inference_logprobs`,
`policy_versions`, `loss_weights`, optional teacher and router-replay fields) describe the prediction of token t
from the tokens before it; prefix-tree merged rows add `subtree_end` and `token_nodes`; a vision-language row adds
its images' `pixel_values` and `image_grid_thw` (every sample's images, in row order). Every field, and how merged
rows depart from "every per-token array has the length of input_ids": docs/training.md, "The batch format".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from arbor.models.attention import subtree_end_for

NODE_FIELDS = ("input_ids", "position_ids")
"""Per row token (per trie node in a merged row)."""
SAMPLE_TOKEN_FIELDS = ("loss_mask", "advantages", "inference_logprobs", "policy_versions", "loss_weights")
"""Per original sample token (the same as per row token in a plain row)."""
PER_TOKEN = NODE_FIELDS + SAMPLE_TOKEN_FIELDS
TEACHER_FIELDS = ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")
"""On-policy distillation's optional per-sample-token fields (`[N]`, `[N, k]`, `[N, k]`)."""
DTYPES = {
    "input_ids": torch.int64,
    "position_ids": torch.int64,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "inference_logprobs": torch.float32,
    "policy_versions": torch.int32,
    "seq_lens": torch.int32,
    "loss_weights": torch.float32,
    "subtree_end": torch.int32,
    "token_nodes": torch.int32,
    "teacher_logprobs": torch.float32,
    "teacher_topk_ids": torch.int32,
    "teacher_topk_logprobs": torch.float32,
    "pixel_values": torch.float32,
    "image_grid_thw": torch.int64,
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
    """Router replay: the engine's experts per row token `[T, moe_layers, top_k]`; None for dense models."""
    subtree_end: torch.Tensor | None = None
    """Tree mask `[T]`: token i attends to j iff j <= i < subtree_end[j]; None means packed causal (seq_lens)."""
    token_nodes: torch.Tensor | None = None
    """Merged row: the row token (trie node) holding each original sample token `[N]`; None for a plain row."""
    teacher_logprobs: torch.Tensor | None = None
    """On-policy distillation: the teacher's logprob of each sample token `[N]`; None without a teacher."""
    teacher_topk_ids: torch.Tensor | None = None
    """With the teacher's `top_k = k`: its k most likely tokens at each sample token `[N, k]`; else None."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """Their logprobs `[N, k]` (present exactly when `teacher_topk_ids` is)."""
    pixel_values: torch.Tensor | None = None
    """Vision-language rows: the patches `[P, D]` of every image whose placeholder tokens are in the row, in row
    order (the model's processor's `pixel_values`, concatenated sample after sample); None for text rows."""
    image_grid_thw: torch.Tensor | None = None
    """Each of those images' patch grid `[I, 3]` (t, h, w; P = sum of t*h*w); present exactly with pixel_values."""

    def __post_init__(self) -> None:
        m = self.input_ids.shape[0]
        n = m if self.token_nodes is None else self.token_nodes.shape[0]
        if self.loss_weights is None:
            self.loss_weights = torch.ones(n, dtype=torch.float32)
        if self.routed_experts is not None and (self.routed_experts.dim() != 3 or self.routed_experts.shape[0] != m):
            raise ValueError(
                f"micro-batch field routed_experts has shape {tuple(self.routed_experts.shape)}, "
                f"expected ({m}, layers, top_k)"
            )
        for names, size in ((NODE_FIELDS, m), (SAMPLE_TOKEN_FIELDS, n)):
            for name in names:
                t = getattr(self, name)
                if t.dim() != 1 or t.shape[0] != size:
                    raise ValueError(f"micro-batch field {name} has shape {tuple(t.shape)}, expected ({size},)")
        t = self.teacher_logprobs
        if t is not None and (t.dim() != 1 or t.shape[0] != n):
            raise ValueError(f"micro-batch field teacher_logprobs has shape {tuple(t.shape)}, expected ({n},)")
        self._check_topk(n)
        self._check_images()
        if self.subtree_end is not None and (self.subtree_end.dim() != 1 or self.subtree_end.shape[0] != m):
            shape = tuple(self.subtree_end.shape)
            raise ValueError(f"micro-batch field subtree_end has shape {shape}, expected ({m},)")
        if self.token_nodes is not None:
            if self.subtree_end is None:
                raise ValueError("micro-batch has token_nodes (a merged row) but no subtree_end")
            if n and (int(self.token_nodes.min()) < 0 or int(self.token_nodes.max()) >= m):
                raise ValueError(f"micro-batch field token_nodes points outside the row's {m} nodes")
            if int(self.seq_lens.sum()) != n:
                raise ValueError(f"seq_lens sum to {int(self.seq_lens.sum())}, not the merged row's {n} sample tokens")
        elif int(self.seq_lens.sum()) > m:
            raise ValueError(f"seq_lens sum to {int(self.seq_lens.sum())}, more than the row's {m} tokens")

    def _check_topk(self, n: int) -> None:
        ids, lps = self.teacher_topk_ids, self.teacher_topk_logprobs
        if (ids is None) != (lps is None):
            raise ValueError("micro-batch has one of teacher_topk_ids and teacher_topk_logprobs without the other")
        if ids is None:
            return
        if self.teacher_logprobs is None:
            raise ValueError("micro-batch has teacher_topk_ids but no teacher_logprobs")
        for name, t in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", lps)):
            if t.dim() != 2 or t.shape[0] != n or t.shape != ids.shape:
                raise ValueError(f"micro-batch field {name} has shape {tuple(t.shape)}, expected ({n}, k) with one k")

    def _check_images(self) -> None:
        pix, grid = self.pixel_values, self.image_grid_thw
        if (pix is None) != (grid is None):
            raise ValueError("micro-batch has one of pixel_values and image_grid_thw without the other")
        if pix is None:
            return
        if grid.dim() != 2 or grid.shape[1] != 3 or pix.dim() != 2:
            shapes = f"{tuple(pix.shape)} and {tuple(grid.shape)}"
            raise ValueError(f"micro-batch pixel_values / image_grid_thw have shapes {shapes}, expected (P, D), (I, 3)")
        patches = int(grid.prod(-1).sum())
        if patches != pix.shape[0]:
            raise ValueError(f"micro-batch image_grid_thw covers {patches} patches, pixel_values holds {pix.shape[0]}")
        if self.token_nodes is not None:
            raise ValueError(
                "a prefix-tree merged row cannot carry images: set orchestrator.batching.prefix_merge = false"
            )

    @property
    def images(self) -> dict[str, torch.Tensor]:
        """The row's image inputs as the model's forward keywords (empty for a text row)."""
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    @property
    def num_tokens(self) -> int:
        """Row tokens (trie nodes in a merged row): what the forward pass computes."""
        return int(self.input_ids.shape[0])

    @property
    def merged(self) -> bool:
        return self.token_nodes is not None

    def row_subtree_end(self) -> torch.Tensor:
        """The row's tree-mask encoding `[T]` (derived from `seq_lens` for a plain row)."""
        return self.subtree_end if self.subtree_end is not None else subtree_end_for(self.seq_lens, self.num_tokens)

    def predictor_nodes(self) -> torch.Tensor:
        """Merged row: `[N]` int64, the node whose logits predict each sample token (-1 at each sample's start)."""
        if self.token_nodes is None:
            raise ValueError("predictor_nodes needs a merged row (token_nodes)")
        nodes = self.token_nodes.to(torch.long)
        pred = torch.cat([nodes.new_full((1,), -1), nodes[:-1]])
        starts = torch.cumsum(self.seq_lens.to(torch.long), 0) - self.seq_lens.to(torch.long)
        pred[starts[self.seq_lens > 0]] = -1
        return pred


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
    top_p: float = 1.0
    """Nucleus mass the tokens were sampled with; below 1 the trainer scores the truncated distribution (as the
    engines report it). Files written without it read as 1."""

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
            "top_p": self.top_p,
            "metadata": self.metadata,
        }
        return tensors, {"arbor": json.dumps(header)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> "StepBatch":
        header = json.loads(meta["arbor"])
        mbs = [
            MicroBatch(
                **{f.name: tensors[k] for f in dataclasses.fields(MicroBatch) if (k := f"{i}.{f.name}") in tensors}
            )
            for i in range(header["num_micro_batches"])
        ]
        return cls(
            step=header["step"],
            micro_batches=mbs,
            loss_tokens_total=header["loss_tokens_total"],
            num_samples_total=header["num_samples_total"],
            temperature=header["temperature"],
            metadata=header.get("metadata", {}),
            top_p=header.get("top_p", 1.0),
        )
