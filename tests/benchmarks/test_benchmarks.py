"""Every benchmark's `--smoke` run (tiny sizes, one repeat, the same code path; benchmarks/smoke.py) in a process
of its own: it exits 0 and its last line is the JSON it promises, with the keys its readers use. A benchmark that
a change elsewhere broke (an API it calls, a config field it passes) fails here, not when someone next wants its
figure. The figures of a smoke run measure nothing, so only their presence is checked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from arbor.config.loader import load_config
from arbor.config.rl import RLConfig

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCORED = {"benchmark", "value", "target", "ok"}
"""The keys of every benchmark that scores itself against a target."""

EXPECTED: dict[str, set[str]] = {
    "async_vs_sync": SCORED | {"sync_wall_s", "async_wall_s", "sync_reward", "async_reward", "cpu_ceiling"},
    "bf16_learning": SCORED | {"cases", "output_dir"},
    "ckpt_verify": SCORED | {"verify_s_per_gib_1_thread", "read_s_per_gib", "manifest_s_per_gib"},
    "cp_memory": SCORED | {"growth", "peak_bytes"},
    "code_sandbox": SCORED | {"median_latency_s", "hostile_wall_s", "isolation"},
    "decode": {"benchmark", "tokens_per_s", "batch", "shape", "mean_completion_tokens"},
    "dsa": SCORED | {"growth", "ms", "dense_over_dsa_at_4k_fwd_bwd"},
    "engines": {"benchmark", "model", "local", "vllm", "greedy_identical", "greedy_max_logprob_diff"},
    "fp8": SCORED | {"cpu_fp32_ms", "cpu_fp8_ms"},
    "gateway": SCORED | {"median_ms", "p95_ms", "recorded", "calls"},
    "logprobs_memory": SCORED | {"time_ratio", "max_abs_difference", "full_peak_bytes", "chunked_peak_bytes"},
    "lora_update": SCORED | {"full_seconds", "adapter_seconds", "full_mib", "adapter_mib"},
    "mfu": SCORED | {"tokens_per_s", "mfu", "shape", "flops_per_token", "peak_tflops", "prime_rl"},
    "mtp_speculative": SCORED | {"online_ratio", "frozen_ratio", "decode_tokens_per_s", "acceptance_at_speed"},
    "packed_attention": SCORED | {"chunked_tokens_per_s", "dense_tokens_per_s", "max_abs_difference", "tree"},
    "parallel": SCORED | {"tokens_per_s_1_rank", "tokens_per_s_2_ranks", "speedup_2_ranks", "one_rank_fraction"},
    "prefix_merge": SCORED | {"ideal_ratio", "row_ratio", "speedup", "step_s_unmerged", "step_s_merged"},
    "reverse_text_ceiling": SCORED | {"dirs"},
    "router": SCORED | {"added_p99_ms", "direct_p50_ms", "routed_p50_ms", "requests"},
    "scheduler_sim": SCORED | {"windowed_vs_greedy_throughput", "windowed_vs_greedy_mix_shift", "params"},
    "shared_fleet": SCORED | {"separate_samples_per_s", "shared_samples_per_s", "shared_slow_reward"},
    "startup": SCORED | {"rl_first_step_s", "import_torch_s"},
    "startup_phases": {"benchmark", "first_generation_s", "cpu_s", "phases"},
    "step_time": SCORED | {"lag1_over_bound", "lag0_over_plain", "seconds"},
    "trainer_throughput": SCORED | {"arbor_tokens_per_s", "plain_tokens_per_s", "tokens_per_step"},
    "weight_publish": SCORED | {"throughput_ratio", "publish_load_seconds", "full_path_memory"},
    "vs_trl": SCORED | {"steps_per_s_ratio", "arbor", "trl", "lr", "ceiling"},
    "warm_start_vs_trl": SCORED | {"rise_target", "arbor_rise", "trl_rise", "trl", "seeds"},
    "weights": SCORED | {"raw_seconds", "publish_load_seconds", "sha256_ratio"},
}
"""Benchmark (benchmarks/NAME.py) -> keys its last-line JSON must hold."""

HELPERS = {"smoke", "vs_trl_task"}
"""Modules in benchmarks/ that are not benchmarks."""

IN_GPU_KIT = {"decode": "decode_0.6b", "logprobs_memory": "logprobs_memory", "mfu": "mfu_0.6b"}
"""Benchmark -> the part of scripts/gpu_check.py whose CPU mode runs its `--smoke` run, the same command (checked
below): tests/launch/test_gpu_kit.py::test_cpu_mode_passes_and_prints_its_json_lines runs it and checks its JSON
against EXPECTED, so test_smoke_run_prints_its_json does not run it a second time."""


def _extra_args(name: str, tmp: Path) -> list[str]:
    """Arguments beyond `--smoke`: where a benchmark keeps its runs by default (a temporary directory it leaves)."""
    return ["--output-dir", str(tmp)] if name in ("mtp_speculative", "bf16_learning") else []


def test_every_benchmark_has_a_smoke_test():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - HELPERS
    assert scripts == set(EXPECTED), "benchmarks/ and EXPECTED list different benchmarks"


def test_the_gpu_kit_runs_the_smoke_runs_it_stands_in_for():
    spec = importlib.util.spec_from_file_location("kit_gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["kit_gpu_check"] = gpu_check  # dataclasses look their module up by name
    spec.loader.exec_module(gpu_check)
    argv = {p.name: p.argv for p in gpu_check.parts(cpu=True)}
    for name, part in IN_GPU_KIT.items():
        # mfu's `--smoke` shape is "tiny" (benchmarks/mfu.py), which the kit names explicitly
        assert argv[part] == [
            str(BENCHMARKS / f"{name}.py"),
            "--smoke",
            *(["--shape", "tiny"] if name == "mfu" else []),
        ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.vllm) if n == "engines" else n for n in sorted(set(EXPECTED) - set(IN_GPU_KIT))],
)
def test_smoke_run_prints_its_json(name: str, tmp_path: Path):
    argv = [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", *_extra_args(name, tmp_path)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, f"{name} --smoke exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{name} --smoke printed nothing:\n{proc.stderr[-2000:]}"
    result = json.loads(lines[-1])
    assert result["benchmark"] == name
    missing = EXPECTED[name] - result.keys()
    assert not missing, f"{name}'s JSON lacks {sorted(missing)}: {lines[-1][:1000]}"
    if name == "vs_trl" and importlib.util.find_spec("trl") is None:  # CI: the bench group is not installed
        assert result["trl"].startswith("skipped") and "TRL is not installed" in proc.stdout
        assert result["arbor"] and result["arbor"][0]["steps"] >= 1
    if name == "warm_start_vs_trl" and importlib.util.find_spec("trl") is None:
        assert result["trl"].startswith("skipped") and "TRL is not installed" in proc.stdout
        assert result["seeds"][0]["arbor"]["steps"] == 3 and "held_out" in result["seeds"][0]["arbor"]


def test_warm_start_vs_trl_gives_trl_the_examples_own_rl_settings(monkeypatch):
    """benchmarks/warm_start_vs_trl.py's TRL arm takes the settings `rl` resolves for the example (equal arms), and a
    setting TRL's arm has no equal of is refused in one line naming the field."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("warm_start_vs_trl", BENCHMARKS / "warm_start_vs_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    example = ["@", str(ROOT / "examples/reverse_text/rl.toml")]
    cfg = load_config(RLConfig, [*example, "--trainer.optim.lr", "2e-3"], env={})
    s = bench.grpo_settings(cfg)
    assert (s.prompts * s.group, s.group, s.steps) == (cfg.orchestrator.batch_size, 8, cfg.max_steps)
    assert (s.lr, s.max_tokens, s.temperature) == (2e-3, 16, cfg.orchestrator.sampling.temperature)
    assert (s.clip_low, s.clip_high, s.std_normalize) == (0.2, 0.28, False)
    with pytest.raises(SystemExit, match=r"^trainer.loss.name = 'cispo': TRL's arm of this benchmark maps only"):
        bench.grpo_settings(load_config(RLConfig, [*example, "--trainer.loss.name", "cispo"], env={}))
    with pytest.raises(SystemExit, match=r"^sft.steps = 0: "):
        bench.grpo_settings(load_config(RLConfig, [*example, "--sft.steps", "0"], env={}))
