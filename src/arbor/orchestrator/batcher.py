"""Packs one step's rollouts into micro-batches per trainer rank, balancing tokens across ranks.

Samples go to ranks longest-first onto the rank with the fewest tokens (LPT scheduling, within 4/3 of the
optimum), then each rank packs first-fit-decreasing into rows of at most `micro_batch_tokens`. Every rank gets
the same number of micro-batches (FSDP's collectives need the same number of forward passes): short ranks get
one-token rows with an empty loss mask. With `prefix_merge` the rows are prefix tries instead
(arbor.orchestrator.prefix_tree): samples sharing token prefixes are merged, the row budget counts trie tokens,
and ranks are balanced by trie tokens.

Normalisation is explicit in the per-token `loss_weights` (the trainer divides the weighted loss sum by the
step's loss-token count L): "token" weighs every token 1 (a token mean over the step); "sequence" gives sample
i's tokens L / (N * len_i), so the step's loss is the mean over the N samples of each sample's token mean;
"group" gives group g's tokens L / (G * tokens_g): the mean over the G groups of each group's token mean.

Multi-turn rollouts carry a `completion_mask`: tokens the environment inserted (mask 0) get loss_mask False and
weight 0, and every count above (L, len_i, tokens_g) counts trained tokens only.
"""

from __future__ import annotations

import numpy as np

from arbor.orchestrator.prefix_tree import merged_rank_rows
from arbor.orchestrator.rollout import Rollout
from arbor.transport.batch import MicroBatch, StepBatch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
"""Per-sample image arrays: concatenated over a row's samples that have them, never per token."""


def sample_arrays(r: Rollout, weight: float = 1.0) -> dict[str, np.ndarray]:
    P, C = len(r.prompt_ids), len(r.completion_ids)
    adv = r.token_advantages if r.token_advantages is not None else np.full(C, r.advantage, np.float32)
    trained = np.ones(C, bool) if r.completion_mask is None else np.asarray(r.completion_mask, bool)
    if trained.shape != (C,):
        raise ValueError(f"rollout of task {r.task_id}: completion_mask has {trained.size} entries for {C} tokens")
    out = {
        "input_ids": np.asarray(r.prompt_ids + r.completion_ids, dtype=np.int64),
        "loss_mask": np.concatenate([np.zeros(P, bool), trained]),
        "advantages": np.concatenate([np.zeros(P, np.float32), np.where(trained, np.asarray(adv, np.float32), 0)]),
        "inference_logprobs": np.concatenate([np.zeros(P, np.float32), np.asarray(r.logprobs, np.float32)]),
        "policy_versions": np.concatenate([np.full(P, -1, np.int32), np.asarray(r.policy_versions, np.int32)]),
        "loss_weights": np.concatenate([np.zeros(P, np.float32), np.where(trained, weight, 0.0).astype(np.float32)]),
    }
    if r.teacher_logprobs is not None:  # on-policy distillation (arbor.orchestrator.teacher)
        teacher = np.where(trained, np.asarray(r.teacher_logprobs, np.float32), 0)
        out["teacher_logprobs"] = np.concatenate([np.zeros(P, np.float32), teacher]).astype(np.float32)
    if r.teacher_topk_ids is not None:  # the teacher's top-k per completion token (`teacher.top_k`)
        ids, lps = np.asarray(r.teacher_topk_ids, np.int32), np.asarray(r.teacher_topk_logprobs, np.float32)
        if ids.shape != (C, ids.shape[-1]) or lps.shape != ids.shape:
            raise ValueError(
                f"rollout of task {r.task_id}: teacher top-k arrays {ids.shape} and {lps.shape} for {C} "
                "completion tokens"
            )
        pad = np.zeros((P, ids.shape[1]), np.int32)
        out["teacher_topk_ids"] = np.concatenate([pad, np.where(trained[:, None], ids, 0)])
        out["teacher_topk_logprobs"] = np.concatenate([pad.astype(np.float32), np.where(trained[:, None], lps, 0)])
    if r.routed_experts is not None:  # router replay: the engine's array, moved whole (no per-token work)
        out["routed_experts"] = r.routed_experts
    if r.images is not None:  # a vision-language prompt's images travel with its sample
        out["pixel_values"] = np.asarray(r.images["pixel_values"], np.float32)
        out["image_grid_thw"] = np.asarray(r.images["image_grid_thw"], np.int64)
    return out


def loss_weights(rollouts: list[Rollout], normalization: str) -> list[float]:
    """Per-rollout token weight for the step's normalisation (see the module docstring)."""
    total = sum(r.num_trained for r in rollouts)
    if normalization == "token" or total == 0:
        return [1.0] * len(rollouts)
    if normalization == "sequence":
        return [total / (len(rollouts) * max(r.num_trained, 1)) for r in rollouts]
    if normalization == "group":
        tokens: dict[object, int] = {}
        for r in rollouts:
            tokens[r.group_id] = tokens.get(r.group_id, 0) + r.num_trained
        return [total / (len(tokens) * max(tokens[r.group_id], 1)) for r in rollouts]
    raise ValueError(f"unknown normalization {normalization!r}: use token, sequence or group")


def assign_ranks(lengths: list[int], ranks: int) -> list[list[int]]:
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(ranks), key=lambda k: load[k])
        out[r].append(i)
        load[r] += lengths[i]
    return out


def pack_rows(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        for k, free in enumerate(room):
            if lengths[i] <= free:
                rows[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(budget - lengths[i])
    return rows


def _micro_batch(samples: list[dict[str, np.ndarray]]) -> MicroBatch:
    # Routed experts (teacher logprobs) only when every sample of the row has them (a row is replayed whole or
    # not at all; a run has a teacher for every sample or for none).
    keys = [k for k in samples[0] if all(k in s for s in samples) and k not in IMAGE_KEYS]
    cat = {k: np.concatenate([s[k] for s in samples]) for k in keys}
    for k in IMAGE_KEYS:  # each sample's images, in row order (samples without images add none)
        if any(k in s for s in samples):
            cat[k] = np.concatenate([s[k] for s in samples if k in s])
    lens = [len(s["input_ids"]) for s in samples]
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])  # restarting at 0 for each sample
    return MicroBatch(position_ids=positions, seq_lens=np.array(lens, np.int32), **cat)


def _empty_micro_batch(pad_id: int) -> MicroBatch:
    one = {
        "input_ids": np.array([pad_id], np.int64),
        "loss_mask": np.zeros(1, bool),
        "advantages": np.zeros(1, np.float32),
        "inference_logprobs": np.zeros(1, np.float32),
        "policy_versions": np.full(1, -1, np.int32),
        "loss_weights": np.zeros(1, np.float32),
    }
    return _micro_batch([one])


def _pack(
    samples: list[dict[str, np.ndarray]], lengths: list[int], ranks: int, budget: int, prefix_merge: bool
) -> list[list[MicroBatch]]:
    """Per rank, its micro-batches at this row budget (prefix-tree merged or plainly packed)."""
    if prefix_merge:
        if any("pixel_values" in s for s in samples):
            raise ValueError(
                "orchestrator.batching.prefix_merge cannot merge prompts with images (their placeholder tokens "
                "are shared while their pixels differ): set it to false for a vision-language run"
            )
        return merged_rank_rows(samples, ranks, budget)
    return [
        [_micro_batch([samples[i] for i in row]) for row in pack_rows(idx, lengths, budget)]
        for idx in assign_ranks(lengths, ranks)
    ]


def build_step_batches(
    rollouts: list[Rollout],
    step: int,
    ranks: int,
    micro_batch_tokens: int,
    temperature: float,
    pad_id: int,
    normalization: str = "token",
    prefix_merge: bool = False,
    min_micro_batches: int = 1,
    top_p: float = 1.0,
) -> list[StepBatch]:
    """One StepBatch per rank. Each rank gets at least `min_micro_batches` micro-batches where the step's
    samples allow it (the row budget is halved until they do: mini-batch steps need micro-batches of their
    own), and every rank the same count (short ranks are padded with empty ones)."""
    samples = [sample_arrays(r, w) for r, w in zip(rollouts, loss_weights(rollouts, normalization))]
    lengths = [len(s["input_ids"]) for s in samples]
    budget = micro_batch_tokens
    per_rank = _pack(samples, lengths, ranks, budget, prefix_merge)
    while min(len(m) for m in per_rank) < min_micro_batches and budget > 1:
        budget //= 2
        repacked = _pack(samples, lengths, ranks, budget, prefix_merge)
        if sum(map(len, repacked)) == sum(map(len, per_rank)) and budget < min(lengths, default=1):
            break  # every row already holds one sample: fewer samples than mini-batches
        per_rank = repacked
    most = max(len(m) for m in per_rank)
    for mbs in per_rank:
        mbs += [_empty_micro_batch(pad_id) for _ in range(most - len(mbs))]
    loss_tokens = max(1, int(sum(r.num_trained for r in rollouts)))
    return [
        StepBatch(
            step=step,
            micro_batches=mbs,
            loss_tokens_total=loss_tokens,
            num_samples_total=len(rollouts),
            temperature=temperature,
            metadata={"normalization": normalization, "prefix_merge": prefix_merge},
            top_p=top_p,
        )
        for mbs in per_rank
    ]
