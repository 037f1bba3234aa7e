"""Optimizers (AdamW, Muon + AdamW) and learning-rate schedules; activation checkpointing leaves gradients as
they are; config errors of the parallel dimensions are one line naming the field."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.config.trainer import LRScheduleConfig, OptimConfig, TrainerConfig
from arbor.models import build_model
from arbor.trainer.optim import build_optimizer, lr_factor, set_lr
from arbor.trainer.parallel import ParallelDims, apply_ac


def test_schedules_warm_up_then_decay():
    const = LRScheduleConfig(name="constant", warmup_steps=4)
    assert [lr_factor(s, 20, const) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    lin = LRScheduleConfig(name="linear", warmup_steps=0, min_lr_ratio=0.1)
    assert lr_factor(0, 10, lin) == pytest.approx(1.0)
    assert lr_factor(5, 10, lin) == pytest.approx(0.55)
    assert lr_factor(10, 10, lin) == pytest.approx(0.1)
    cos = LRScheduleConfig(name="cosine", warmup_steps=2)
    assert lr_factor(2, 12, cos) == pytest.approx(1.0)
    assert lr_factor(7, 12, cos) == pytest.approx(0.5)
    assert lr_factor(12, 12, cos) == pytest.approx(0.0, abs=1e-12)
    assert all(lr_factor(s, 12, cos) >= lr_factor(s + 1, 12, cos) for s in range(2, 12))


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = build_model(ModelConfig(name="qwen3-moe-test"))
    opt = build_optimizer(model, OptimConfig(name="muon", lr=1e-2))
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert "model.layers.0.self_attn.q_proj.weight" in {names[i] for i in muon_ids}
    rest = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert {
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
    } <= rest
    assert len(muon_ids) + len(rest) == len({id(p) for p in model.parameters()})

    # One step changes every parameter that has a gradient and the schedule drives both optimizers.
    before = copy.deepcopy(model.state_dict())
    model(torch.randint(0, 256, (1, 12))).logsumexp(-1).mean().backward()
    set_lr(opt, 0, 10, LRScheduleConfig(name="constant", warmup_steps=1))
    assert all(g["lr"] == pytest.approx(g["base_lr"] * 0.5) for g in opt.param_groups)
    opt.step()
    changed = [n for n, t in model.state_dict().items() if not torch.equal(t, before[n])]
    assert "model.layers.1.self_attn.o_proj.weight" in changed and "model.embed_tokens.weight" in changed


def test_activation_checkpointing_keeps_gradients():
    ref = build_model(ModelConfig(name="qwen3-moe-test"))
    model = copy.deepcopy(ref)
    apply_ac(model)
    x = torch.randint(0, 256, (2, 10))
    for m in (ref, model):
        m(x).float().pow(2).mean().backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n
    assert set(dict(ref.named_parameters())) == set(dict(model.named_parameters()))  # names unchanged


def test_parallel_dims_validation():
    d = ParallelDims.from_config(ParallelConfig(nproc=8, cp=2, ep=4), world_size=8)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.ep) == (1, 4, 2, 4)
    assert d.cp_enabled and d.ep_enabled and d.dp_shard_enabled and not d.dp_replicate_enabled and d.dp_size == 4
    with pytest.raises(ValueError, match="trainer.parallel.ep"):
        ParallelDims.from_config(ParallelConfig(ep=3), world_size=4)
    with pytest.raises(ValueError, match="must equal the world size"):
        ParallelDims.from_config(ParallelConfig(dp_shard=3), world_size=4)
    assert TrainerConfig().lr_schedule.name == "constant" and TrainerConfig().optim.name == "adamw"
    assert math.isclose(lr_factor(0, 5, LRScheduleConfig()), 1.0)


def test_trainer_with_muon_and_cosine_resumes_exactly(tmp_path):
    import shutil

    from test_trainer import read_metrics, trainer_args, write_rollouts
    from test_trainer_dist import assert_same_weights

    from arbor.run_dir import broadcast_dir, checkpoint_dir
    from arbor.trainer.main import main as trainer_main

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    write_rollouts({1: full}, steps=3)
    shutil.copytree(full / "rollouts", resumed / "rollouts")
    extra = (
        "--optim.name",
        "muon",
        "--lr-schedule.name",
        "cosine",
        "--lr-schedule.warmup-steps",
        "1",
        "--ckpt.interval",
        "1",
        "--ckpt.keep",
        "5",
    )
    assert trainer_main(trainer_args(full, 3, *extra)) == 0
    lrs = [r["lr"] for r in read_metrics(full)]
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3) and lrs[2] == pytest.approx(0.5e-3)
    shutil.copytree(checkpoint_dir(full, 2), checkpoint_dir(resumed, 2))
    assert trainer_main(trainer_args(resumed, 3, *extra, "--resume")) == 0
    assert_same_weights(broadcast_dir(resumed, 3), broadcast_dir(full, 3), atol=0.0)
