"""`rl --twin` planning (arbor.launch.twin) on every recipe in examples/ and every model x hardware layer of
configs/: the twin config validates, keeps what it must keep (dtype, FP8, loss, scheduler, environment, backend,
weight transport, buffer), lists every setting it changed with a reason, and fits this machine (at most 2 trainer
ranks, no SLURM, gloo); its tiny model keeps the family's structure and loads."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from hf_tiny import write_big_config
from hub_fixtures import hub_cache, tiny_checkpoint, use_cache

from arbor.config.loader import load_config
from arbor.config.model import ModelConfig
from arbor.config.rl import SECTIONS, RLConfig
from arbor.environments import env_prompt
from arbor.environments.shapes import ShapesEnv
from arbor.inference.vllm.launch import vllm_build
from arbor.launch import rl, twin_hf
from arbor.launch.twin import TWIN_RANKS, TwinPlan, plan_twin, write_twin_model
from arbor.launch.twin_native import KNOWN_MODELS, tiny_args
from arbor.models import build_model
from arbor.models.args import ModelArgs
from arbor.models.family import args_from_config, family_of
from arbor.models.hf_args import HFArgs
from arbor.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*/rl.toml"))
MODELS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs" / "models").glob("*.toml"))
HARDWARE = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs" / "hardware").glob("*.toml"))
KEPT = (
    "model.dtype",
    "model.fp8",
    "model.lora",
    "trainer.loss",
    "trainer.optim",
    "trainer.lr_schedule",
    "orchestrator.scheduler.mode",
    "orchestrator.environment.id",
    "orchestrator.advantage",
    "orchestrator.buffer",
    "orchestrator.partial",
    "weights.delta",
    "trainer.parallel.activation_checkpointing",
)
"""Settings a twin never changes."""


def _get(cfg: object, path: str) -> object:
    for key in path.split("."):
        cfg = getattr(cfg, key)
    return cfg


def _twin(argv: list[str], tmp_path: Path, monkeypatch) -> tuple[RLConfig, RLConfig, TwinPlan]:
    monkeypatch.chdir(ROOT)
    argv = [*argv, "--output-dir", str(tmp_path / "run")]
    cfg = load_config(RLConfig, argv, env={})
    plan = plan_twin(cfg)
    twin = load_config(RLConfig, argv, env={}, overrides=plan.overrides)
    return cfg, twin, plan


DERIVED = ("orchestrator.batching.trainer_ranks",)
"""Fields `rl` derives from changed ones (the data-parallel ranks from the trainer's)."""


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):  # an empty table has no leaves: the same as an absent one
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


COPIES = {"trainer.colocate": "inference.colocate", "orchestrator.colocate": "inference.colocate"}
"""Fields RLConfig sets from another (the one a user sets)."""


def _listed(path: str, changed: list[str]) -> bool:
    """Whether `path` differs because of a listed change (itself, a table above it, or a shared field pushed
    down into a section) or is derived from one."""
    section, _, rest = path.partition(".")
    names = [path] + ([rest] if section in SECTIONS else []) + ([COPIES[path]] if path in COPIES else [])
    return path in DERIVED or any(n == c or n.startswith(c + ".") for n in names for c in changed)


def _check_twin(cfg: RLConfig, twin: RLConfig, plan: TwinPlan) -> None:
    changed = [c.field for c in plan.changes]
    for path in KEPT:
        assert _get(twin, path) == _get(cfg, path), path
    assert twin.slurm is None and twin.fleet is None
    assert twin.trainer.parallel.nproc <= TWIN_RANKS and twin.trainer.parallel.backend != "nccl"
    assert twin.trainer.parallel.ep_backend == "all_to_all"
    assert twin.output_dir == Path(f"{cfg.output_dir}-twin")
    assert twin.max_steps <= 3 and twin.seq_len <= 1024 and twin.orchestrator.batch_size <= 16
    if twin.inference.backend != cfg.inference.backend:  # only what vLLM's CPU build cannot serve leaves it
        assert "inference.backend" in changed and (cfg.inference.backend, twin.inference.backend) == ("vllm", "local")
        assert cfg.model.fp8 == "block" or family_of(plan.model_args).dsa
    before, after = _leaves(cfg.to_toml_dict()), _leaves(twin.to_toml_dict())
    for path in sorted(before.keys() | after.keys()):  # what is not listed is as written
        if before.get(path) != after.get(path):
            assert _listed(path, changed), f"{path}: {before.get(path)!r} -> {after.get(path)!r} is not listed"
    if cfg.trainer.parallel.ep > 1:
        assert twin.trainer.parallel.ep == 2
    if cfg.trainer.parallel.cp > 1:
        assert twin.trainer.parallel.cp == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_has_a_twin_that_validates_and_keeps_its_settings(recipe, tmp_path, monkeypatch):
    cfg, twin, plan = _twin(["@", recipe], tmp_path, monkeypatch)
    _check_twin(cfg, twin, plan)
    if cfg.model.name.startswith(("Qwen/", "zai-org/", "deepseek-ai/")):
        assert plan.model_args is not None and twin.model.tokenizer == "byte"
    elif not (ROOT / cfg.model.name).exists() and "/" in cfg.model.name:  # a checkpoint its setup script writes
        assert "is not on this machine" in next(c.why for c in plan.changes if c.field == "model.name")
    else:  # a CPU recipe already runs here: its model is kept
        assert twin.model.name == cfg.model.name


@pytest.mark.parametrize("model,hardware", list(itertools.product(MODELS, HARDWARE)))
def test_every_model_and_hardware_layer_has_a_twin(model, hardware, tmp_path, monkeypatch):
    _check_twin(*_twin(["@", model, "@", hardware], tmp_path, monkeypatch))


def test_the_plan_says_each_change_and_why(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(RLConfig, ["@", "examples/glm5_swe/rl.toml"], env={})
    plan = plan_twin(cfg)
    lines = plan.render().splitlines()
    assert len(lines) == len(plan.changes) + 1
    by_field = {c.field: c for c in plan.changes}
    for c in plan.changes:
        assert c.old != c.new and c.why
    assert by_field["trainer.parallel.nproc"].old == 8 and by_field["trainer.parallel.nproc"].new == 2
    assert by_field["trainer.parallel.ep"].new == 2 and by_field["trainer.parallel.cp"].new == 2
    assert by_field["seq_len"].old == 131072 and by_field["seq_len"].new == 1024
    assert any(line.startswith("  seq_len: 131072 -> 1024 (") for line in lines)
    if vllm_build() == "cpu":
        assert by_field["inference.backend"].new == "local"


@pytest.mark.parametrize("name", sorted(n for n, real in KNOWN_MODELS.items() if not real.get("vision")))
def test_the_tiny_model_keeps_the_familys_structure(name):
    real = KNOWN_MODELS[name]
    tiny = tiny_args(real, 32768)
    assert tiny.architecture == real["architecture"]
    assert tiny.tie_word_embeddings == real["tie_word_embeddings"]
    hf = family_of(tiny).to_hf_config(tiny)
    assert family_of(tiny).to_hf_config(args_from_config(hf)) == hf  # the processes read back the same model
    if "num_experts_per_tok" in real:
        assert tiny.is_moe and tiny.num_experts_per_tok == real["num_experts_per_tok"]
        assert tiny.num_experts % 2 == 0 and tiny.num_experts <= real.get("num_experts", real.get("n_routed_experts"))
    else:
        assert not tiny.is_moe
    for key in ("n_shared_experts", "n_group", "topk_group", "routed_scaling_factor"):
        if key in real:
            assert getattr(tiny, key) == real[key], key
    assert getattr(tiny, "is_dsa", False) == family_of(tiny).dsa
    assert tiny.num_params() < 2_000_000


def test_a_cached_config_gives_the_real_structure(tmp_path, monkeypatch):
    """A hub model whose config.json is in the cache: its own structure (here MTP depth 1, a tied head), not the
    table's; the twin says where it came from."""
    use_cache(monkeypatch, tmp_path / "hf")
    hub_cache(tmp_path / "hf", "org/mtp-model", tiny_checkpoint(tmp_path / "ckpt", "qwen3-test-mtp"))
    cfg = RLConfig(model={"name": "org/mtp-model"}, output_dir=tmp_path / "run")
    plan = plan_twin(cfg)
    assert plan.model_args.mtp_depth == 1 and plan.model_args.tie_word_embeddings
    assert "from org/mtp-model's config.json" in plan.render()


@pytest.mark.parametrize("name", ["Qwen/Qwen3-235B-A22B", "zai-org/GLM-5"])
def test_the_twin_model_is_written_and_loads(name, tmp_path):
    cfg = RLConfig(model={"name": name}, output_dir=tmp_path / "run")
    plan = plan_twin(cfg)
    write_twin_model(plan, seed=0)
    model = build_model(ModelConfig(name=str(plan.model_dir), tokenizer="byte"))
    assert model.args == plan.model_args
    write_twin_model(plan, seed=1)  # already there: kept, not rewritten
    assert build_model(ModelConfig(name=str(plan.model_dir), tokenizer="byte")).state_dict().keys() == (
        model.state_dict().keys()
    )


def test_twin_dry_run_prints_the_plan_and_writes_no_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    argv = ["@", "examples/qwen3_235b/rl.toml", "--twin", "--dry-run", "--output-dir", str(out)]
    assert rl.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("rl --twin: ") and "trainer.parallel.ep: 8 -> 2 (" in printed
    assert (Path(f"{out}-twin") / "configs" / "rl.toml").is_file()
    assert not (Path(f"{out}-twin") / "twin_model").exists() and not out.exists()


def test_a_vision_language_recipe_twins_into_a_tiny_vision_language_model(tmp_path, monkeypatch):
    """The qwen2.5-vl-3b layer with the shapes environment (the hub model not on this machine): the twin is a tiny
    random Qwen2.5-VL on the transformers path, written with its processor; it renders the environment's image
    prompts and its forward runs the vision tower (a text twin would refuse them as a text-only model)."""
    layers = ["@", "configs/models/qwen2.5-vl-3b.toml", "@", "configs/hardware/cpu-laptop.toml"]
    cfg, twin, plan = _twin([*layers, "@", "configs/envs/shapes.toml"], tmp_path, monkeypatch)
    _check_twin(cfg, twin, plan)
    assert plan.vision and plan.model_args is None and twin.model.impl == "transformers"
    assert twin.model.tokenizer is None and twin.model.name == str(plan.model_dir)
    assert "tiny random Qwen2.5-VL" in next(c.why for c in plan.changes if c.field == "model.name")
    write_twin_model(plan, seed=0)
    config = json.loads((plan.model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"] and "vision_config" in config
    env = ShapesEnv(num_tasks=2, kinds=("colour",))
    ids, images = env_prompt(env, env.dataset(0)[0], load_tokenizer(plan.model_dir))
    assert images is not None and images["image_grid_thw"].shape[0] == 1
    model = build_model(twin.model)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **images)
    assert logits.shape[:2] == (1, len(ids)) and torch.isfinite(logits).all()


NATIVE_BIG = {
    "Glm4MoeForCausalLM": (
        "glm4_moe",
        {"n_routed_experts": 160, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3},
    ),
    "MiniMaxM2ForCausalLM": ("minimax_m2", {"num_local_experts": 256, "num_experts_per_tok": 8}),
    "Qwen2ForCausalLM": ("qwen2", {}),
    "LlamaForCausalLM": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
    ),
}


@pytest.mark.parametrize("arch", sorted(NATIVE_BIG))
def test_a_native_checkpoints_twin_keeps_every_structural_field(arch, tmp_path):
    """A user's GLM-4.5 / MiniMax-M2 / Qwen2.5 / Llama 3 checkpoint (its config.json at a few billion parameters)
    twins into the same native family with every field but the sizes as the checkpoint has it: the routing, its
    top-k, shared experts and dense first layers of a MoE (a dense twin would leave EP and router replay untried),
    Qwen2's QKV bias, Llama 3's RoPE scaling; the tiny model is written, loads, and is the planned one."""
    model_type, extra = NATIVE_BIG[arch]
    real_dir = write_big_config(tmp_path / "real", model_type, arch, **extra)
    real = ModelArgs.from_dir(real_dir)
    plan = plan_twin(RLConfig(model={"name": str(real_dir)}, output_dir=tmp_path / "run"))
    tiny = plan.model_args
    assert type(tiny) is type(real) and tiny.num_params() < 2_000_000 < real.num_params()
    sizes = {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "num_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "shared_expert_intermediate_size",
    }
    for name, value in vars(real).items():
        if name not in sizes:
            assert getattr(tiny, name) == value, name
    if real.is_moe:
        dense_first = getattr(real, "first_k_dense_replace", 0) > 0
        assert tiny.is_moe and tiny.num_experts == 2 * real.num_experts_per_tok
        assert tiny.moe_layers == ([1] if dense_first else [0, 1])
    write_twin_model(plan, seed=0)
    assert build_model(ModelConfig(name=str(plan.model_dir), tokenizer="byte")).args == tiny


HF_BIG = {
    "Gemma3ForCausalLM": ("gemma3_text", {"sliding_window": 1024}),
    "Phi3ForCausalLM": ("phi3", {}),
    "GptOssForCausalLM": ("gpt_oss", {"num_local_experts": 128, "num_experts_per_tok": 4}),
    "Qwen3_5ForCausalLM": ("qwen3_5_text", {}),
    "DeepseekV3ForCausalLM": ("deepseek_v3", {"n_routed_experts": 64, "num_experts_per_tok": 6}),
    "FalconH1ForCausalLM": ("falcon_h1", {}),
}


@pytest.mark.parametrize("arch", sorted(HF_BIG))
def test_a_transformers_path_checkpoints_twin_is_its_own_class_at_a_tiny_size(arch, tmp_path):
    """A checkpoint arbor has no native family for twins into a tiny random model of its own class, written by
    transformers from its own config.json with the sizes shrunk: each layer kind it has (sliding and global
    attention, gated-delta-net, Mamba mixers), its experts' top-k, multi-head latent attention; the twin takes
    the transformers path and its forward runs (before this, every such checkpoint stopped `rl --twin` with a
    traceback)."""
    model_type, extra = HF_BIG[arch]
    real_dir = write_big_config(tmp_path / "real", model_type, arch, **extra)
    real = HFArgs(json.loads((real_dir / "config.json").read_text()), arch)
    cfg = RLConfig(model={"name": str(real_dir)}, output_dir=tmp_path / "run")
    plan = plan_twin(cfg)
    assert plan.model_args is None and plan.hf_config is not None
    tiny = HFArgs(plan.hf_config, arch)
    assert set(tiny.layer_types) == set(real.layer_types) and tiny.hidden_size == 64
    assert tiny.num_params() < 2_000_000 < real.num_params()
    for key in ("num_experts_per_tok", "tie_word_embeddings", "rms_norm_eps", "hidden_act", "attention_bias"):
        assert plan.hf_config.get(key) == real.config.get(key), key
    if real.experts[0]:
        assert 0 < tiny.experts[0] < real.experts[0]
    if "sliding_window" in extra:
        positions = plan.hf_config["max_position_embeddings"]  # the twin's longest sequence
        assert plan.hf_config["sliding_window"] == positions // 4  # it bites within the twin's lengths
    assert f"a tiny random {arch}, {len(tiny.layer_types)} layers" in plan.render()
    write_twin_model(plan, seed=0)
    twin = load_config(RLConfig, ["--model.name", str(real_dir)], overrides=plan.overrides)
    model = build_model(twin.model)
    assert type(model).__name__ == "HFCausalLM" and twin.model.tokenizer == "byte"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]]))
    assert logits.shape == (1, 5, 264) and torch.isfinite(logits).all()


def test_a_config_transformers_cannot_shrink_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Where transformers' own checks refuse the shrunk config (here: a mixer width that no longer adds up),
    `rl --twin` says so in one line with the way out, never a traceback."""
    real_dir = write_big_config(tmp_path / "real", "falcon_h1", "FalconH1ForCausalLM")
    monkeypatch.setattr(twin_hf, "SIZES", {**twin_hf.SIZES, "mamba_d_head": 24})
    monkeypatch.chdir(ROOT)
    argv = ["@", "examples/reverse_text/rl.toml", "--model.name", str(real_dir), "--twin"]
    argv += ["--orchestrator.batching.prefix-merge", "false", "--output-dir", str(tmp_path / "run")]
    assert rl.main(argv) == 2
    err = capsys.readouterr().err.strip().split("error: ", 1)[1]
    assert err.startswith("rl --twin: transformers cannot build a tiny FalconH1ForCausalLM") and "\n" not in err
