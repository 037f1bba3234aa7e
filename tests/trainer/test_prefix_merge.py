"""Prefix-tree merged training: the trie layout, the tree mask (SDPA and FlexAttention's mask_mod), and merged
against unmerged on the same samples (logprobs, loss, gradients, one trainer step, 2-rank FSDP2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.config.trainer import LossConfig
from arbor.models import build_model
from arbor.models.attention import packed_causal_mask, subtree_end_for, tree_block_mask, tree_mask, tree_mask_mod
from arbor.orchestrator.batcher import _micro_batch, build_step_batches, sample_arrays
from arbor.orchestrator.prefix_tree import common_prefix, lexicographic_order, merge_row, trie_size
from arbor.orchestrator.rollout import Rollout
from arbor.run_dir import broadcast_dir
from arbor.run_dir import rollout_rank_file as rank_file
from arbor.trainer.loss import LossContext, ppo_clip
from arbor.trainer.main import main as trainer_main
from arbor.trainer.step import micro_batch_logprobs
from arbor.transport.files import read_step, write_step

CPU = torch.device("cpu")
TOL = 1e-5


def _seq(gen: np.random.Generator, n: int) -> list[int]:
    return gen.integers(1, 250, n).tolist()


def tree_rollouts(seed: int = 0) -> list[Rollout]:
    """Samples covering the cases: a shared system prompt, branches at several depths (inside the prompt and
    inside the completion), a sample with no shared prefix, two identical samples (different advantages), and a
    sample that is a prefix of another."""
    g = np.random.default_rng(seed)
    system, hist = _seq(g, 9), _seq(g, 6)
    seqs = [
        (system + hist + _seq(g, 3), _seq(g, 5)),  # branch after system + history
        (system + hist + _seq(g, 2), _seq(g, 7)),
        (system + _seq(g, 4), _seq(g, 6)),  # branch right after the system prompt
        (system[:3] + _seq(g, 5), _seq(g, 4)),  # branch at depth 3
        (_seq(g, 6), _seq(g, 5)),  # nothing shared
    ]
    a_prompt, a_comp = system + hist, _seq(g, 8)
    seqs += [(a_prompt, a_comp), (a_prompt, list(a_comp))]  # identical samples
    seqs += [(a_prompt, a_comp[:4]), (a_prompt, a_comp[:4] + _seq(g, 3))]  # prefix of another; branch in completion
    out = []
    for i, (p, c) in enumerate(seqs):
        out.append(
            Rollout(
                i,
                p,
                c,
                (-0.5 - 0.3 * g.random(len(c))).tolist(),
                [0] * len(c),
                "",
                "stop",
                advantage=float(g.normal()),
                group_id=i % 3,
            )
        )
    return out


def _samples(rollouts: list[Rollout]) -> list[dict[str, np.ndarray]]:
    return [sample_arrays(r) for r in rollouts]


# --- layout and masks -----------------------------------------------------------------------------------------


def test_trie_layout_maps_every_sample_token_and_masks_ancestors_only():
    samples = _samples(tree_rollouts())
    ordered = [samples[i] for i in lexicographic_order(samples)]
    mb = merge_row(ordered).torch()
    total = sum(len(s["input_ids"]) for s in samples)
    assert mb.num_tokens == trie_size(samples) < total
    assert int(mb.seq_lens.sum()) == mb.token_nodes.shape[0] == mb.loss_mask.shape[0] == total
    nodes = mb.token_nodes.long()
    mask = tree_mask(mb.subtree_end)[0, 0]
    off = 0
    for s in ordered:
        n = len(s["input_ids"])
        path = nodes[off : off + n]
        assert mb.input_ids[path].tolist() == s["input_ids"].tolist()
        assert mb.position_ids[path].tolist() == list(range(n))
        for t in range(n):  # a node attends to exactly its ancestors and itself: the sample's own prefix
            assert set(torch.nonzero(mask[path[t]]).flatten().tolist()) == set(path[: t + 1].tolist())
        off += n
    pred = mb.predictor_nodes()
    starts = np.cumsum([0] + mb.seq_lens.tolist()[:-1])
    assert (pred[starts] == -1).all() and (pred >= -1).all()


def test_packed_rows_are_tree_rows_of_chains():
    lens, T = [4, 1, 6], 13  # 2 padding tokens
    end = subtree_end_for(lens, T)
    assert end.tolist() == [4] * 4 + [5] + [11] * 6 + [12, 13]
    doc = torch.tensor([0] * 4 + [1] + [2] * 6 + [3, 4])
    idx = torch.arange(T)
    reference = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    assert torch.equal(packed_causal_mask(lens, T)[0, 0], reference)


def test_flex_mask_mod_gives_the_sdpa_mask():
    from torch.nn.attention.flex_attention import create_mask

    samples = _samples(tree_rollouts(3))
    mb = merge_row([samples[i] for i in lexicographic_order(samples)]).torch()
    M = mb.num_tokens
    dense = create_mask(tree_mask_mod(mb.subtree_end), None, None, M, M, device="cpu")
    assert torch.equal(dense.reshape(M, M), tree_mask(mb.subtree_end)[0, 0])


def _segment_rows() -> list[torch.Tensor]:
    """`subtree_end` of rows the trainer forwards: packed samples with padding; two merged prefix trees with
    packed samples between and after them, then padding; one long sample that fills its row (no cut); padding."""
    parts = []
    for n, chain in ((3, 10), (4, 20), (None, 30), (None, -40)):
        if n is not None:
            samples = _samples(tree_rollouts(n))
            parts.append(merge_row([samples[i] for i in lexicographic_order(samples)]).torch().subtree_end.long())
        ends = torch.full((chain,), chain) if chain > 0 else torch.arange(1, -chain + 1)
        parts.append(ends)
    row, at = [], 0
    for part in parts:  # each part's ends, from its own start to the row's
        row.append(part + at)
        at += part.shape[0]
    packed, long, padding = subtree_end_for([9, 3, 17, 1, 8, 12], 64), subtree_end_for([40], 40), subtree_end_for([], 7)
    return [packed, torch.cat(row), long, padding]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_attention_equals_the_dense_tree_mask_forward_and_backward(dtype):
    """On CPU the trainer cuts a row into chunks no attention crosses (`segment_mask`): outputs and the gradients
    of q, k, v equal SDPA under the row's dense mask, for packed samples, merged trees and padding; a row that
    cuts too little keeps the dense mask."""
    from arbor.models.attention import SegmentMask, attend, segment_mask

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(0)
    kinds = []
    for end in _segment_rows():
        T = end.shape[0]
        seg = segment_mask(end)
        kinds.append(type(seg).__name__)
        q, k, v = (torch.randn(1, h, T, 16, generator=gen).to(dtype).requires_grad_() for h in (4, 2, 2))
        outs = []
        for mask in (seg, tree_mask(end)):
            out = attend(q, k, v, mask, True)
            outs.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
        for a, b in zip(*outs):  # relative to the largest value: the gradients reach ~10
            scale = max(1.0, b.float().abs().max().item())
            assert a.shape == b.shape and (a.float() - b.float()).abs().max() <= tol * scale
    assert kinds == ["SegmentMask", "SegmentMask", "Tensor", "SegmentMask"]
    assert segment_mask(torch.zeros(0, dtype=torch.long)).shape == (1, 1, 0, 0)  # an empty row: dense, empty
    packed = segment_mask(subtree_end_for([9, 3, 17, 1, 8, 12], 64))
    assert isinstance(packed, SegmentMask) and packed.index.shape == (5, 17)  # 50 tokens and 14 of padding


def group_rollouts(groups: int, group_size: int, seed: int = 0) -> list[Rollout]:
    """RL groups as the quick start makes them: every prompt opens with the same template tokens, then its task's
    own; each group's samples share their prompt and branch at the completion (one merged tree per row)."""
    g = np.random.default_rng(seed)
    template, out = _seq(g, 15), []
    for group in range(groups):
        prompt = template + _seq(g, int(g.integers(15, 20)))
        for _ in range(group_size):
            c = _seq(g, int(g.integers(3, 7)))
            logprobs = (-0.5 - 0.3 * g.random(len(c))).tolist()
            out.append(Rollout(len(out), prompt, c, logprobs, [0] * len(c), "", "stop", advantage=1.0, group_id=group))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_of_groups_is_cut_by_group_under_its_shared_root(dtype):
    """A row of RL groups whose prompts share the template's first tokens is one tree, no span of it closed to
    attention: `segment_mask` cascades it (each chunk holds the shared root and whole groups) where the row
    would otherwise stay dense, and outputs and q/k/v gradients equal SDPA under the dense mask; packed samples
    and padding beside the tree cut as before."""
    from arbor.models.attention import SegmentMask, attend, segment_mask

    samples = _samples(group_rollouts(8, 8))
    tree = merge_row([samples[i] for i in lexicographic_order(samples)]).torch().subtree_end.long()
    T = tree.shape[0]
    tail = subtree_end_for([30, 12, 25], 80) + T  # packed samples, then padding, after the tree
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(0)
    for end in (tree, torch.cat([tree, tail])):
        seg = segment_mask(end)
        assert isinstance(seg, SegmentMask)
        S, C = seg.index.shape
        assert S * C * C * 4 < end.shape[0] ** 2  # a quarter of the dense area at most
        of_tree = seg.index[:, 0] < T
        assert of_tree.sum() >= 2 and (seg.index[of_tree, :15] == torch.arange(15)).all()  # the root leads each
        q, k, v = (torch.randn(1, h, end.shape[0], 16, generator=gen).to(dtype).requires_grad_() for h in (4, 2, 2))
        outs = []
        for mask in (seg, tree_mask(end)):
            out = attend(q, k, v, mask, True)
            outs.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
        for a, b in zip(*outs):
            scale = max(1.0, b.float().abs().max().item())
            assert (a.float() - b.float()).abs().max() <= tol * scale


@pytest.mark.slow
def test_flex_block_mask_forward_matches_dense_sdpa_on_cpu():
    """FlexAttention runs forward only on CPU (eager): the block mask built from the mask_mod gives SDPA's output."""
    from torch.nn.attention.flex_attention import flex_attention

    from arbor.models.attention import attend

    samples = _samples(tree_rollouts(4))
    mb = merge_row([samples[i] for i in lexicographic_order(samples)]).torch()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, mb.num_tokens, 16, generator=gen) for h in (4, 2, 2))
    with torch.no_grad():
        flex = flex_attention(q, k, v, block_mask=tree_block_mask(mb.subtree_end), enable_gqa=True)
        dense = attend(q, k, v, tree_mask(mb.subtree_end), True)
    assert (flex - dense).abs().max().item() < 1e-5


@pytest.mark.gpu(reason="compiled FlexAttention block-mask kernels on CUDA")
def test_flex_block_mask_forward_backward_matches_dense_sdpa_on_gpu():
    """CUDA: the same merged row through FlexAttention (block mask) and through SDPA with the dense mask."""
    from arbor.models.attention import attend

    dev = torch.device("cuda")
    samples = _samples(tree_rollouts(5))
    mb = merge_row([samples[i] for i in lexicographic_order(samples)]).torch()
    end = mb.subtree_end.to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 4, mb.num_tokens, 32, device=dev, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, mb.num_tokens, 32, device=dev, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, mb.num_tokens, 32, device=dev, generator=gen, requires_grad=True)
    flex = attend(q, k, v, tree_block_mask(end), True)
    (gq, gk, gv) = torch.autograd.grad(flex.square().sum(), (q, k, v))
    dense = attend(q, k, v, tree_mask(end), True)
    (rq, rk, rv) = torch.autograd.grad(dense.square().sum(), (q, k, v))
    for a, b in ((flex, dense), (gq, rq), (gk, rk), (gv, rv)):
        assert (a - b).abs().max().item() < 1e-4


# --- merged against unmerged ----------------------------------------------------------------------------------


def _with_routes(model, rollouts: list[Rollout], perturb: int | None = None) -> None:
    """Router replay: each rollout's routes from its own forward; `perturb` changes one sample's route at a
    prompt position that it shares with others (such a sample must then merge less, still exactly)."""
    with torch.no_grad():
        for r in rollouts:
            model(torch.tensor(r.prompt_ids + r.completion_ids)[None])
            r.routed_experts = model.last_routed_experts[0].numpy().astype(np.uint8)
    if perturb is not None:
        routes = rollouts[perturb].routed_experts
        routes[5, 0] = (routes[5, 0] + 1) % model.args.num_experts


def _loss_and_grads(model, mb, replay: bool, device: torch.device = CPU):
    """(logprobs, loss incl. an MoE aux loss, gradients) of one micro-batch, all on the CPU."""
    model.zero_grad(set_to_none=True)
    logprobs, _ = micro_batch_logprobs(model, mb, 0.8, device, router_replay=replay)
    ctx = LossContext(mb.seq_lens.to(device), mb.loss_weights.to(device))
    out = ppo_clip(
        logprobs, mb.inference_logprobs.to(device), mb.advantages.to(device), mb.loss_mask.to(device), LossConfig(), ctx
    )
    total = out.loss_sum + (model.aux_loss if getattr(model, "aux_loss", None) is not None else 0.0)
    total.backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return logprobs.detach().cpu(), total.detach().cpu(), grads


@pytest.mark.parametrize(
    "preset, replay, perturb",
    [
        ("qwen3-test", False, None),
        ("qwen3-moe-test", False, None),
        ("qwen3-moe-test", True, None),
        ("qwen3-moe-test", True, 1),
    ],
)
def test_merged_equals_unmerged_logprobs_loss_and_gradients(preset, replay, perturb):
    model = build_model(ModelConfig(name=preset))
    model.train()
    rollouts = tree_rollouts(1)
    if replay:
        _with_routes(model, rollouts, perturb)
    samples = _samples(rollouts)
    ordered = [samples[i] for i in lexicographic_order(samples)]
    merged, plain = merge_row(ordered).torch(), _micro_batch(ordered).torch()
    assert merged.num_tokens < plain.num_tokens
    if perturb is not None:  # the perturbed sample shares only the 5 tokens before its changed route
        head = samples[perturb]["input_ids"][:9].tolist()
        other = next(s for s in samples if s is not samples[perturb] and s["input_ids"][:9].tolist() == head)
        assert common_prefix(samples[perturb], other) == 5
    lp_m, loss_m, grads_m = _loss_and_grads(model, merged, replay)
    lp_p, loss_p, grads_p = _loss_and_grads(model, plain, replay)
    starts = torch.tensor(np.cumsum([0] + plain.seq_lens.tolist()[:-1]))
    keep = torch.ones_like(lp_p, dtype=torch.bool)
    keep[starts] = False  # a sample's first token has no prediction (the plain row scores it from its neighbour)
    assert (lp_m[keep] - lp_p[keep]).abs().max().item() < TOL
    assert abs(loss_m.item() - loss_p.item()) < TOL
    for name in grads_p:
        err = (grads_m[name] - grads_p[name]).abs().max().item()
        assert err < TOL, f"{name}: gradient differs by {err:.3g}"


@pytest.mark.gpu(reason="compiled FlexAttention block-mask kernels on CUDA")
def test_merged_equals_unmerged_on_gpu_with_flex_attention():
    """CUDA, fp32: both rows go through FlexAttention block masks (compiled); merged equals unmerged."""
    dev = torch.device("cuda")
    model = build_model(ModelConfig(name="qwen3-tiny"), device="cuda")
    samples = _samples(tree_rollouts(9))
    ordered = [samples[i] for i in lexicographic_order(samples)]
    lp_m, loss_m, grads_m = _loss_and_grads(model, merge_row(ordered).torch(), False, dev)
    lp_p, loss_p, grads_p = _loss_and_grads(model, _micro_batch(ordered).torch(), False, dev)
    mask = torch.from_numpy(np.concatenate([s["loss_mask"] for s in ordered]))
    assert (lp_m[mask] - lp_p[mask]).abs().max().item() < 1e-4
    assert abs(loss_m.item() - loss_p.item()) < 1e-4
    for name in grads_p:
        assert (grads_m[name] - grads_p[name]).abs().max().item() < 1e-4, name


def test_merged_entropy_and_ref_logprobs_equal_unmerged():
    model = build_model(ModelConfig(name="qwen3-test"))
    samples = _samples(tree_rollouts(2))
    ordered = [samples[i] for i in lexicographic_order(samples)]
    with torch.no_grad():
        lp_m, ent_m = micro_batch_logprobs(model, merge_row(ordered).torch(), 1.0, CPU)
        lp_p, ent_p = micro_batch_logprobs(model, _micro_batch(ordered).torch(), 1.0, CPU)
    mask = torch.from_numpy(np.concatenate([s["loss_mask"] for s in ordered]))
    assert (ent_m[mask] - ent_p[mask]).abs().max().item() < TOL
    assert (lp_m[mask] - lp_p[mask]).abs().max().item() < TOL


# --- batcher -> file -> trainer ------------------------------------------------------------------------------


def test_merged_batches_keep_every_sample_respect_the_budget_and_balance_ranks(tmp_path: Path):
    rollouts = tree_rollouts(4) + tree_rollouts(5)
    budget = 64
    batches = build_step_batches(
        rollouts,
        step=0,
        ranks=2,
        micro_batch_tokens=budget,
        temperature=1.0,
        pad_id=0,
        normalization="sequence",
        prefix_merge=True,
    )
    write_step(tmp_path, 0, batches)
    batches = [read_step(rank_file(tmp_path, 0, r)) for r in range(2)]
    assert len(batches[0].micro_batches) == len(batches[1].micro_batches)
    seen, trie = [], []
    for b in batches:
        assert b.metadata["prefix_merge"] is True
        trie.append(sum(mb.num_tokens for mb in b.micro_batches if mb.merged))
        for mb in b.micro_batches:
            assert mb.num_tokens <= budget or len(mb.seq_lens) == 1
            if not mb.merged:  # equal micro-batch counts: a one-token row with an empty loss mask
                assert not mb.loss_mask.any()
                continue
            toks = mb.input_ids[mb.token_nodes.long()]
            seen += [tuple(t.tolist()) for t in torch.split(toks, mb.seq_lens.tolist())]
    assert sorted(seen) == sorted(tuple(r.prompt_ids + r.completion_ids) for r in rollouts)
    assert max(trie) - min(trie) <= max(r.num_tokens for r in rollouts)
    assert sum(trie) < sum(r.num_tokens for r in rollouts)


def _write_step_rollouts(out: Path, ranks: int, prefix_merge: bool, budget: int = 48) -> None:
    """The batcher's files for the same rollouts; inference logprobs from the initial model (ratios near 1)."""
    model = build_model(ModelConfig(name="qwen3-test"))
    rollouts = tree_rollouts(6) + tree_rollouts(7)
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor(r.prompt_ids + r.completion_ids)
            lp = torch.log_softmax(model(ids[None])[0].float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
            r.logprobs = (lp[len(r.prompt_ids) - 1 :] + 0.05).tolist()
    batches = build_step_batches(rollouts, 0, ranks, budget, 1.0, 0, "token", prefix_merge)
    write_step(out, 0, batches)


def _trainer_args(out: Path, *extra: str) -> list[str]:
    # Adam's first update is lr * g / (|g| + eps): with the default eps 1e-8 a gradient entry of ~1e-8 turns a
    # 1e-9 rounding difference (gradients agree to ~1e-8 here) into a visible update difference, so the
    # comparison uses eps 1e-6, which keeps it about the update rather than about that conditioning.
    return [
        "--output-dir",
        str(out),
        "--max-steps",
        "1",
        "--model.name",
        "qwen3-test",
        "--optim.lr",
        "1e-3",
        "--optim.eps",
        "1e-6",
        "--num-threads",
        "1",
        *extra,
    ]


def _assert_same_step(a: Path, b: Path) -> None:
    import json

    from test_trainer_dist import assert_same_weights

    ma, mb = (json.loads((d / "metrics" / "trainer.jsonl").read_text().splitlines()[0]) for d in (a, b))
    assert ma["loss"] == pytest.approx(mb["loss"], abs=TOL)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=TOL)
    assert ma["num_tokens"] == mb["num_tokens"] and ma["loss_tokens"] == mb["loss_tokens"]
    assert ma["mismatch_kl"] == pytest.approx(mb["mismatch_kl"], abs=1e-6)
    assert_same_weights(broadcast_dir(a, 1), broadcast_dir(b, 1), atol=TOL)


def test_one_trainer_step_merged_equals_unmerged(tmp_path: Path):
    merged, plain = tmp_path / "merged", tmp_path / "plain"
    _write_step_rollouts(merged, 1, True)
    _write_step_rollouts(plain, 1, False)
    assert trainer_main(_trainer_args(merged)) == 0
    assert trainer_main(_trainer_args(plain)) == 0
    _assert_same_step(merged, plain)


@pytest.mark.slow
def test_two_rank_fsdp_merged_equals_one_rank_unmerged(tmp_path: Path):
    from test_trainer_dist import run_torchrun

    merged, plain = tmp_path / "merged", tmp_path / "plain"
    _write_step_rollouts(merged, 2, True)
    _write_step_rollouts(plain, 1, False)
    run_torchrun(2, _trainer_args(merged, "--parallel.nproc", "2"))
    assert trainer_main(_trainer_args(plain)) == 0
    _assert_same_step(merged, plain)


def test_prefix_merge_with_context_parallel_fails_at_config_time():
    from pydantic import ValidationError

    from arbor.config.rl import RLConfig

    with pytest.raises(ValidationError, match=r"orchestrator.batching.prefix_merge.*trainer.parallel.cp"):
        RLConfig.model_validate(
            {
                "trainer": {"parallel": {"nproc": 2, "cp": 2}},
                "orchestrator": {"batching": {"prefix_merge": True}},
            }
        )
    cfg = RLConfig.model_validate({"orchestrator": {"batching": {"prefix_merge": True}}})
    assert cfg.orchestrator.batching.prefix_merge


def test_plain_rows_have_no_tree_fields_and_a_merged_row_needs_its_mask():
    samples = _samples(tree_rollouts(8))
    plain = _micro_batch(samples[:3])
    assert plain.subtree_end is None and plain.token_nodes is None and not plain.merged
    assert torch.equal(plain.row_subtree_end(), subtree_end_for(plain.seq_lens, plain.num_tokens))
    with pytest.raises(ValueError, match="subtree_end"):
        dataclasses.replace(merge_row(samples[:2]), subtree_end=None)


def test_merged_batching_edge_cases_more_ranks_than_samples_long_sample_and_no_sample():
    rollouts = tree_rollouts(10)[:2]
    batches = build_step_batches(rollouts, 0, 4, 16, 1.0, 0, prefix_merge=True)  # budget below every sample
    assert len(batches) == 4 and len({len(b.micro_batches) for b in batches}) == 1
    merged = [mb for b in batches for mb in b.micro_batches if mb.merged]
    assert sorted(len(mb.seq_lens) for mb in merged) == [1, 1]  # each over-long sample alone in its row
    assert all(build_step_batches([], 0, 2, 64, 1.0, 0, prefix_merge=True)[r].micro_batches == [] for r in range(2))
