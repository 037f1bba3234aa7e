"""LoRA training: the adapted forward is base + scaled low-rank product, only adapters train, the trainer
publishes PEFT directories the engine serves, checkpoints hold adapters only, and 2-rank FSDP2 equals 1 rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_trainer import read_metrics, trainer_args, write_rollouts
from test_trainer_dist import run_torchrun
from test_trainer_parallel import EP2, moe_args
from torch.distributed.checkpoint import FileSystemReader

from arbor.config.loader import ConfigError, load_config
from arbor.config.model import LoRAConfig, ModelConfig
from arbor.config.rl import RLConfig
from arbor.models import build_model
from arbor.models.hf import save_checkpoint_dir
from arbor.models.lora import apply_lora, lora_parameters
from arbor.models.lora_peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config,
    arbor_tensors,
    load_adapter,
    peft_tensors,
    read_config,
    save_adapter,
)
from arbor.models.qwen3_moe import sort_by_expert
from arbor.run_dir import STABLE, broadcast_dir, checkpoint_dir
from arbor.trainer.draft import draft_modules
from arbor.trainer.main import main as trainer_main
from arbor.weights.shards import MANIFEST


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def test_lora_linear_is_base_plus_scaled_low_rank_product() -> None:
    lora = LoRAConfig(rank=3, alpha=6.0)
    model = build_model(ModelConfig(name="qwen3-test"))
    apply_lora(model, lora, 0)
    randomize(model, 1)
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, layer.in_features)
    want = F.linear(x, layer.weight) + (6.0 / 3) * (x @ layer.lora_A.T) @ layer.lora_B.T
    assert (layer(x) - want).abs().max().item() < 1e-6


def test_lora_experts_are_base_plus_scaled_low_rank_product_per_expert() -> None:
    model = build_model(ModelConfig(name="qwen3-moe-test"))
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0), 0)
    randomize(model, 2)
    experts = next(m for m in model.modules() if type(m).__name__ == "LoRAGroupedExperts")
    H = experts.gate_up_proj.shape[2]
    x, idx = torch.randn(7, H), torch.randint(0, experts.num_experts, (7, 1))
    order, token, counts = sort_by_expert(idx, experts.num_experts)
    got = experts(x[token], counts)
    rows = []
    for t in token.tolist():
        e = int(idx[t, 0])

        def proj(name: str, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            a, b = getattr(experts, f"lora_{name}_A")[e], getattr(experts, f"lora_{name}_B")[e]
            return h @ w.T + 2.0 * (h @ a.T) @ b.T

        gate_w, up_w = experts.gate_up_proj[e].chunk(2, dim=0)
        h = F.silu(proj("gate", x[t], gate_w)) * proj("up", x[t], up_w)
        rows.append(proj("down", h, experts.down_proj[e]))
    assert (got - torch.stack(rows)).abs().max().item() < 1e-6


def test_mla_kv_b_proj_read_as_weight_includes_the_adapter() -> None:
    model = build_model(ModelConfig(name="dsa-test"))
    apply_lora(model, LoRAConfig(rank=2, target_modules=["kv_b_proj"]), 0)
    randomize(model, 3)
    ids = torch.randint(0, 200, (1, 6))
    with torch.no_grad():
        adapted = model(ids)
        for name, p in lora_parameters(model):
            if name.endswith("lora_B"):  # zero B: the adapter's product vanishes and the base model remains
                p.zero_()
        base = build_model(ModelConfig(name="dsa-test"))(ids)
    assert (model(ids) - base).abs().max().item() < 1e-6 and (adapted - base).abs().max().item() > 1e-4


def test_only_adapters_train_and_no_target_is_a_config_error() -> None:
    model = build_model(ModelConfig(name="qwen3-moe-test"))
    apply_lora(model, LoRAConfig(rank=2), 0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters(model)} and trainable
    assert not any("gate.weight" in n or "embed" in n or "lm_head" in n for n in trainable)
    with pytest.raises(ValueError, match="match no linear layer"):
        apply_lora(build_model(ModelConfig(name="qwen3-test")), LoRAConfig(target_modules=["nothing"]), 0)
    with pytest.raises(ConfigError, match="model.lora"):
        load_config(RLConfig, ["--model.lora.rank", "4", "--weights.kind", "nccl"])
    with pytest.raises(ConfigError, match="rank"):
        load_config(RLConfig, ["--model.lora.rank", "0"])


def test_lora_leaves_the_mtp_drafts_frozen_and_unadapted() -> None:
    """The drafts are the base model's (speculative decoding serves base requests only): a LoRA run neither adapts
    nor trains them, so the trainer's draft loss is off (`draft_modules` is None)."""
    model = build_model(ModelConfig(name="qwen3-test-mtp"))
    assert draft_modules(model) is not None
    adapted = apply_lora(model, LoRAConfig(rank=2), 0)
    assert adapted and not any(path.startswith("mtp") for path in adapted)
    assert not any(p.requires_grad for p in model.mtp.parameters())
    assert draft_modules(model) is None


def test_peft_names_round_trip(tmp_path: Path) -> None:
    model = build_model(ModelConfig(name="qwen3-moe-test"))
    apply_lora(model, LoRAConfig(rank=2), 0)
    ours = {n: p.detach() for n, p in lora_parameters(model)}
    peft = peft_tensors(ours)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in peft
    assert "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_B.weight" in peft
    back = arbor_tensors(peft)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_trainer_publishes_adapters_and_checkpoints_adapters_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    write_rollouts({1: out}, steps=2)
    assert trainer_main(trainer_args(out, 2, "--model.lora.rank", "4", "--ckpt.interval", "1")) == 0
    for version in (1, 2):
        d = broadcast_dir(out, version)
        assert {p.name for p in d.iterdir()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, STABLE}
    config = read_config(broadcast_dir(out, 2))
    assert config["r"] == 4 and config["base_model_name_or_path"] == "qwen3-test" and config["bias"] == "none"
    assert "q_proj" in config["target_modules"]
    _, step1 = load_adapter(broadcast_dir(out, 1))
    _, step2 = load_adapter(broadcast_dir(out, 2))
    assert any(not torch.equal(step1[k], step2[k]) for k in step1)  # the adapter trained
    assert all(k.rsplit(".", 1)[-1].startswith("lora_") for k in step1)
    keys = FileSystemReader(str(checkpoint_dir(out, 2))).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    assert not any("lora_" not in k for k in keys if k.startswith("optim.state."))


@pytest.mark.slow
def test_two_rank_fsdp_lora_step_matches_one_rank(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    write_rollouts({1: one, 2: two}, steps=2)
    # every projection and the head (root group: gathered around the forward that reads its effective weight)
    targets = '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]'
    lora = ["--model.lora.rank", "4", "--model.lora.alpha", "8.0", "--model.lora.target-modules", targets]
    assert trainer_main(trainer_args(one, 2, *lora)) == 0
    run_torchrun(2, trainer_args(two, 2, *lora, "--parallel.nproc", "2"))
    for r1, r2 in zip(read_metrics(one), read_metrics(two), strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
        assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)
    for version in (1, 2):
        a = load_file(str(broadcast_dir(one, version) / ADAPTER_WEIGHTS))
        b = load_file(str(broadcast_dir(two, version) / ADAPTER_WEIGHTS))
        assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max().item() <= 1e-5 for k in a)
        assert any("lm_head.lora_B" in k for k in a)


@pytest.mark.slow
def test_expert_parallel_lora_step_matches_one_rank(tmp_path: Path) -> None:
    """MoE experts' adapters are ep-sharded with their experts (FSDP2 + EP=2) and train as on one rank."""
    one, two = tmp_path / "one", tmp_path / "two"
    write_rollouts({1: one, 2: two}, steps=2)
    lora = ["--model.lora.rank", "2"]
    assert trainer_main(moe_args(one, 2, *lora)) == 0
    run_torchrun(2, moe_args(two, 2, *lora, *EP2))
    for r1, r2 in zip(read_metrics(one), read_metrics(two), strict=True):
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-5)
        assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)
    a, b = load_adapter(broadcast_dir(one, 2))[1], load_adapter(broadcast_dir(two, 2))[1]
    assert any("lora_gate_A" in k for k in a)
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max().item() <= 1e-5 for k in a)


def test_published_adapter_loads_in_peft(tmp_path: Path) -> None:
    """PEFT reads arbor's adapter directory onto the transformers model of the same weights and computes what
    arbor's LoRA model computes."""
    peft = pytest.importorskip("peft", reason="peft is not installed (not a dependency of arbor)")
    transformers = pytest.importorskip("transformers")
    lora = LoRAConfig(rank=4, alpha=8.0)
    model = build_model(ModelConfig(name="qwen3-test"))
    save_checkpoint_dir(model.state_dict(), model.args, tmp_path / "base")
    apply_lora(model, lora, 0)
    randomize(model, 4)
    adapters = dict(lora_parameters(model))
    save_adapter(tmp_path / "adapter", adapter_config(lora, str(tmp_path / "base"), adapters), adapters)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, 200, (2, 7))
    with torch.no_grad():
        assert (peft_model(input_ids=ids).logits - model(ids)).abs().max().item() < 1e-4
