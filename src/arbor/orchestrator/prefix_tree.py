"""Prefix-tree merging: the samples of a step that share token prefixes become one trie per packed row.

Multi-turn agent rollouts of one task share a system prompt and often a long history; trained as separate
samples, every shared token is recomputed once per sample. Here the samples of a row are merged into a trie
(one node per distinct prefix), flattened in DFS order with position ids = depth, and attended with a tree mask
(`subtree_end`, see arbor.models.attention): a node sees exactly its ancestors, so its hidden states are those
of the same token in any unmerged sample through it, and the forward and backward run over the trie's M nodes
instead of the samples' N tokens. The logprobs are unmerged again per original sample token
(`MicroBatch.token_nodes`, see arbor.transport.batch), so losses, gradients and metrics are those of the
unmerged batch.

How: samples are sorted lexicographically by token ids, so that in this order the trie's DFS preorder is each
sample's tokens past its longest common prefix (LCP) with the previous sample; the previous sample's nodes are
reused up to that LCP. A node's subtree ends where the first later sample diverges at or above its depth.
Packing is next-fit in that order, counting each sample's new (trie) tokens against the row budget; ranks get
contiguous runs of the order with balanced trie tokens (the cut splits at most one shared prefix per rank).

Router replay (MoE `routed_experts`): two samples share a node only if their tokens AND their routes agree along
the whole prefix. The inference engine routes a prefix computed in different batches (prefill vs decode,
another batch's padding) not necessarily identically, so equal tokens do not guarantee equal routes; merging
only when equal keeps the replay exact for every sample (unequal routes just merge less).

Departures from AReaL / MiniMax tree training: no custom attention kernel on CPU (dense boolean mask built once
per micro-batch, shared by all layers; FlexAttention block masks on CUDA) and no trie across rows.
"""

from __future__ import annotations

import numpy as np

from arbor.transport.batch import TEACHER_FIELDS, MicroBatch


def lexicographic_order(samples: list[dict[str, np.ndarray]]) -> list[int]:
    """Sample indices in lexicographic order of their token ids (a prefix sorts before its extensions)."""
    return sorted(range(len(samples)), key=lambda i: samples[i]["input_ids"].tolist())


def common_prefix(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> int:
    """Length of the prefix two samples may share in a trie: equal tokens, and equal routes when both have them."""
    n = min(len(a["input_ids"]), len(b["input_ids"]))
    eq = a["input_ids"][:n] == b["input_ids"][:n]
    ra, rb = a.get("routed_experts"), b.get("routed_experts")
    if ra is not None and rb is not None:
        eq &= (ra[:n] == rb[:n]).reshape(n, -1).all(axis=1)
    diff = np.flatnonzero(~eq)
    return int(diff[0]) if diff.size else n


def trie_increments(ordered: list[dict[str, np.ndarray]]) -> tuple[list[int], list[int]]:
    """For samples in trie order: (LCP with the previous sample (0 for the first), new trie tokens of each)."""
    lcps = [0] + [common_prefix(ordered[i - 1], ordered[i]) for i in range(1, len(ordered))]
    return lcps, [len(s["input_ids"]) - p for s, p in zip(ordered, lcps)]


def trie_size(samples: list[dict[str, np.ndarray]]) -> int:
    """Trie tokens of a set of samples (what a merged row of all of them computes)."""
    ordered = [samples[i] for i in lexicographic_order(samples)]
    return sum(trie_increments(ordered)[1])


def merge_row(ordered: list[dict[str, np.ndarray]]) -> MicroBatch:
    """One merged micro-batch of samples given in trie order (see `lexicographic_order`).

    Per-sample-token arrays are concatenated in that order (their `seq_lens`); node arrays are the trie's."""
    lens = [len(s["input_ids"]) for s in ordered]
    lcps, _ = trie_increments(ordered)
    replay = all("routed_experts" in s for s in ordered)
    starts, nodes, prev = [], [], np.zeros(0, np.int64)
    off = 0
    for n, p in zip(lens, lcps):
        starts.append(off)
        prev = np.concatenate([prev[:p], off + np.arange(n - p)])
        nodes.append(prev)
        off += n - p
    ends = _subtree_ends(lens, lcps, starts, off)
    node = {
        "input_ids": np.concatenate([s["input_ids"][p:] for s, p in zip(ordered, lcps)]),
        "position_ids": np.concatenate([np.arange(p, n) for n, p in zip(lens, lcps)]),
    }
    if replay:
        node["routed_experts"] = np.concatenate([s["routed_experts"][p:] for s, p in zip(ordered, lcps)])
    per_token = ("loss_mask", "advantages", "inference_logprobs", "policy_versions", "loss_weights")
    per_token += tuple(k for k in TEACHER_FIELDS if all(k in s for s in ordered))
    cat = {k: np.concatenate([s[k] for s in ordered]) for k in per_token}
    return MicroBatch(
        **node,
        **cat,
        seq_lens=np.array(lens, np.int32),
        subtree_end=ends.astype(np.int32),
        token_nodes=np.concatenate(nodes).astype(np.int32),
    )


def _subtree_ends(lens: list[int], lcps: list[int], starts: list[int], total: int) -> np.ndarray:
    """`subtree_end` of every node: the node sample i creates at depth d (d >= lcps[i]) ends where the first
    later sample j with min(lcps[i+1..j]) <= d starts (nothing past it shares that node); else at the row end."""
    ends = np.full(total, total, np.int64)
    for i, (n, p) in enumerate(zip(lens, lcps)):
        hi = low = n  # depths [p, hi) not yet assigned; low: running min of the later samples' LCPs
        for j in range(i + 1, len(lens)):
            low = min(low, lcps[j])
            if low < hi:
                lo = max(low, p)
                ends[starts[i] + lo - p : starts[i] + hi - p] = starts[j]
                hi = lo
                if hi <= p:
                    break
    return ends


def _balanced_cuts(lengths: list[int], incs: list[int], parts: int) -> list[tuple[int, int]]:
    """Splits the trie order into at most `parts` contiguous runs minimising the largest run's trie tokens (a
    run's first sample counts whole: its prefix is not shared across the cut). Binary search on that maximum."""

    def runs(cap: int) -> list[tuple[int, int]]:
        out, start, load = [], 0, 0
        for i in range(len(lengths)):
            cost = incs[i] if i > start else lengths[i]
            if i > start and load + cost > cap:
                out.append((start, i))
                start, load, cost = i, 0, lengths[i]
            load += cost
        return out + [(start, len(lengths))] if lengths else out

    lo, hi = max(lengths, default=0), sum(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(runs(mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return runs(lo)


def merged_rank_rows(samples: list[dict[str, np.ndarray]], ranks: int, budget: int) -> list[list[MicroBatch]]:
    """Per rank, the merged micro-batches of `samples`: ranks get contiguous runs of the trie order with balanced
    trie tokens, each run is packed next-fit into rows of at most `budget` trie tokens (a sample longer than the
    budget gets a row of its own)."""
    order = lexicographic_order(samples)
    ordered = [samples[i] for i in order]
    lcps, incs = trie_increments(ordered)
    lengths = [len(s["input_ids"]) for s in ordered]
    out: list[list[MicroBatch]] = [[] for _ in range(ranks)]
    for r, (a, b) in enumerate(_balanced_cuts(lengths, incs, ranks)):
        row, load = [], 0
        for i in range(a, b):
            cost = incs[i] if row else lengths[i]
            if row and load + cost > budget:
                out[r].append(merge_row(row))
                row, load, cost = [], 0, lengths[i]
            row.append(ordered[i])
            load += cost
        if row:
            out[r].append(merge_row(row))
    return out
