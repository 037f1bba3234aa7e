"""The typed wire format of one training step: per trainer rank, a list of packed micro-batches.

Per-token arrays (`input_ids`, `position_ids`, `loss_mask`, `advantages`, `inference_logprobs`,
`policy_versions`, `loss_weights`, optional teacher and router-replay fields) describe the prediction of token t
from the tokens before it; prefix-tree merged rows add `subtree_end` and `token_nodes`; a vision-language row adds
its images' `pixel_values` and `image_grid_thw` (every sample's images, in row order). Every field, and how merged
rows depart from "every per-token array has the length of input_ids": docs/training.md, "The batch format".

A batch holds numpy arrays where the orchestrator builds it and torch tensors where the trainer reads it
(`torch()` turns one into the other; `arbor.transport.files` writes either): the orchestrator never imports torch,
which is ~2 s of CPU and ~460 MB of memory at its start. Only the trainer-side methods import torch, and by then
the trainer has.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    Array = torch.Tensor | np.ndarray

NODE_FIELDS = ("input_ids", "position_ids")
"""Per row token (per trie node in a merged row)."""
SAMPLE_TOKEN_FIELDS = ("loss_mask", "advantages", "inference_logprobs", "policy_versions", "loss_weights")
"""Per original sample token (the same as per row token in a plain row)."""
PER_TOKEN = NODE_FIELDS + SAMPLE_TOKEN_FIELDS
TEACHER_FIELDS = ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")
"""On-policy distillation's optional per-sample-token fields (`[N]`, `[N, k]`, `[N, k]`)."""
DTYPES = {  # by name: numpy and torch both know them
    "input_ids": "int64",
    "position_ids": "int64",
    "loss_mask": "bool",
    "advantages": "float32",
    "inference_logprobs": "float32",
    "policy_versions": "int32",
    "seq_lens": "int32",
    "loss_weights": "float32",
    "subtree_end": "int32",
    "token_nodes": "int32",
    "teacher_logprobs": "float32",
    "teacher_topk_ids": "int32",
    "teacher_topk_logprobs": "float32",
    "pixel_values": "float32",
    "image_grid_thw": "int64",
}


@dataclasses.dataclass
class MicroBatch:
    input_ids: Array
    position_ids: Array
    loss_mask: Array
    advantages: Array
    inference_logprobs: Array
    policy_versions: Array
    seq_lens: Array
    loss_weights: Array | None = None
    """Per-token loss multipliers; None (the default) means all ones."""
    routed_experts: Array | None = None
    """Router replay: the engine's experts per row token `[T, moe_layers, top_k]`; None for dense models."""
    subtree_end: Array | None = None
    """Tree mask `[T]`: token i attends to j iff j <= i < subtree_end[j]; None means packed causal (seq_lens)."""
    token_nodes: Array | None = None
    """Merged row: the row token (trie node) holding each original sample token `[N]`; None for a plain row."""
    teacher_logprobs: Array | None = None
    """On-policy distillation: the teacher's logprob of each sample token `[N]`; None without a teacher."""
    teacher_topk_ids: Array | None = None
    """With the teacher's `top_k = k`: its k most likely tokens at each sample token `[N, k]`; else None."""
    teacher_topk_logprobs: Array | None = None
    """Their logprobs `[N, k]` (present exactly when `teacher_topk_ids` is)."""
    pixel_values: Array | None = None
    """Vision-language rows: the patches `[P, D]` of every image whose placeholder tokens are in the row, in row
    order (the model's processor's `pixel_values`, concatenated sample after sample); None for text rows."""
    image_grid_thw: Array | None = None
    """Each of those images' patch grid `[I, 3]` (t, h, w; P = sum of t*h*w); present exactly with pixel_values."""

    def __post_init__(self) -> None:
        m = self.input_ids.shape[0]
        n = m if self.token_nodes is None else self.token_nodes.shape[0]
        if self.loss_weights is None:
            ones = np.ones(n, np.float32)
            self.loss_weights = ones if isinstance(self.input_ids, np.ndarray) else _torch().from_numpy(ones)
        if self.routed_experts is not None and (self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != m):
            raise ValueError(
                f"micro-batch field routed_experts has shape {tuple(self.routed_experts.shape)}, "
                f"expected ({m}, layers, top_k)"
            )
        for names, size in ((NODE_FIELDS, m), (SAMPLE_TOKEN_FIELDS, n)):
            for name in names:
                t = getattr(self, name)
                if t.ndim != 1 or t.shape[0] != size:
                    raise ValueError(f"micro-batch field {name} has shape {tuple(t.shape)}, expected ({size},)")
        t = self.teacher_logprobs
        if t is not None and (t.ndim != 1 or t.shape[0] != n):
            raise ValueError(f"micro-batch field teacher_logprobs has shape {tuple(t.shape)}, expected ({n},)")
        self._check_topk(n)
        self._check_images()
        if self.subtree_end is not None and (self.subtree_end.ndim != 1 or self.subtree_end.shape[0] != m):
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
            if t.ndim != 2 or t.shape[0] != n or t.shape != ids.shape:
                raise ValueError(f"micro-batch field {name} has shape {tuple(t.shape)}, expected ({n}, k) with one k")

    def _check_images(self) -> None:
        pix, grid = self.pixel_values, self.image_grid_thw
        if (pix is None) != (grid is None):
            raise ValueError("micro-batch has one of pixel_values and image_grid_thw without the other")
        if pix is None:
            return
        if grid.ndim != 2 or grid.shape[1] != 3 or pix.ndim != 2:
            shapes = f"{tuple(pix.shape)} and {tuple(grid.shape)}"
            raise ValueError(f"micro-batch pixel_values / image_grid_thw have shapes {shapes}, expected (P, D), (I, 3)")
        patches = int(grid.prod(-1).sum())
        if patches != pix.shape[0]:
            raise ValueError(f"micro-batch image_grid_thw covers {patches} patches, pixel_values holds {pix.shape[0]}")
        if self.token_nodes is not None:
            raise ValueError(
                "a prefix-tree merged row cannot carry images: set orchestrator.batching.prefix_merge = false"
            )

    def torch(self) -> MicroBatch:
        """This micro-batch with torch tensors (itself if it holds them already): what the trainer computes on."""
        if not isinstance(self.input_ids, np.ndarray):
            return self
        torch = _torch()
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return MicroBatch(**{k: None if v is None else torch.from_numpy(v) for k, v in arrays.items()})

    @property
    def images(self) -> dict[str, Array]:
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
        """The row's tree-mask encoding `[T]` (derived from `seq_lens` for a plain row). Trainer side: torch."""
        from arbor.models.attention import subtree_end_for  # noqa: PLC0415 - torch, which the trainer has loaded

        return self.subtree_end if self.subtree_end is not None else subtree_end_for(self.seq_lens, self.num_tokens)

    def predictor_nodes(self) -> torch.Tensor:
        """Merged row: `[N]` int64, the node whose logits predict each sample token (-1 at each sample's start).
        Trainer side: torch tensors."""
        torch = _torch()
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

    def to_tensors(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The file's arrays (numpy, each field in its wire dtype; `arbor.transport.files` writes them) and its
        header."""
        tensors: dict[str, np.ndarray] = {}
        for i, mb in enumerate(self.micro_batches):
            for f in dataclasses.fields(MicroBatch):
                t = getattr(mb, f.name)
                if t is None:  # optional field
                    continue
                if not isinstance(t, np.ndarray):  # a trainer-side batch: CPU tensors
                    t = t.detach().cpu().numpy()
                tensors[f"{i}.{f.name}"] = np.ascontiguousarray(t, dtype=DTYPES.get(f.name, t.dtype))
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
    def from_tensors(cls, tensors: dict[str, Array], meta: dict[str, str]) -> StepBatch:
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

    def torch(self) -> StepBatch:
        """This step with torch tensors (itself if it holds them already)."""
        return dataclasses.replace(self, micro_batches=[mb.torch() for mb in self.micro_batches])


def _torch() -> Any:
    """The torch module, imported only by methods that a batch of tensors (the trainer's) calls."""
    import torch  # noqa: PLC0415 - the orchestrator builds and writes batches without torch

    return torch
