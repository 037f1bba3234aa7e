"""The transformers path under FSDP2 (one group per decoder layer) with activation checkpointing on 2 CPU ranks
(gloo) equals one process on the same rows (fp32, <= 1e-5): the packed logprobs and every gradient, for every
tiny family of tests/hf_tiny.py, in one spawn."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_tiny import TINY_HF, write_tiny
from test_parallel import _spawn, assert_close

from arbor.config.model import ModelConfig
from arbor.models import build_model
from arbor.trainer.parallel import apply_ac, apply_fsdp
from arbor.trainer.parallel_state import ParallelState
from arbor.trainer.step import packed_logprobs

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
ROWS = [[9, 7, 5], [6, 12]]  # rank r's packed row: samples of these lengths


def _row(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (sum(lens),), generator=gen)
    return ids, torch.cat([torch.arange(n) for n in lens])


def _loss(model, r: int) -> torch.Tensor:
    ids, pos = _row(ROWS[r], r)
    lp, _ = packed_logprobs(model, ids, pos, ROWS[r], 1.0, CPU, state=ParallelState(logprob_chunk=16))
    return lp, (lp * torch.linspace(-1, 1, len(lp))).sum()


def _fsdp_worker(rank: int, world: int, dirs: dict[str, str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    for arch, path in dirs.items():
        ref = build_model(ModelConfig(name=path, tokenizer="byte", impl="transformers"))
        model = copy.deepcopy(ref)
        want = [_loss(ref, r) for r in range(world)]
        (sum(loss for _, loss in want) / world).backward()  # FSDP2 averages gradients over ranks
        apply_ac(model)
        apply_fsdp(model, mesh, torch.float32)
        lp, loss = _loss(model, rank)
        assert_close(lp.detach(), want[rank][0].detach(), f"{arch} logprobs")
        loss.backward()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            assert_close(g, ref_params[name].grad, f"{arch} grad {name}")


def test_fsdp2_two_ranks_equal_one_process_for_every_family(tmp_path):
    dirs = {arch: str(write_tiny(arch, tmp_path / arch)) for arch in TINY_HF}
    _spawn(_fsdp_worker, dirs)
