"""The GPU evidence kit (scripts/gpu_check.sh, scripts/gpu_check.py, scripts/gpu_prepare.py): its CPU mode runs
every part at tiny sizes and prints its JSON lines, a failing part is recorded while the next still runs, and the
preparation step picks the wheels a GPU host lacks from uv.lock (offline: no download here)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    return _load_path(name, ROOT / "scripts" / f"{name}.py")


def _load_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
gpu_prepare = _load("gpu_prepare")


def test_prepare_carries_pure_python_and_named_compiled_wheels_only():
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    requirements = "\n".join(
        [
            "torch==2.13.0",
            "pydantic==2.14.3",
            "pydantic-core==2.50.4",
            "numpy==2.3.5 ; python_full_version < '3.13'",
            "nvidia-nccl-cu13==2.29.7 ; sys_platform == 'linux'",
            "colorama==0.4.6 ; sys_platform == 'win32'",
            "transformers==5.19.0",
        ]
    )
    chosen = gpu_prepare.select(lock, requirements, "3.12")
    names = sorted(f.split("-")[0] for f in chosen)
    assert names == ["pydantic", "pydantic_core", "transformers"]
    core = next(f for f in chosen if f.startswith("pydantic_core"))
    assert "-cp312-" in core and "x86_64" in core
    assert all(w["hash"].startswith("sha256:") for w in chosen.values())


def test_gpu_mode_runs_the_same_parts_at_real_shapes():
    cpu, gpu = gpu_check.parts(cpu=True), gpu_check.parts(cpu=False)
    assert [p.name for p in cpu] == [p.name for p in gpu]
    argv = {p.name: p.argv for p in gpu}
    assert "qwen3-0.6b" in argv["mfu_0.6b"] and "qwen3-30b-a3b" in argv["mfu_30b_a3b"]
    assert "block" in argv["rl_fp8"] and "bfloat16" in argv["rl_bf16"]
    assert all("--smoke" not in a for a in argv.values())


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch, capsys):
    ok = gpu_check.Part("ok", ["-c", 'print(\'{"benchmark": "x", "value": 1}\')'], 30)
    monkeypatch.setattr(gpu_check, "parts", lambda cpu: [gpu_check.Part("fails", ["-c", "exit(3)"], 30), ok])
    out = tmp_path / "kit.jsonl"
    assert gpu_check.main(["--cpu", "--out", str(out)]) == 1
    records = {r["part"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["fails"]["rc"] == 3 and not records["fails"]["ok"]
    assert records["ok"]["ok"] and records["ok"]["result"] == {"benchmark": "x", "value": 1}
    assert capsys.readouterr().out.splitlines()[-1].startswith("2/3 parts ok; failed: ['fails']")


@pytest.mark.slow
@pytest.mark.timeout(2000)  # nine parts, each a process of its own: ~4 minutes of CPU, 15 on a shared 2-core box
def test_cpu_mode_passes_and_prints_its_json_lines(tmp_path):
    out = tmp_path / "gpu_check.jsonl"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["part"] for r in records] == ["host", *(p.name for p in gpu_check.parts(cpu=True))]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert printed == records
    figures = {r["part"]: r["result"] for r in records}
    assert figures["mfu_0.6b"]["tokens_per_s"] > 0 and figures["decode_0.6b"]["tokens_per_s"] > 0
    assert all(figures[p]["steps"] >= 1 for p in ("rl_bf16", "rl_fp8", "rl_moe"))
    # these parts are benchmarks' `--smoke` runs, which tests/benchmarks/test_benchmarks.py leaves to this test
    smokes = _load_path("benchmark_smokes", ROOT / "tests" / "benchmarks" / "test_benchmarks.py")
    for name, part in smokes.IN_GPU_KIT.items():
        assert figures[part]["benchmark"] == name
        missing = smokes.EXPECTED[name] - figures[part].keys()
        assert not missing, f"{part}'s JSON lacks {sorted(missing)}: {figures[part]}"
