"""One optimizer step on one rank's rollout batch: packed forward, shifted token logprobs, loss, backward, clip,
AdamW; then the step's figures reduced over ranks. The RL loop, the tests and the benchmark call these same
functions, so what is measured is what trains.

The forward to per-token logprobs (packed rows, prefix-tree merged rows, context parallelism) lives in
arbor.trainer.forward; its functions stay importable from here.

Normalisation: each micro-batch's loss is `loss_sum / normaliser * dp_size`, the normaliser being the step's
loss-token count with one optimizer step per batch. FSDP2 averages gradients over the `dp_size` ranks, so the
update follows the exact token mean over the whole step, however the samples were packed or split across ranks.
With `trainer.mini_batches = k` the micro-batches are split, in order, into k optimizer steps, each normalised
by its own share of the step's loss weight (`mini_batch_normalisers`), so each step is the exact mean its
normalisation asks for over its own samples; `trainer.epochs` repeats the pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from arbor.config.trainer import DraftConfig, LossConfig
from arbor.models.attention import subtree_end_for
from arbor.trainer.draft import DraftOut, clip_grad_norm_groups, draft_modules, make_draft_fn
from arbor.trainer.forward import (
    micro_batch_logprobs,
    packed_logprobs,
    shifted_logprobs,
    tree_logprobs,
    unmerged_logprobs,
)
from arbor.trainer.logprobs import effective_top_p
from arbor.trainer.loss import LossContext, LossFn
from arbor.trainer.parallel_state import UNPREPARED, ParallelState
from arbor.transport.batch import MicroBatch, StepBatch

__all__ = [
    "micro_batch_logprobs",
    "mini_batch_normalisers",
    "packed_logprobs",
    "shifted_logprobs",
    "split_mini_batches",
    "teacher_topk_ids",
    "train_step",
    "tree_logprobs",
    "unmerged_logprobs",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Accumulator:
    """Per-rank running sums and extrema, kept as device tensors so micro-batches never sync with the host."""

    weight: float = 1.0
    """Multiplies the sums: 0 on context-parallel ranks other than the first, which hold duplicate figures."""
    sums: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    mins: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        if key.endswith("_max"):
            self.maxes[key] = torch.maximum(self.maxes[key], value) if key in self.maxes else value
        elif key.endswith("_min"):
            self.mins[key] = torch.minimum(self.mins[key], value) if key in self.mins else value
        else:
            value = value * self.weight
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def reduce(self, world_size: int) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """All-reduces over ranks (two collectives: SUM, and MAX of maxima with negated minima)."""
        names_s, names_x, names_n = sorted(self.sums), sorted(self.maxes), sorted(self.mins)
        sums = torch.stack([self.sums[k] for k in names_s])
        ext = torch.stack([self.maxes[k] for k in names_x] + [-self.mins[k] for k in names_n])
        if world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        s, e = sums.tolist(), ext.tolist()
        return (
            dict(zip(names_s, s)),
            dict(zip(names_x, e[: len(names_x)])),
            {k: -v for k, v in zip(names_n, e[len(names_x) :])},
        )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    loss_fn: LossFn,
    loss_cfg: LossConfig,
    max_norm: float,
    device: torch.device,
    dp_size: int = 1,
    forward_ctx: contextlib.AbstractContextManager | None = None,
    ref_model: nn.Module | None = None,
    router_replay: bool = False,
    mini_batches: int = 1,
    epochs: int = 1,
    draft: DraftConfig | None = None,
    state: ParallelState = UNPREPARED,
    ref_state: ParallelState = UNPREPARED,
) -> dict[str, float]:
    """Trains on this rank's micro-batches, `mini_batches` optimizer steps per pass over them and `epochs`
    passes; returns the step's global figures.

    `ref_model` (frozen) supplies `LossContext.ref_logprobs` for a KL penalty. Under context parallelism every
    rank of a cp group holds the whole row's logprobs and computes the same loss; the all-gather's backward
    sums the group's gradients (a factor cp that FSDP2's average over dp x cp ranks cancels), and only cp rank
    0 counts the figures. An MoE model's load-balancing loss (`model.aux_loss`, per micro-batch) is added with
    weight 1/micro-batches of the mini-batch per rank. With more than one optimizer step per batch the proximal
    logprobs (arbor.trainer.loss) are computed first, with no gradient; the token figures (mismatch_kl,
    entropy, staleness) are counted in the first epoch and the loss figures averaged over the epochs. With
    `draft` enabled and MTP modules in the model, each micro-batch's forward also trains them
    (arbor.trainer.draft; `draft/kl` in the figures). A DSA model whose indexer trains (`trainer.indexer`) puts
    its KL loss in `aux_loss` and reports `indexer/kl` and `indexer/grad_norm`. `state` and `ref_state`: how
    `parallelize` prepared the model and the reference (arbor.trainer.parallel_state). A batch of numpy arrays
    (the orchestrator's, handed over in process) is trained as its torch tensors.
    """
    batch = batch.torch()
    cp_ctx = state.cp
    acc = _Accumulator(weight=1.0 if cp_ctx is None or cp_ctx.rank == 0 else 0.0)
    groups = split_mini_batches(len(batch.micro_batches), mini_batches, batch.step)
    normalisers = mini_batch_normalisers(batch, groups, acc.weight)
    skipped = 0
    proximal: list[torch.Tensor | None] = [None] * len(batch.micro_batches)
    if mini_batches * epochs > 1:
        with torch.no_grad(), forward_ctx if forward_ctx is not None else contextlib.nullcontext():
            proximal = [
                micro_batch_logprobs(
                    model, mb, batch.temperature, device, False, router_replay, batch.top_p, state=state
                )[0]
                for mb in batch.micro_batches
            ]
    for epoch in range(epochs):
        for group, normaliser in zip(groups, normalisers):
            for i in group:
                logprobs, entropy, mask = _micro_batch_backward(
                    model,
                    batch,
                    batch.micro_batches[i],
                    proximal[i],
                    loss_fn,
                    loss_cfg,
                    device,
                    dp_size / normaliser,
                    len(group),
                    forward_ctx,
                    ref_model,
                    router_replay,
                    acc,
                    epochs,
                    draft,
                    state,
                    ref_state,
                )
                if epoch == 0:
                    seen = logprobs if proximal[i] is None else proximal[i]  # the policy before any update
                    _account(acc, batch.micro_batches[i], mask, seen, entropy, batch.step, device)
            norms = clip_grad_norm_groups(model, max_norm, state)
            grad_norm = norms["policy"]
            # a non-finite indexer gradient skips the update too (it would reach the indexer's weights for good)
            skipped += _update(optimizer, grad_norm + 0.0 * norms.get("indexer", 0.0), batch.step)
            acc.add("grad_norm_max", grad_norm)  # identical on every rank: MAX keeps it as is
            if "indexer" in norms:
                acc.add("indexer/grad_norm_max", norms["indexer"])
    return {**_figures(acc, dp_size, max(batch.loss_tokens_total, 1)), "skipped_updates": skipped}


def _update(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, step: int) -> int:
    """The optimizer step, unless the gradients are not finite (a NaN or inf in the batch, an overflow): then
    the update is skipped, as a NaN would reach every weight and end the run's learning for good, and counted
    (`skipped_updates`). The global norm is the same on every rank, so all ranks skip together; reading it costs
    one host sync per optimizer step, not per micro-batch."""
    finite = bool(torch.isfinite(grad_norm).item())
    if finite:
        optimizer.step()
    else:
        log.warning("step %d: gradient norm is %s; optimizer update skipped", step, grad_norm.item())
    optimizer.zero_grad(set_to_none=True)
    return int(not finite)


def split_mini_batches(n_micro: int, k: int, step: int) -> list[range]:
    """Indices of the micro-batches of each of the `k` mini-batches: contiguous, in order, counts differing by at
    most one. Every rank holds the same number of micro-batches (the orchestrator's batcher sees to it), so every rank
    takes the same optimizer steps. The orchestrator packs at least `k` per rank where the step's samples allow
    (`orchestrator.batching.min_micro_batches`); a step that still holds fewer (fewer samples than `k`, or a
    batch written without the setting) takes one optimizer step per micro-batch, with a warning, rather than
    failing a run mid-way."""
    if k > max(n_micro, 1):
        log.warning(
            "step %d holds %d micro-batches per rank, fewer than trainer.mini_batches = %d: it takes %d "
            "optimizer steps",
            step,
            n_micro,
            k,
            max(n_micro, 1),
        )
        k = max(n_micro, 1)
    bounds = [round(j * n_micro / k) for j in range(k + 1)]
    return [range(bounds[j], bounds[j + 1]) for j in range(k)]


def mini_batch_normalisers(batch: StepBatch, groups: list[range], weight: float) -> list[float]:
    """Each mini-batch's loss normaliser: the step's loss-token count times the mini-batch's share of the step's
    loss weight, over all ranks. With token normalisation that is its loss-token count; with sequence (group)
    normalisation the mini-batch's loss is the mean over its samples (groups). One mini-batch: exactly the
    step's count. `weight` is 0 on context-parallel ranks that duplicate another's data."""
    total = max(batch.loss_tokens_total, 1)
    if len(groups) == 1:
        return [float(total)]
    sums = torch.zeros(len(groups), dtype=torch.float64)
    for j, group in enumerate(groups):
        for i in group:
            mb = batch.micro_batches[i]
            sums[j] += torch.where(mb.loss_mask.bool(), mb.loss_weights.double(), 0.0).sum() * weight
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    whole = float(sums.sum())
    return [total * float(w) / whole if w > 0 else float(total) for w in sums]


def _model_aux_loss(
    model: nn.Module, acc: "_Accumulator", n_mb: int, mask: torch.Tensor, epochs: int
) -> torch.Tensor | float:
    """The model's own loss of this forward, per micro-batch (0 when none): an MoE model's load balancing, a DSA
    model's indexer KL (arbor.models.dsa_indexer_loss, also counted as `indexer/kl`)."""
    aux = getattr(model, "aux_loss", None)
    indexer = getattr(model, "indexer_stats", None)
    if indexer is not None:
        acc.add("indexer_kl_total", indexer[0] / epochs)
        acc.add("indexer_queries", indexer[1] / epochs)
    if aux is None:
        return 0.0
    acc.add("aux_loss_sum", aux / n_mb * mask.sum() / epochs)  # reported per loss token like the loss metrics
    return aux / n_mb


def _micro_batch_backward(
    model: nn.Module,
    batch: StepBatch,
    mb: MicroBatch,
    proximal: torch.Tensor | None,
    loss_fn: LossFn,
    loss_cfg: LossConfig,
    device: torch.device,
    scale: float,
    n_mb: int,
    forward_ctx: contextlib.AbstractContextManager | None,
    ref_model: nn.Module | None,
    router_replay: bool,
    acc: _Accumulator,
    epochs: int,
    draft: DraftConfig | None = None,
    state: ParallelState = UNPREPARED,
    ref_state: ParallelState = UNPREPARED,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Forward, loss and backward of one micro-batch (its loss times `scale`); adds the loss figures to `acc`
    (each epoch's share 1/epochs). Returns the detached logprobs, the entropy and the loss mask."""
    trains_drafts = draft is not None and draft.enabled and draft_modules(model, state) is not None
    if trains_drafts:
        end = mb.subtree_end if mb.merged else subtree_end_for(mb.seq_lens, mb.input_ids.shape[0])
        model.draft_fn = make_draft_fn(end.to(device), batch.temperature, draft.top_k, state)
    topk_ids = teacher_topk_ids(mb, batch, device)
    try:
        with forward_ctx if forward_ctx is not None else contextlib.nullcontext():
            logprobs, entropy, *student_topk = micro_batch_logprobs(
                model, mb, batch.temperature, device, True, router_replay, batch.top_p, topk_ids, state
            )
        drafted: DraftOut | None = model.draft_out if trains_drafts else None
    finally:
        if trains_drafts:
            model.draft_fn = model.draft_out = None
    mask = mb.loss_mask.to(device, non_blocking=True)
    ctx = LossContext(
        mb.seq_lens.to(device),
        mb.loss_weights.to(device, non_blocking=True),
        proximal_logprobs=proximal,
        policy_versions=mb.policy_versions.to(device, non_blocking=True),
        step=batch.step,
        teacher_logprobs=None if mb.teacher_logprobs is None else mb.teacher_logprobs.to(device, non_blocking=True),
    )
    if topk_ids is not None:  # the teacher's top-k (arbor.trainer.loss's exact top-k term)
        token_ids = mb.input_ids[mb.token_nodes.long()] if mb.merged else mb.input_ids
        ctx.teacher_topk_logprobs = mb.teacher_topk_logprobs.to(device, non_blocking=True)
        ctx.student_topk_logprobs = student_topk[0]
        ctx.sampled_in_topk = (topk_ids == token_ids.to(device)[:, None]).any(-1)
    if ref_model is not None:
        with torch.no_grad(), forward_ctx if forward_ctx is not None else contextlib.nullcontext():
            ctx.ref_logprobs, _ = micro_batch_logprobs(
                ref_model, mb, batch.temperature, device, False, router_replay, batch.top_p, state=ref_state
            )
    out = loss_fn(
        logprobs,
        mb.inference_logprobs.to(device, non_blocking=True),
        mb.advantages.to(device, non_blocking=True),
        mask,
        loss_cfg,
        ctx,
    )
    total = out.loss_sum * scale + _model_aux_loss(model, acc, n_mb, mask, epochs)
    if drafted is not None:
        total = total + draft.weight * drafted.loss / n_mb
        acc.add("draft_kl_total", drafted.kl_sum / epochs)  # averaged over the passes, like the loss figures
        acc.add("draft_positions", drafted.positions / epochs)
    total.backward()
    acc.add("loss_sum", out.loss_sum / epochs)
    for key, value in out.metrics.items():  # a namespaced key (distill/...) keeps its own namespace
        name = key if "/" in key else f"loss/{key}"
        acc.add(name, value if key.endswith(("_max", "_min")) else value / epochs)
    return logprobs.detach(), entropy, mask


def teacher_topk_ids(mb: MicroBatch, batch: StepBatch, device: torch.device) -> torch.Tensor | None:
    """The micro-batch's teacher top-k ids `[N, k]` on `device` (None without them). The top-k term is defined on
    the student's full distribution, so a nucleus-truncated batch (top_p < 1) cannot carry them."""
    if mb.teacher_topk_ids is None:
        return None
    if effective_top_p(batch.temperature, batch.top_p) < 1:
        raise ValueError(
            f"step {batch.step} carries the teacher's top-k with top_p = {batch.top_p}: set "
            "orchestrator.sampling.top_p = 1 or orchestrator.teacher.top_k = 0"
        )
    return mb.teacher_topk_ids.to(device, torch.long, non_blocking=True)


def _account(
    acc: _Accumulator,
    mb: MicroBatch,
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    step: int,
    device: torch.device,
) -> None:
    zero = torch.zeros_like(logprobs)
    d = logprobs - mb.inference_logprobs.to(device, non_blocking=True)
    # k3 = exp(d) - d - 1 ~ d^2/2: in float32 a d of 1e-6 cancels to exactly 0, so use expm1 in float64.
    d64 = d.double()
    acc.add("mismatch_kl_sum", torch.where(mask, torch.expm1(d64) - d64, torch.zeros_like(d64)).sum())
    acc.add("mismatch_abs_max", torch.where(mask, d.abs(), zero).max() if d.numel() else zero.sum())
    if entropy is not None:
        acc.add("entropy_sum", torch.where(mask, entropy, zero).sum())
    acc.add("loss_tokens", mask.sum())
    acc.add("num_tokens", mb.seq_lens.sum().to(device))
    # Staleness: how many optimizer steps behind the policy that sampled each loss token is.
    versions = mb.policy_versions.to(device, non_blocking=True)
    sampled = mask & (versions >= 0)
    stale = (step - versions).float()
    acc.add("staleness_sum", torch.where(sampled, stale, zero).sum())
    acc.add("staleness_tokens", sampled.sum())
    acc.add("staleness_max", torch.where(sampled, stale, torch.full_like(stale, -1.0)).max())


def _mean_name(key: str) -> str:
    """A per-token sum's name as a mean: `loss/ratio_sum` -> `loss/ratio_mean`; a loss term's own namespace drops
    the suffix (`distill/reverse_kl_sum` -> `distill/reverse_kl`, arbor.trainer.loss)."""
    if not key.endswith("_sum"):
        return key
    return key[: -len("_sum")] + ("" if "/" in key and not key.startswith("loss/") else "_mean")


def _figures(acc: _Accumulator, world_size: int, normaliser: int) -> dict[str, float]:
    sums, maxes, mins = acc.reduce(world_size)
    loss_tokens = max(sums.pop("loss_tokens"), 1.0)
    out: dict[str, float] = {
        "loss": sums.pop("loss_sum") / normaliser,
        "mismatch_kl": sums.pop("mismatch_kl_sum") / loss_tokens,
        "entropy": sums.pop("entropy_sum", 0.0) / loss_tokens,
        "grad_norm": maxes.pop("grad_norm_max"),
        "num_tokens": sums.pop("num_tokens"),
        "loss_tokens": loss_tokens,
    }
    draft_positions = sums.pop("draft_positions", 0.0)
    draft_kl = sums.pop("draft_kl_total", 0.0)
    if draft_positions > 0:
        out["draft/kl"] = draft_kl / draft_positions
    indexer_queries = sums.pop("indexer_queries", 0.0)
    indexer_kl = sums.pop("indexer_kl_total", 0.0)
    if indexer_queries > 0:
        out["indexer/kl"] = indexer_kl / indexer_queries
    if "indexer/grad_norm_max" in maxes:  # one figure per step like grad_norm (the last optimizer step's)
        out["indexer/grad_norm"] = maxes.pop("indexer/grad_norm_max")
    stale_tokens = sums.pop("staleness_tokens")
    stale_sum = sums.pop("staleness_sum")
    if stale_tokens > 0:
        out["policy_staleness/mean"] = stale_sum / stale_tokens
        out["policy_staleness/max"] = maxes["staleness_max"]
    maxes.pop("staleness_max")
    for key, value in sums.items():  # loss metrics: sums over loss tokens -> per-token means
        out[_mean_name(key)] = value / loss_tokens
    for key, value in {**maxes, **mins}.items():
        if abs(value) != float("inf"):  # +-inf: no loss token anywhere, nothing to report
            out[key] = value
    return out
