"""`inference.colocate`: refused in one line where trainer and fleet cannot take turns, reaching the trainer and
the orchestrator from its one spelling; the turns' bounded waits; and `rl plan`'s comparison of the colocated and
split layouts on one GPU (the issue's acceptance: Qwen3-8B on one 80 GB GPU fits colocated, not split)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbor.colocate import TurnTimeout, hand_over, train_turn, wait_turn
from arbor.config.inference import InferenceConfig
from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.inference.vllm.launch import serve_argv, vllm_build
from arbor.launch.rl import main
from arbor.planner import plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "reverse_text" / "rl.toml")
EIGHT_B = ["@", str(ROOT / "configs/models/qwen3-8b.toml"), "@", str(ROOT / "configs/hardware/1xgpu.toml")]
EIGHT_B += ["@", str(ROOT / "configs/envs/gsm8k.toml")]


def test_colocate_reaches_the_trainer_and_the_orchestrator(tmp_path):
    cfg = load_config(RLConfig, ["@", EXAMPLE, "--inference.colocate", "true", "--output-dir", str(tmp_path)])
    assert cfg.trainer.colocate and cfg.orchestrator.colocate
    plain = load_config(RLConfig, ["@", EXAMPLE, "--output-dir", str(tmp_path)])
    assert not plain.trainer.colocate and not plain.orchestrator.colocate


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--orchestrator.scheduler.mode", "async"], "orchestrator.scheduler.mode = 'sync' or 'one_step_off'"),
        (["--trainer.colocate", "false"], "trainer.colocate = False differs from inference.colocate = True"),
        (["--slurm.trainer-nodes", "2", "--slurm.inference-nodes", "1"], "one node"),
    ],
)
def test_a_config_where_turns_cannot_apply_is_one_line_naming_the_field(tmp_path, flags, says):
    argv = ["@", EXAMPLE, "--inference.colocate", "true", "--output-dir", str(tmp_path), *flags]
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, argv)
    line = str(e.value)
    assert says in line and "inference.colocate" in line and "\n" not in line.strip()


def test_a_turn_that_never_comes_ends_its_wait_in_one_line(tmp_path):
    with pytest.raises(TurnTimeout, match="the orchestrator did not hand the device over within 0s"):
        wait_turn(train_turn(tmp_path, 3), 0.05, "the orchestrator")
    with pytest.raises(RuntimeError, match="stopped while waiting for the trainer"):
        wait_turn(train_turn(tmp_path, 3), 60, "the trainer", alive=lambda: False)
    hand_over(train_turn(tmp_path, 3), rss_bytes=5.0)
    assert wait_turn(train_turn(tmp_path, 3), 60, "the orchestrator")["rss_bytes"] == 5.0


def test_rl_plan_fits_qwen3_8b_on_one_80_gb_gpu_colocated_and_not_split(capsys):
    cfg = load_config(RLConfig, EIGHT_B)
    shared = plan(cfg)["shared"]
    turns, split = shared["colocated"], shared["split"]
    assert "misfit" not in turns and turns["trainer_gb"] == pytest.approx(65.5, abs=0.1)  # 8 bytes/parameter
    assert turns["kv_gb"] > 40 and turns["step_s"] > turns["swap_s"] > 0
    assert "misfit" in split and split["trainer_gb"] == pytest.approx(131.1, abs=0.1)  # 16 bytes/parameter
    assert main(["plan", *EIGHT_B]) == 0
    out = capsys.readouterr().out
    assert "colocated (taking turns)  fits: trainer 65.53 of 80 GB" in out
    assert "split (memory split)      does not fit: the trainer needs 131.1 GB per GPU" in out
    # asked for the memory split, the planner says to take turns
    assert main(["plan", *EIGHT_B, "--inference.colocate", "false"]) == 0
    assert "set inference.colocate = true: the split does not fit" in capsys.readouterr().out


def test_a_colocated_vllm_server_starts_in_sleep_mode_and_the_cpu_build_is_refused_it():
    cfg = InferenceConfig(backend="vllm", colocate=True)
    assert "--enable-sleep-mode" in serve_argv(cfg, "/m", 1)
    assert "--enable-sleep-mode" not in serve_argv(InferenceConfig(backend="vllm"), "/m", 1)
    if vllm_build() == "cpu":
        line = cfg.engine_backend().preflight(cfg, "inference")
        assert line is not None and line.startswith("inference.colocate = true needs vLLM's sleep mode")
