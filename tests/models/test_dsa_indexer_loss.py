"""The DSA lightning indexer's KL loss to the main attention (arbor.models.dsa_indexer_loss, `trainer.indexer`):
against a naive dense reference, the detach (policy gradients unchanged), learning, context parallel = one rank,
config errors, and an `rl` run that trains and publishes the indexer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_parallel import _spawn, assert_close

from arbor.config.model import ModelConfig
from arbor.config.trainer import TrainerConfig
from arbor.models import build_model
from arbor.models.attention import packed_causal_mask, position_ids_for
from arbor.models.dsa_indexer_loss import enable_indexer_training
from arbor.trainer.draft import clip_grad_norm_groups
from arbor.trainer.step import packed_logprobs

LENS = [37, 5, 22]  # documents longer than dsa-test's index_topk (8): selection is really sparse


def _model(dtype: torch.dtype = torch.float32, train: bool = True, seed: int = 0, device: str = "cpu"):
    model = build_model(ModelConfig(name="dsa-test")).train()
    model.init_weights(seed, std=0.3)
    if train:
        enable_indexer_training(model, 1.0)
    return model.to(device=device, dtype=dtype)


def _batch(seed: int = 1, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, sum(LENS)), generator=gen)
    return ids.to(device), position_ids_for(LENS).to(device), packed_causal_mask(LENS).to(device)


def _capture(model) -> list[dict]:
    """Records each attention layer's inputs (x, rope, mask) on the next forward."""
    seen: list[dict] = []
    for layer in model.model.layers:

        def hook(mod, args, seen=seen):
            x, rope, _, attn_mask = args[:4]
            seen.append({"x": x.detach(), "rope": rope, "mask": attn_mask[:, 0], "attn": mod})

        layer.self_attn.register_forward_pre_hook(hook)
    return seen


def _dense_target(attn, x, rope, mask, idx, valid) -> torch.Tensor:
    """Full per-head softmax with per-head keys and values expanded (no absorbed form), gathered at the selection,
    renormalised per head (the sparse attention's distribution), summed over heads, L1-normalised: `[B, T, k]`."""
    a = attn.args
    B, T, _ = x.shape
    with torch.no_grad():
        q_nope, q_pe, _, _, row = attn.project(x, rope)
        c_kv, k_pe = row[..., : a.kv_lora_rank], row[..., a.kv_lora_rank : a.kv_lora_rank + a.qk_rope_head_dim]
        kv = F.linear(c_kv, attn.kv_b_proj.weight).view(B, T, a.num_attention_heads, -1)
        k_nope = kv[..., : a.qk_nope_head_dim]
        s = torch.einsum("bqhd,bkhd->bhqk", q_nope.double(), k_nope.double())
        s = (s + torch.einsum("bqhd,bkd->bhqk", q_pe.double(), k_pe.double())) * attn.scale
        p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)  # [B, H, T, T]
        sel = p.gather(-1, idx.clamp(min=0)[:, None].expand(-1, p.shape[1], -1, -1)) * valid[:, None]
        sel = sel / sel.sum(-1, keepdim=True)
        t = sel.sum(1)
        return t / t.sum(-1, keepdim=True)


def _reference(model, seen: list[dict]) -> torch.Tensor:
    """Sum over layers of the mean KL over queries with >= 2 valid selected keys, with the indexer's scores over
    every key computed densely with plain ops and then gathered; gradient reaches the indexers' weights."""
    total = torch.zeros((), dtype=torch.float64)
    for rec in seen:
        attn, x, rope, mask = rec["attn"], rec["x"], rec["rope"], rec["mask"]
        top = attn.last_topk
        valid, idx = top >= 0, top.clamp(min=0)
        target = _dense_target(attn, x, rope, mask, idx, valid)
        q_lat = attn.q_a_layernorm(attn.q_a_proj(x)).detach()
        q, w, k = attn.indexer(x, q_lat, *rope, grad=True)
        dense = torch.einsum("bthd,bsd->bths", q.double(), k.double()).relu()
        scores = torch.einsum("bths,bth->bts", dense, w.double()).gather(-1, idx)
        logq = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), -1).masked_fill(~valid, 0.0)
        kl = (torch.xlogy(target, target) - target * logq).sum(-1)
        counted = valid.sum(-1) >= 2
        total = total + kl[counted].sum() / counted.sum()
    return total


def _indexer_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if ".indexer." in n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_matches_a_dense_reference(dtype):
    """The model's `aux_loss` and its indexer gradients equal the naive dense reference's: fp32 to 1e-5; the bf16
    twin against an fp32 reference from the same (bf16) weights and layer inputs, to bf16 rounding."""
    model = _model(dtype)
    ref_model = copy.deepcopy(model).float()  # bf16 weights are exact in fp32
    seen = _capture(model)
    model(*_batch())
    assert model.aux_loss is not None and model.indexer_stats is not None
    names = [n for n, _ in _indexer_params(model)]
    got = torch.autograd.grad(model.aux_loss, [p for _, p in _indexer_params(model)])
    ref_seen = [dict(r, attn=ref_model.get_submodule(f"model.layers.{i}.self_attn")) for i, r in enumerate(seen)]
    for rec, orig in zip(ref_seen, seen):
        rec["x"], rec["attn"].last_topk = orig["x"].float(), orig["attn"].last_topk
        rec["rope"] = tuple(t.float() for t in orig["rope"])
    ref = _reference(ref_model, ref_seen)
    want = torch.autograd.grad(ref, [p for _, p in _indexer_params(ref_model)])
    rel = 1e-5 if dtype == torch.float32 else 3e-2
    assert_close(model.aux_loss.double(), ref.detach(), "indexer KL", rel)
    assert float(ref.detach()) > 0.05  # a real distance: the random indexer disagrees with the attention
    L = model.args.num_hidden_layers
    assert float(model.indexer_stats[0] / model.indexer_stats[1]) == pytest.approx(float(ref.detach()) / L, rel=rel)
    for n, g, w in zip(names, got, want):
        assert_close(g.double(), w.double(), f"indexer grad {n}", rel if dtype == torch.float32 else 8e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_loss_leaves_the_policy_gradients_unchanged(dtype):
    """train = true: every non-indexer gradient is bit-identical to train = false's (the indexer reads detached
    inputs) and only the indexers get extra gradient; train = false: the indexers get none. The policy's clipped
    norm is unchanged too, the indexers being their own clipping group. No gradient, or eval mode: no loss."""
    on, off = _model(dtype), _model(dtype, train=False)
    ids, pos, mask = _batch()
    lp_on = on(ids, pos, mask).float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum()
    lp_off = off(ids, pos, mask).float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum()
    assert torch.equal(lp_on, lp_off)
    assert off.aux_loss is None and on.aux_loss is not None
    (-lp_on + on.aux_loss).backward()
    (-lp_off).backward()
    for (n, p_on), (_, p_off) in zip(on.named_parameters(), off.named_parameters(), strict=True):
        if ".indexer." in n:
            assert p_off.grad is None, n
            assert p_on.grad is not None and p_on.grad.abs().sum() > 0, n
        elif p_off.grad is None:
            assert p_on.grad is None, n
        else:
            assert torch.equal(p_on.grad, p_off.grad), n
    norms_on, norms_off = clip_grad_norm_groups(on, 0.1), clip_grad_norm_groups(off, 0.1)
    assert set(norms_off) == {"policy"} and set(norms_on) == {"policy", "indexer"}
    assert torch.equal(norms_on["policy"], norms_off["policy"])
    assert float(norms_on["indexer"]) > 0
    with torch.no_grad():
        on(ids, pos, mask)
    assert on.aux_loss is None and on.indexer_stats is None
    on.eval()
    on(ids, pos, mask)
    assert on.aux_loss is None


def test_activation_checkpointing_recomputes_the_same_indexer_loss():
    """Under the trainer's per-layer activation checkpointing (its recompute runs the indexer loss again inside
    backward), the loss and every gradient equal the plain forward's, and no layer keeps a loss sink."""
    from arbor.trainer.parallel import apply_ac

    plain = _model()
    ac = copy.deepcopy(plain)
    apply_ac(ac)
    for m in (plain, ac):
        (m(*_batch()).square().mean() + m.aux_loss).backward()
    assert torch.equal(plain.aux_loss, ac.aux_loss)
    for (n, p), (_, q) in zip(plain.named_parameters(), ac.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert_close(q.grad, p.grad, f"ac grad {n}", 1e-6)
    assert all(layer.self_attn.indexer_sink is None for layer in ac.model.layers)


def _fit_indexer(model, params, inputs, steps: int) -> list[float]:
    """`steps` Adam steps (lr 2e-2) on the indexer loss alone over one batch; the KL before each."""
    opt = torch.optim.Adam(params, lr=2e-2)
    kls = []
    for _ in range(steps):
        model(*inputs)
        kls.append(float(model.aux_loss))
        opt.zero_grad()
        model.aux_loss.backward()
        opt.step()
    return kls


def _overlap(model, ids, pos, mask, seen) -> float:
    """Mean fraction of each sparse query's selection that is among the main attention's k best keys (dense
    attention probabilities summed over heads), over layers and queries that see more than k keys."""
    seen.clear()
    with torch.no_grad():
        model(ids, pos, mask)
    k, hits, n = model.args.index_topk, 0.0, 0
    for rec in seen:
        attn, x, rope, m = rec["attn"], rec["x"], rec["rope"], rec["mask"]
        T = x.shape[1]
        full = torch.arange(T)[None, None].expand(1, T, T)
        p = _dense_target(attn, x, rope, m, full, m)  # over every visible key: the attention itself
        best = p.topk(k, dim=-1).indices
        sparse = m.sum(-1) > k
        top = attn.last_topk
        same = (top[..., :, None] == best[..., None, :]).any(-1).float().sum(-1) / k
        hits, n = hits + float(same[sparse].sum()), n + int(sparse.sum())
    return hits / n


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_training_the_indexer_lowers_its_kl_and_raises_top_k_overlap(seed):
    """From a random indexer, 80 Adam steps on the indexer loss alone (fixed batch) cut the KL by >= 30% and raise
    the overlap of its selection with the main attention's top keys."""
    model = _model(seed=3 + seed)
    with torch.no_grad():  # a random indexer, unrelated to the attention
        gen = torch.Generator().manual_seed(11 + seed)
        for _, p in _indexer_params(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if p.dim() > 1 else torch.ones_like(p))
    ids, pos, mask = _batch(seed=5 + seed)
    seen = _capture(model)
    overlap0 = _overlap(model, ids, pos, mask, seen)
    kls = _fit_indexer(model, [p for _, p in _indexer_params(model)], (ids, pos, mask), 80)
    overlap1 = _overlap(model, ids, pos, mask, seen)
    print(f"kl {kls[0]:.4f} -> {kls[-1]:.4f}, overlap {overlap0:.3f} -> {overlap1:.3f}")
    assert kls[-1] < 0.7 * kls[0], kls
    assert overlap1 > overlap0 + 0.05, (overlap0, overlap1)


def test_config_errors():
    with pytest.raises(ValueError, match=r"trainer.indexer.train = true needs a DeepSeek sparse .* qwen3-test"):
        TrainerConfig(model=ModelConfig(name="qwen3-test"), indexer={"train": True})
    with pytest.raises(ValueError, match="indexer.weight"):
        TrainerConfig(model=ModelConfig(name="dsa-test"), indexer={"train": True, "weight": 0})
    with pytest.raises(ValueError, match=r"trainer.indexer.train = true: a LoRA run"):
        TrainerConfig(model=ModelConfig(name="dsa-test", lora={"rank": 4}), indexer={"train": True})
    TrainerConfig(model=ModelConfig(name="qwen3-test"))  # off by default: any model
    TrainerConfig(model=ModelConfig(name="dsa-test"), indexer={"train": True}, parallel={"cp": 2})
    from arbor.config.loader import ConfigError, load_config
    from arbor.config.rl import RLConfig

    with pytest.raises(ConfigError, match=r"^trainer.indexer.train = true needs a DeepSeek .* qwen3-test"):
        load_config(RLConfig, ["--model.name", "qwen3-test", "--trainer.indexer.train", "true"], env={})
    rl = load_config(RLConfig, ["--model.name", "dsa-test", "--trainer.indexer.train", "true"], env={})
    assert rl.trainer.indexer.train and rl.trainer.indexer.weight == 1.0
    with pytest.raises(ValueError, match="trainer.indexer.train = true: Qwen3ForCausalLM has no DeepSeek"):
        enable_indexer_training(build_model(ModelConfig(name="qwen3-test")), 1.0)


# --- context parallel: CP=2 == CP=1 ----------------------------------------------------------------------------


def _cp_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from arbor.trainer.dsa_cp import apply_dsa_cp
    from arbor.trainer.parallel_state import ParallelState

    ref = _model(seed=5)
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(6)
    T = sum(LENS) + 3  # trailing padding as the batcher leaves it
    ids = torch.randint(0, 256, (T,), generator=gen)
    pos = position_ids_for(LENS, T)[0]
    w = torch.randn(T, generator=gen)
    lp_ref, _ = packed_logprobs(ref, ids, pos, LENS, 1.0, torch.device("cpu"))
    ((lp_ref * w).sum() + ref.aux_loss).backward()

    cp = apply_dsa_cp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    lp, _ = packed_logprobs(model, ids, pos, LENS, 1.0, torch.device("cpu"), state=ParallelState(cp=cp))
    assert_close(model.aux_loss.detach(), ref.aux_loss.detach(), "cp indexer KL", 1e-5)
    assert torch.equal(model.indexer_stats[1], ref.indexer_stats[1])  # the same queries counted
    assert_close(model.indexer_stats[0], ref.indexer_stats[0], "cp indexer KL sum", 1e-5)
    ((lp * w).sum() + model.aux_loss).backward()
    for (n, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if p_ref.grad is None:
            assert p.grad is None, n
            continue
        g = p.grad.clone()
        dist.all_reduce(g)  # every cp rank holds the whole row's losses: the sum over ranks is cp x the gradient
        assert_close(g / world, p_ref.grad, f"cp grad {n}", 1e-5)


@pytest.mark.slow
def test_context_parallel_indexer_loss_matches_one_rank():
    """cp_style dsa on 2 gloo ranks: the same indexer KL and the same indexer (and policy) gradients as one rank,
    fp32, to 1e-5."""
    _spawn(_cp_worker)


# --- end to end -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rl_run_trains_and_publishes_the_indexer(tmp_path):
    """`rl` on dsa-test (local CPU engine with the latent cache, one trainer rank) with `--trainer.indexer.train
    true`: every step reports `indexer/kl` and `indexer/grad_norm`, the policy stays on policy, and every
    published indexer tensor changes from the first published version to the second."""
    import subprocess
    import sys

    from test_rl_e2e import TINY

    from arbor.models.hf import read_safetensors_dir
    from arbor.monitor.metrics import read_jsonl
    from arbor.run_dir import broadcast_dir

    args = [a if a != "qwen3-test" else "dsa-test" for a in TINY]
    out = tmp_path / "run"
    extra = ["--max-steps", "2", "--orchestrator.scheduler.mode", "sync", "--trainer.indexer.train", "true"]
    proc = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "--output-dir", str(out), *args, *extra],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 < r["indexer/kl"] < 10 and r["indexer/grad_norm"] > 0, r
        assert r["mismatch_kl"] < 1e-3
    first, last = read_safetensors_dir(broadcast_dir(out, 1)), read_safetensors_dir(broadcast_dir(out, 2))
    names = [n for n in first if ".indexer." in n]
    assert len(names) == 10 and all(not torch.equal(first[n], last[n]) for n in names), names


@pytest.mark.gpu(reason="the indexer loss on CUDA in bf16 (dense reference, detach, a few learning steps)")
def test_indexer_loss_on_cuda_bf16():
    """The CPU tests' checks on CUDA in bf16: KL and indexer gradients against the fp32 dense reference, the
    policy's gradients unchanged by the loss, and the KL falling under Adam on the indexer alone."""
    model = _model(torch.bfloat16, device="cuda")
    ref_model = copy.deepcopy(model).float()
    seen = _capture(model)
    model(*_batch(device="cuda"))
    params = [p for _, p in _indexer_params(model)]
    got = torch.autograd.grad(model.aux_loss, params)
    for i, rec in enumerate(seen):
        attn = ref_model.get_submodule(f"model.layers.{i}.self_attn")
        attn.last_topk = rec["attn"].last_topk
        seen[i] = dict(rec, attn=attn, x=rec["x"].float(), rope=tuple(t.float() for t in rec["rope"]))
    ref = _reference(ref_model, seen)
    assert_close(model.aux_loss.double(), ref.detach(), "cuda bf16 indexer KL", 3e-2)
    want = torch.autograd.grad(ref, [p for _, p in _indexer_params(ref_model)])
    for g, w in zip(got, want):
        assert_close(g.double(), w.double(), "cuda bf16 indexer grad", 8e-2)
    off = _model(torch.bfloat16, train=False, device="cuda")
    ids, pos, mask = _batch(device="cuda")
    on = _model(torch.bfloat16, device="cuda")
    (on(ids, pos, mask).float().square().mean() + on.aux_loss).backward()
    off(ids, pos, mask).float().square().mean().backward()
    for (n, p_on), (_, p_off) in zip(on.named_parameters(), off.named_parameters(), strict=True):
        if ".indexer." not in n and p_off.grad is not None:
            # CUDA's index backward (the gathered latents) adds in a varying order: a bf16 ulp or two, where a
            # leak of the indexer loss into the policy would move the gradients by their own size
            torch.testing.assert_close(p_on.grad.float(), p_off.grad.float(), rtol=2e-2, atol=1e-5, msg=n)
    kls = _fit_indexer(model, params, (ids, pos, mask), 30)
    assert kls[-1] < 0.7 * kls[0], kls
