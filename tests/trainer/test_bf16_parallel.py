"""bfloat16 on the trainer's parallel paths, as the recipes run them (FSDP2 mixed precision with fp32 masters), on 2
CPU ranks over gloo, against one fp32 process on the same data.

Expert parallelism keeps the experts outside FSDP2 (their weights are ep-sharded DTensors), so FSDP2's cast
policy never reaches them: the grouped matmul casts them to the compute dtype itself. Before it did, FSDP2 + EP
in bf16 died in the first expert matmul (`expected m1 and m2 to have the same dtype`).

The bound: bf16 keeps 8 bits of mantissa (relative rounding 2**-9 ~ 2e-3 per operation), so through a few
layers of sums over a hundred terms the logits and gradients of this tiny model differ from fp32 by about 1e-2 of
their scale; the bounds below, 4e-2 (logits) and 8e-2 (gradients) of the reference's largest value, hold on the two
seeds the test runs, and a dtype error or a wrongly scaled gradient is off by far more.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_parallel import _spawn, assert_close

from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.config.trainer import TrainerConfig
from arbor.models import build_model
from arbor.trainer.expert_parallel import expert_params
from arbor.trainer.parallel import ParallelDims, parallelize

pytestmark = pytest.mark.slow  # spawns two processes

LOGITS_REL, GRAD_REL = 4e-2, 8e-2


def _fsdp_ep_bf16_worker(rank: int, world: int, seed: int) -> None:
    from torch.distributed.tensor import DTensor  # DTensor imports sympy: only the ranks need it

    cfg = TrainerConfig(
        model=ModelConfig(name="qwen3-moe-test", dtype="bfloat16"), parallel=ParallelConfig(nproc=world, ep=world)
    )
    ref = build_model(ModelConfig(name="qwen3-moe-test"))  # fp32, as the trainer builds its masters
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
        if id(p) in experts:  # ep-sharded: rank r holds experts [r n, (r + 1) n); the hook divides by ep
            n = local.shape[0]
            assert_close(local * world, ref_grads[name][rank * n : (rank + 1) * n], f"grad {name}", GRAD_REL)
            checked.add("expert")
        elif not isinstance(p.grad, DTensor):
            continue
        else:  # FSDP2: the gradient is the mean over the ranks' batches, the reference sums both rows
            full = p.grad.full_tensor()
            assert_close(full * world, ref_grads[name], f"grad {name}", GRAD_REL)
            checked.add("fsdp")
    assert checked == {"expert", "fsdp"}, checked


@pytest.mark.parametrize("seed", [0, 1])
def test_fsdp2_with_expert_parallelism_trains_in_bf16_like_fp32(seed):
    _spawn(_fsdp_ep_bf16_worker, seed)
