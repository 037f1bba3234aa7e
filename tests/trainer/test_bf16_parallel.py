"""bfloat16 on the trainer's parallel paths, as the recipes run them (FSDP2 mixed precision with fp32 masters), on 2
CPU ranks over gloo, against one fp32 process on the same data: FSDP2 (dense, and with expert parallelism),
context parallelism (Ulysses, ring, DSA), prefix-merged rows under FSDP2, and LoRA on ep-sharded experts.

Expert parallelism keeps the experts outside FSDP2 (their weights are ep-sharded DTensors), so FSDP2's cast
policy never reaches them: the grouped matmul casts them to the compute dtype itself. Before it did, FSDP2 + EP
in bf16 died in the first expert matmul (`expected m1 and m2 to have the same dtype`). Ring attention merged its
key chunks in fp32 and handed fp32 to the bf16 output projection (the same error) until it cast back.

The bound: bf16 keeps 8 bits of mantissa (relative rounding 2**-9 ~ 2e-3 per operation), so through a few
layers of sums over a hundred terms the logits and gradients of this tiny model differ from fp32 by about 1e-2 of
their scale; the bounds below, 4e-2 (logits) and 8e-2 (gradients) of the reference's largest value, hold on the two
seeds the test runs, and a dtype error or a wrongly scaled gradient is off by far more.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from test_parallel import _spawn, assert_close
from test_prefix_merge import _trainer_args, _write_step_rollouts
from test_trainer import read_metrics, write_rollouts
from test_trainer_dist import run_torchrun
from test_trainer_parallel import EP2, moe_args

from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.config.trainer import TrainerConfig
from arbor.models import build_model
from arbor.trainer.expert_parallel import expert_params
from arbor.trainer.main import main as trainer_main
from arbor.trainer.parallel import ParallelDims, parallelize

pytestmark = pytest.mark.slow  # spawns two processes

LOGITS_REL, GRAD_REL = 4e-2, 8e-2


def _fsdp_ep_bf16_worker(rank: int, world: int, seed: int, name: str) -> None:
    from torch.distributed.tensor import DTensor  # DTensor imports sympy: only the ranks need it

    ep = world if "moe" in name else 1
    cfg = TrainerConfig(model=ModelConfig(name=name, dtype="bfloat16"), parallel=ParallelConfig(nproc=world, ep=ep))
    ref = build_model(ModelConfig(name=name))  # fp32, as the trainer builds its masters
    model = copy.deepcopy(ref)
    parallelize(model, ParallelDims.from_config(cfg.parallel, world), cfg, "cpu")  # in place
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (world, 24), generator=gen)  # rank r trains on row r
    w = torch.randn(world, 24, ref.args.vocab_size, generator=gen)

    ref_out = ref(ids)
    (ref_out * w).sum().backward()
    out = model(ids[rank : rank + 1])
    assert out.dtype == torch.bfloat16
    assert_close(out[0].float(), ref_out[rank].detach(), "bf16 FSDP2+EP logits", LOGITS_REL)
    (out[0].float() * w[rank]).sum().backward()

    experts = {id(p) for p in expert_params(model)}
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    checked = set()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name  # fp32 masters and gradients
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if id(p) in experts:  # ep-sharded: rank r holds experts [r n, (r + 1) n); grad_scale divides by ep
            n = local.shape[0]
            assert_close(local * world, ref_grads[name][rank * n : (rank + 1) * n], f"grad {name}", GRAD_REL)
            checked.add("expert")
        elif not isinstance(p.grad, DTensor):
            continue
        else:  # FSDP2: the gradient is the mean over the ranks' batches, the reference sums both rows
            full = p.grad.full_tensor()
            assert_close(full * world, ref_grads[name], f"grad {name}", GRAD_REL)
            checked.add("fsdp")
    assert checked == ({"expert", "fsdp"} if ep > 1 else {"fsdp"}), checked


@pytest.mark.parametrize("seed", [0, 1])
def test_fsdp2_with_expert_parallelism_trains_in_bf16_like_fp32(seed):
    _spawn(_fsdp_ep_bf16_worker, seed, "qwen3-moe-test")


def test_fsdp2_dense_trains_in_bf16_like_fp32():
    _spawn(_fsdp_ep_bf16_worker, 0, "qwen3-test")


# --- context parallel in bf16 ----------------------------------------------------------------------------------

CP_LENS = [7, 13, 2, 9]  # unequal packed lengths; the row is padded to a multiple of 2 x cp


def _cp_bf16_worker(rank: int, world: int, name: str, style: str, seed: int) -> None:
    """cp = 2 in bf16 (the model cast, as the engine and FSDP2's compute copy run it) against one fp32 process."""
    from torch.distributed.device_mesh import init_device_mesh

    from arbor.models.attention import position_ids_for
    from arbor.trainer.context_parallel import apply_cp
    from arbor.trainer.dsa_cp import apply_dsa_cp
    from arbor.trainer.parallel_state import ParallelState
    from arbor.trainer.step import packed_logprobs

    ref = build_model(ModelConfig(name=name))
    model = copy.deepcopy(ref).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    T = sum(CP_LENS) + 3
    ids = torch.randint(0, 256, (T,), generator=gen)
    pos = position_ids_for(CP_LENS, T)[0]
    w = torch.randn(T, generator=gen)
    cpu = torch.device("cpu")
    state = ParallelState(vocab=259)
    lp_ref, _ = packed_logprobs(ref, ids, pos, CP_LENS, 1.0, cpu, state=state)
    (lp_ref * w).sum().backward()

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp = apply_dsa_cp(model, mesh) if style == "dsa" else apply_cp(model, mesh, style)
    if style != "dsa":
        cp.block = 8  # ring: several query blocks per key chunk
    lp, _ = packed_logprobs(model, ids, pos, CP_LENS, 1.0, cpu, state=dataclasses.replace(state, cp=cp))
    assert_close(lp.float(), lp_ref.detach(), f"bf16 {style} cp logprobs", LOGITS_REL)
    (lp.float() * w).sum().backward()
    checked = 0
    for (n, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if p_ref.grad is None:  # DSA's indexer: no gradient through top-k
            continue
        assert p.grad.dtype == torch.bfloat16, n
        g = p.grad.float()
        dist.all_reduce(g)  # every cp rank computed the same loss: the sum over ranks is cp x the gradient
        assert_close(g / world, p_ref.grad, f"bf16 {style} cp grad {n}", GRAD_REL)
        checked += 1
    assert checked > 0


CP_CASES = [("qwen3-test", "ulysses"), ("qwen3-test", "ring"), ("dsa-test", "dsa")]


@pytest.mark.parametrize("name,style", CP_CASES, ids=[c[1] for c in CP_CASES])
def test_context_parallel_in_bf16_matches_fp32(name, style):
    _spawn(_cp_bf16_worker, name, style, 0)


# --- whole trainer steps in bf16 on 2 ranks against one fp32 rank ---------------------------------------------

STEP_REL = 5e-2
"""Bound on a bf16 step's loss and gradient norm against fp32, relative (the loss is a mean of per-token terms of
order 1; the gradient norm sums many bf16-rounded products): a wrong cast or scaling is off by far more."""


def _assert_step_close(bf16: dict, fp32: dict, what: str) -> None:
    assert bf16["loss"] == pytest.approx(fp32["loss"], abs=STEP_REL * max(1.0, abs(fp32["loss"]))), what
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=STEP_REL), what


def test_prefix_merged_step_in_bf16_on_two_ranks_matches_fp32_unmerged(tmp_path):
    """Prefix-tree rows (tree masks) under FSDP2 in bf16: the step's loss and gradient norm as fp32 unmerged."""

    merged, plain = tmp_path / "merged", tmp_path / "plain"
    _write_step_rollouts(merged, 2, True)
    _write_step_rollouts(plain, 1, False)
    run_torchrun(2, _trainer_args(merged, "--parallel.nproc", "2", "--model.dtype", "bfloat16"))
    assert trainer_main(_trainer_args(plain)) == 0
    _assert_step_close(read_metrics(merged)[0], read_metrics(plain)[0], "prefix merge bf16")


def test_expert_parallel_lora_steps_in_bf16_match_fp32(tmp_path):
    """LoRA adapters on the experts (ep-sharded, outside FSDP2) and attention, FSDP2 + EP = 2 in bf16, two steps
    against one fp32 rank."""

    one, two = tmp_path / "one", tmp_path / "two"
    write_rollouts({1: one, 2: two}, steps=2)
    lora = ["--model.lora.rank", "2"]
    assert trainer_main(moe_args(one, 2, *lora)) == 0
    run_torchrun(2, moe_args(two, 2, *lora, *EP2, "--model.dtype", "bfloat16"))
    for step, (fp32, bf16) in enumerate(zip(read_metrics(one), read_metrics(two), strict=True)):
        _assert_step_close(bf16, fp32, f"LoRA EP bf16 step {step}")
