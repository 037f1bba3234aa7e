"""Context parallelism for DeepSeek sparse attention (`trainer.parallel.cp_style = "dsa"`, the automatic choice
for DSA models).

Neither Ulysses (head sharding: every rank would need the indexer's global top-k for its heads, and MLA's one
shared latent per token has no heads to split) nor ring attention (online softmax over key chunks cannot apply
a per-query top-k chosen over all chunks) fits DSA. What does: per layer, each rank projects only its own
tokens (queries, latent KV, rope key, index key: sequence-sharded projections), then ONE all-gather of the
small per-token row `[kv_lora_rank + qk_rope_head_dim + index_head_dim]` gives every rank the global keys;
the indexer scores them for the local queries under the global document + causal mask (built per query block,
never `[Tl, T]` at once), the top-k is taken
over the global row, and sparse MLA runs for the local queries. Backward: the all-gather's gradient is summed
over the ranks and each keeps its own tokens' part (a reduce-scatter; gloo lacks one, so all-reduce + slice,
see `context_parallel._AllGatherRows`). The result equals the single-rank forward: same scores, same top-k,
same attention, per query. When the indexer trains (`trainer.indexer`, arbor.models.dsa_indexer_loss) the index
keys in the row carry its loss's graph, so the same backward returns every rank's key gradients to their owner.

Layout: rows are split zig-zag as for ring attention (rank r holds chunks r and 2cp-1-r of 2cp), padding to a
multiple of 2 x cp with single-token documents (`ContextParallel.set_row`). With the indexer computing a
`[Tl, T]` score block and sparse attention `Tl x k` per rank, work is equal across ranks whatever the split;
zig-zag also balances the causally visible keys, which is what a kernel that skips masked blocks would pay for.
The per-token logprobs are all-gathered as for the other styles (`packed_logprobs_cp`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from arbor.models.args import check_cp_style
from arbor.models.dsa import MaskRows
from arbor.models.family import family_of
from arbor.trainer.context_parallel import ContextParallel, gather_tokens

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class DSAContextParallel(ContextParallel):
    """CP state of a DSA model: the row layout of `ContextParallel` (zig-zag) plus the per-layer key gather."""

    def __init__(self, group) -> None:
        super().__init__(group, "ring")  # the ring style's zig-zag layout
        self.style = "dsa"

    def gather_keys(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's per-token rows `[1, Tl, F]` -> every rank's `[1, T, F]` in global token order (one
        all-gather; differentiable)."""
        if local.shape[0] != 1:
            raise ValueError("DSA context parallel takes one packed row at a time")
        return gather_tokens(self, local[0])[None]

    def local_mask(self) -> MaskRows:
        """Rows of the `[1, Tl, T]` mask of the local queries against the global keys (same document, causal
        order), built a block of queries at a time by the indexer: the whole mask never exists."""
        local, keys = self.local_indices, torch.arange(self.T, device=self.local_indices.device)
        return lambda s, e: self.mask(local[s:e], keys)[None]


def apply_dsa_cp(model: nn.Module, cp_mesh: "DeviceMesh") -> DSAContextParallel:
    """Installs DSA context parallelism in every attention module and returns its state, which the trainer
    keeps (`ParallelState.cp`) to lay out each row."""
    if not family_of(model.args).dsa:
        raise ValueError("trainer.parallel.cp_style = 'dsa' needs a DeepSeek sparse attention model (e.g. dsa-tiny)")
    ctx = DSAContextParallel(cp_mesh.get_group())
    for layer in model.model.layers:
        layer.self_attn.cp = ctx
    return ctx


def resolve_cp_style(style: str, model: nn.Module) -> str:
    """ "auto" -> "dsa" for DSA models, "ulysses" otherwise; a style that cannot run the model is an error."""
    dsa = family_of(model.args).dsa
    check_cp_style(style, dsa)
    if style == "auto":
        return "dsa" if dsa else "ulysses"
    return style
