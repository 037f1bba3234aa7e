"""`rl plan`: the planner's arithmetic on a hand-checked model, its table for every configs/ model x hardware
combination, and one-line errors for a bad or missing hardware layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbor.config.hardware import HardwareConfig, PlanConfig
from arbor.config.loader import load_config
from arbor.config.rl import RLConfig
from arbor.launch.report import planner_lines
from arbor.launch.rl import main, write_configs
from arbor.models.args import ModelArgs
from arbor.models.vision_params import vision_tower_params
from arbor.models.vision_tiny import tiny_vl_config, write_tiny_vl
from arbor.planner import attended, balance, forward_flops, model_figures, plan, table, trainer_rate

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted((ROOT / "configs" / "models").glob("*.toml"))
HARDWARE = sorted((ROOT / "configs" / "hardware").glob("*.toml"))

# 2 layers, hidden 4, 2 query heads and 1 KV head of dim 2, MLP 8, vocabulary 10 tied. By hand: attention
# 4x(4+2x2) + 4x4 + 2x4 (norms) + 2x2 (q/k norms) = 60 per layer, MLP 3x4x8 = 96, embedding 40, final norm 4:
# 2x(60+96) + 40 + 4 = 356 parameters, all in a token's matmuls (tied: the embedding is the lm_head).
TINY = ModelArgs(
    vocab_size=10,
    hidden_size=4,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=2,
    tie_word_embeddings=True,
)


def test_the_arithmetic_of_a_hand_checked_model():
    m = model_figures(TINY)
    assert (m.total_params, m.active_params) == (356, 356)
    assert m.kv_elems == 2 * 2 * 1 * 2  # K and V x layers x KV heads x head dim
    assert m.attn_flops == 4 * 2 * 2 * 2  # (QK + AV) x 2 FLOPs x layers x heads x head dim
    assert attended(4, None) == 8  # 4 positions, causal: 4^2 / 2
    assert attended(10, 4) == 8 + 6 * 4  # past the window each position attends 4
    assert forward_flops(m, 4) == 2 * 356 * 4 + 32 * 8
    cfg = RLConfig(
        hardware=HardwareConfig(peak_tflops=1.0, hbm_gb=1.0, hbm_tb_s=1.0, interconnect_gb_s=1.0),
        plan=PlanConfig(train_mfu=0.5, weight_bytes=2.0),
    )
    compute, broadcast = trainer_rate(cfg, m, gpus=2, seq=4)
    assert compute == pytest.approx(2 * 1e12 * 0.5 / (3 * 3104))
    assert broadcast == pytest.approx(356 * 2 / 1e9)


def test_a_moe_model_counts_only_its_routed_top_k_per_token():
    moe = ModelArgs(
        vocab_size=10,
        hidden_size=4,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
        tie_word_embeddings=False,
        architecture="Qwen3MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
    )
    m = model_figures(moe)
    idle = 2 * 3 * 3 * 4 * 8  # 2 layers x 3 unused experts x 3x4x8 each
    assert m.active_params == moe.num_params() - idle - 10 * 4  # the input embedding is a lookup


def test_disaggregated_pools_run_at_the_slower_rate_and_colocated_ones_alternate():
    cfg = RLConfig(
        model={"name": "qwen3-tiny"},
        hardware=HardwareConfig(peak_tflops=1.0, hbm_gb=1.0, hbm_tb_s=0.1, interconnect_gb_s=1.0),
    )
    m = model_figures(TINY)
    apart = balance(cfg, m, 1, 1, 0.9, colocated=False)
    assert apart["rate"] == min(apart["trainer"], apart["generator"]["rate"])
    assert min(apart["trainer_wait"], apart["generator_idle"]) == 0
    shared = balance(cfg, m, 1, 1, 0.9, colocated=True)
    t, g = shared["trainer"], shared["generator"]["rate"]
    assert shared["rate"] == pytest.approx(t * g / (t + g))
    assert shared["step_s"] == pytest.approx(cfg.orchestrator.batch_size / shared["rate"])


def test_the_matched_split_is_at_least_as_fast_as_the_configured_one():
    cfg = RLConfig.model_validate(
        {
            "model": {"name": "Qwen/Qwen3-4B"},
            "hardware": {"peak_tflops": 989.0, "hbm_gb": 80.0, "hbm_tb_s": 3.35, "interconnect_gb_s": 50.0},
            "slurm": {"inference_nodes": 1, "trainer_nodes": 2, "gpus_per_node": 8},
            "trainer": {"parallel": {"nproc": 8}},
            "inference": {"backend": "vllm"},
        }
    )
    p = plan(cfg)
    assert p["gpus"] == 24 and p["matched"] is not None
    trainer, inference, best = p["matched"]
    assert trainer % 8 == 0 and trainer + inference == 24
    assert best["rate"] >= p["now"]["rate"]


@pytest.mark.parametrize("hardware", HARDWARE, ids=lambda p: p.stem)
@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_rl_plan_prints_its_table_for_every_model_and_hardware_layer(model, hardware, capsys):
    assert main(["plan", "@", str(model), "@", str(hardware)]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split(None, 1) if " " in line else (line, "") for line in out.splitlines())
    assert out.splitlines()[0].startswith("model ")
    assert "advice" in rows and "matched split" in out
    assert "trainer samples/s" in out or "does not fit" in out


def test_a_bad_hardware_layer_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "hw.toml"
    bad.write_text("[hardware]\npeak_tflops = -1.0\nhbm_gb = 80.0\nhbm_tb_s = 3.35\ninterconnect_gb_s = 50.0\n")
    assert main(["plan", "@", str(ROOT / "configs/models/qwen3-4b.toml"), "@", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hardware.peak_tflops" in err


def test_a_config_without_a_hardware_layer_is_a_one_line_error(capsys):
    assert main(["plan", "@", str(ROOT / "configs/models/qwen3-4b.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[hardware]" in err


def test_arbor_report_puts_the_planners_estimates_next_to_the_measured_figures(tmp_path):
    write_configs(
        load_config(
            RLConfig,
            [
                "@",
                str(ROOT / "configs/models/qwen3-tiny.toml"),
                "@",
                str(ROOT / "configs/hardware/cpu-laptop.toml"),
                "--output-dir",
                str(tmp_path),
            ],
        )
    )
    rows = [{"step": 0, "throughput/trainer_wait_frac": 0.25, "throughput/queue_depth": 3.0}]
    lines = planner_lines(tmp_path, rows)
    assert lines[0].startswith("- trainer wait: 0.25 measured (mean), planner 0.00")
    assert "not recorded (no `throughput/generator_idle_frac`)" in lines[1]
    assert lines[2].startswith("- queue depth: 3.00 measured")
    assert lines[3].startswith("- planner advice for the next run: trainer-bound")
    (tmp_path / "configs" / "rl.toml").write_text("")
    assert planner_lines(tmp_path, rows)[-1].startswith("- planner: n/a (rl plan needs a [hardware] table")


# docs/planner.md writes these estimates next to the references' published figures: a change to the model must
# change the doc with them.
REFERENCES = [
    (
        "qwen3-235b-a22b",
        "semianalysis_qwen3_235b",
        [],
        {"trainer": 1.67, "generator": 3.18, "step_s": 306, "usd": 3.70},
    ),
    (
        "qwen3-235b-a22b",
        "semianalysis_qwen3_235b",
        ["--plan.train-mfu", "0.3"],
        {"trainer": 4.65, "generator": 3.18, "step_s": 161, "usd": 1.95, "trainer_wait": 0.32},
    ),
    ("qwen3-235b-a22b", "semianalysis_slime_qwen3_235b", [], {"step_s": 182, "usd": 5.99, "trainer_wait": 0.50}),
    ("glm-5", "primerl_glm5", [], {"step_s": 144}),
    ("glm-5", "primerl_glm5", ["--plan.train-mfu", "0.3"], {"step_s": 134}),
]


@pytest.mark.parametrize("model, setup, flags, figures", REFERENCES, ids=lambda x: x if isinstance(x, str) else None)
def test_the_estimates_docs_planner_md_compares_with_the_references(model, setup, flags, figures):
    cfg = load_config(
        RLConfig,
        ["@", str(ROOT / f"configs/models/{model}.toml"), "@", str(ROOT / f"benchmarks/planner/{setup}.toml"), *flags],
        env={},
    )
    p = plan(cfg)
    now = p["now"]
    got = {
        "trainer": now["trainer"],
        "generator": now["generator"]["rate"],
        "step_s": now["step_s"],
        "usd": p["usd_per_mtok"],
        "trainer_wait": now["trainer_wait"],
    }
    for key, value in figures.items():
        assert got[key] == pytest.approx(value, rel=0.01, abs=0.005), key


def test_a_vision_language_model_counts_its_vision_tower(tmp_path):
    """Qwen2.5-VL-3B (configs/models/qwen2.5-vl-3b.toml; its shape from arbor's published table, no download):
    decoder and vision tower together within 1% of the 3.75B parameters published; the tower is held in memory
    but does not run per text token. A local vision-language checkpoint's tower is counted from its config."""
    cfg = load_config(
        RLConfig,
        ["@", str(ROOT / "configs/models/qwen2.5-vl-3b.toml"), "@", str(ROOT / "configs/hardware/1xgpu.toml")],
        env={"HF_HUB_OFFLINE": "1"},
    )
    p = plan(cfg)
    m = p["figures"]
    assert abs(m.total_params - 3.75e9) / 3.75e9 < 0.01, m.total_params
    assert abs(m.vision_params - 0.669e9) / 0.669e9 < 0.01, m.vision_params
    assert m.active_params == m.total_params - m.vision_params  # a tied head: per token, the whole decoder
    model_row = dict(table(p))["model"]
    assert "3.75B parameters (0.669B of them the vision tower)" in model_row, model_row
    vl_dir = write_tiny_vl(tmp_path / "tiny-vl")
    local = plan(RLConfig(model={"name": str(vl_dir), "impl": "transformers"}, hardware=cfg.hardware))
    assert local["figures"].vision_params == vision_tower_params(tiny_vl_config().to_dict()) > 0
