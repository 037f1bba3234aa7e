"""Expert and context parallelism on 2 CPU ranks (gloo, torch.multiprocessing) against one process on the same
data in fp32: EP=2 forward output and gradients (every MoE family's test preset); CP=2 Ulysses and ring attention
forward and backward on packed rows of unequal lengths, through the attention function and through the trainer's
packed logprobs."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from arbor.config.model import ModelConfig
from arbor.launch.process import free_port as _free_port
from arbor.models import build_model
from arbor.models.attention import packed_causal_mask, position_ids_for

pytestmark = pytest.mark.slow

REL = 1e-5


def _spawn(fn, *args, world: int = 2, backend: str = "gloo") -> None:
    port = _free_port()
    mp.start_processes(_entry, args=(world, port, fn, args, backend), nprocs=world, join=True, start_method="spawn")


def _entry(rank: int, world: int, port: int, fn, args, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    fn(rank, world, *args)  # an exception here reaches the parent through torch.multiprocessing
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can abort a process in interpreter teardown ("terminate called without an active
    # exception") after a successful run; skip the teardown once the work is checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, rel: float = REL) -> None:
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= rel * max(scale, 1e-6), f"{what}: max abs error {err:.3g} vs scale {scale:.3g}"


# --- expert parallel -------------------------------------------------------------------------------------------


def _ep_worker(rank: int, world: int, name: str = "qwen3-moe-test") -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from arbor.trainer.expert_parallel import apply_ep, expert_params

    ref = build_model(ModelConfig(name=name))
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (world, 24), generator=gen)  # rank r's tokens are row r
    w = torch.randn(world, 24, ref.args.vocab_size, generator=gen)

    ref_out = ref(ids)
    (ref_out * w).sum().backward()

    apply_ep(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    out = model(ids[rank : rank + 1])
    assert_close(out[0], ref_out[rank].detach(), "EP forward")
    assert torch.equal(model.last_routed_experts[0], ref.last_routed_experts[rank])
    (out[0] * w[rank]).sum().backward()

    experts = {id(p) for p in expert_params(model)}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:  # parameters outside the loss's graph (a DSA model's indexer)
            assert ref_params[name].grad is None, name
            continue
        if id(p) in experts:
            # Local experts: the gradient over every rank's tokens arrives through the all-to-all backward; the
            # experts' grad_scale divides it by ep for the trainer's loss scaling (see expert_parallel.py).
            local = g.to_local() * world
            n = local.shape[0]
            assert_close(local, ref_params[name].grad[rank * n : (rank + 1) * n], f"EP grad {name}")
        else:
            g = g.clone()
            dist.all_reduce(g)  # the data-parallel sum FSDP2 would do
            assert_close(g, ref_params[name].grad, f"EP grad {name}")


@pytest.mark.parametrize("name", ["qwen3-moe-test", "glm4-moe-test", "minimax-m2-test"])
def test_expert_parallel_two_ranks_matches_one_process(name):
    """Qwen3-MoE's softmax router, and the DeepSeek-routed GLM-4.5 (group-limited, shared experts, a dense first
    layer) and MiniMax-M2 models: the same grouped experts and dispatch."""
    _spawn(_ep_worker, name)


def test_deepep_backend_without_deep_ep_fails_with_one_line():
    from arbor.trainer.expert_parallel import DeepEPDispatcher

    try:
        import deep_ep  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="ep_backend = 'deepep' needs DeepEP"):
            DeepEPDispatcher(None, 4, 2, 32, 64)
    else:
        pytest.skip("deep_ep is installed")


def _deepep_worker(rank: int, world: int) -> None:
    from arbor.models.qwen3_moe import local_dispatch
    from arbor.trainer.expert_parallel import DeepEPDispatcher

    model = build_model(ModelConfig(name="qwen3-moe-test", dtype="bfloat16"), device=f"cuda:{rank}")
    moe = model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, model.args.hidden_size, generator=gen).to(f"cuda:{rank}", torch.bfloat16)
    _, w, idx = moe.gate(x)
    ref = local_dispatch(x, w, idx, moe.experts)
    n = moe.experts.num_experts // world
    moe.experts.gate_up_proj.data = moe.experts.gate_up_proj.data[rank * n : (rank + 1) * n].clone()
    moe.experts.down_proj.data = moe.experts.down_proj.data[rank * n : (rank + 1) * n].clone()
    d = DeepEPDispatcher(
        dist.group.WORLD, moe.experts.num_experts, model.args.num_experts_per_tok, model.args.hidden_size, 64
    )
    out = d(x, w, idx, moe.experts)
    assert_close(out.float(), ref.float(), "DeepEP vs local dispatch", rel=2e-2)


@pytest.mark.gpu(reason="DeepEP's NCCL all-to-all dispatch (2 GPUs)")
def test_deepep_dispatch_matches_local_dispatch_on_two_gpus():
    pytest.importorskip("deep_ep")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _spawn(_deepep_worker, backend="nccl")


# --- context parallel ------------------------------------------------------------------------------------------

LENS = [7, 13, 2, 9]  # unequal packed lengths, 31 tokens: the row is padded to a multiple of 2 x cp


def _cp_attention_worker(rank: int, world: int, style: str) -> None:
    from arbor.trainer.context_parallel import ContextParallel

    gen = torch.Generator().manual_seed(1)
    H, Hkv, D = 4, 2, 8
    T = sum(LENS)
    ctx = ContextParallel(dist.group.WORLD, style)
    ctx.block = 3  # ring: several query blocks per chunk, some seeing no key of it
    Tp = ctx.set_row(LENS, T, torch.device("cpu"))
    q = torch.randn(1, H, Tp, D, generator=gen, requires_grad=True)
    k = torch.randn(1, Hkv, Tp, D, generator=gen, requires_grad=True)
    v = torch.randn(1, Hkv, Tp, D, generator=gen, requires_grad=True)
    g_out = torch.randn(1, H, Tp, D, generator=gen)
    mask = packed_causal_mask(LENS, Tp)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref.backward(g_out)

    idx = ctx.local_indices
    ql, kl, vl = (t.detach()[:, :, idx].clone().requires_grad_(True) for t in (q, k, v))
    out = ctx.attention(ql, kl, vl)
    assert_close(out, ref.detach()[:, :, idx], f"{style} forward")
    out.backward(g_out[:, :, idx])
    for name, local, full in (("q", ql, q), ("k", kl, k), ("v", vl, v)):
        assert_close(local.grad, full.grad[:, :, idx], f"{style} grad {name}")


@pytest.mark.parametrize("style", ["ulysses", "ring"])
def test_context_parallel_attention_matches_full_attention(style):
    _spawn(_cp_attention_worker, style)


def _cp_model_worker(rank: int, world: int, style: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from arbor.trainer.context_parallel import apply_cp
    from arbor.trainer.parallel_state import ParallelState
    from arbor.trainer.step import packed_logprobs

    ref = build_model(ModelConfig(name="qwen3-moe-test"))
    state = ParallelState(vocab=259)  # the byte tokenizer's ids of the head's 264 rows, on both
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(2)
    T = sum(LENS) + 3  # trailing padding as the batcher leaves it
    ids = torch.randint(0, 256, (T,), generator=gen)
    pos = position_ids_for(LENS, T)[0]
    w = torch.randn(T, generator=gen)
    lp_ref, ent_ref = packed_logprobs(ref, ids, pos, LENS, 1.0, torch.device("cpu"), state=state)
    (lp_ref * w).sum().backward()

    cp = apply_cp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)), style)
    lp, ent = packed_logprobs(model, ids, pos, LENS, 1.0, torch.device("cpu"), state=dataclasses.replace(state, cp=cp))
    assert_close(lp, lp_ref.detach(), f"{style} logprobs")
    assert_close(ent, ent_ref, f"{style} entropy")
    (lp * w).sum().backward()
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # every cp rank computed the same loss: the sum over ranks is cp x the gradient
        assert_close(g / world, p_ref.grad, f"{style} grad {name}")
    assert not model.lm_head.weight.grad[259:].any()  # padding rows are outside the policy


@pytest.mark.parametrize("style", ["ulysses", "ring"])
def test_context_parallel_model_logprobs_and_grads_match_one_process(style):
    _spawn(_cp_model_worker, style)
