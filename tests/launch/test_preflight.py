"""Preflight: each check fails `rl` in one line, before any process starts (no logs/ directory appears)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from arbor.config.loader import load_config
from arbor.config.rl import RLConfig
from arbor.inference.vllm import backend as vllm_backend
from arbor.launch import preflight
from arbor.launch.preflight import PreflightError

TINY = [
    "--model.name",
    "qwen3-test",
    "--seq-len",
    "48",
    "--orchestrator.batch-size",
    "8",
    "--orchestrator.group-size",
    "4",
    "--orchestrator.sampling.max-tokens",
    "8",
    "--max-steps",
    "2",
]


def _fails(out: Path, *args: str) -> str:
    """Runs `rl`; asserts a one-line error (exit 2) and that no child process was started; returns the line."""
    res = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "--output-dir", str(out), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr + res.stdout
    assert len(lines) == 1 and ": error: " in lines[0], res.stderr
    assert not (out / "logs").exists(), "a child process was started"
    return lines[0]


def _hf_dir(path: Path, hidden: int = 32, layers: int = 2, weights: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "vocab_size": 264,
                "hidden_size": hidden,
                "intermediate_size": 4 * hidden,
                "num_hidden_layers": layers,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": hidden // 4,
                "rope_theta": 10000.0,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True,
            }
        )
    )
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.slow
def test_output_dir_not_writable(tmp_path):
    (tmp_path / "file").write_text("")
    line = _fails(tmp_path / "file" / "run")
    assert "output_dir" in line and "not writable" in line


@pytest.mark.slow
def test_output_dir_without_room_for_checkpoints(tmp_path):
    model = _hf_dir(tmp_path / "huge", hidden=16384, layers=2000)  # ~6T parameters: no disk here holds that
    line = _fails(tmp_path / "run", "--model.name", str(model))
    assert "free but the run keeps up to" in line and "trainer.ckpt.keep" in line


@pytest.mark.slow
def test_inference_port_taken(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _fails(tmp_path / "run", "--inference.port", str(port))
    assert f"inference.port {port}" in line and "not free" in line


@pytest.mark.slow
def test_model_directory_without_config_or_weights(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "config.json is missing" in _fails(tmp_path / "run", "--model.name", str(tmp_path / "empty"))
    nowts = _hf_dir(tmp_path / "noweights", weights=False)
    assert "no *.safetensors" in _fails(tmp_path / "run2", "--model.name", str(nowts))
    (nowts / "pytorch_model.bin").write_bytes(b"")  # an older checkpoint's pickled weights: said how to convert
    assert "pytorch_model.bin is a pickled PyTorch checkpoint" in _fails(tmp_path / "run4", "--model.name", str(nowts))
    assert "neither a preset" in _fails(tmp_path / "run3", "--model.name", str(tmp_path / "missing"))


@pytest.mark.slow
def test_requested_gpus_missing(tmp_path):
    line = _fails(tmp_path / "run", "--trainer.parallel.backend", "nccl", "--trainer.parallel.nproc", "64")
    assert "needs 64 CUDA GPU(s)" in line


def test_backend_not_importable(tmp_path, monkeypatch):
    importable = preflight._importable
    # vLLM may be installed (CI installs its CPU build): this test is about a machine without it.
    monkeypatch.setattr(preflight, "_importable", lambda module: module != "vllm" and importable(module))
    cfg = load_config(RLConfig, ["--output-dir", str(tmp_path / "run"), *TINY])
    # No config class offers vllm yet on CPU builds: set the value as a config that asks for it would.
    object.__setattr__(cfg.inference, "backend", "vllm")
    with pytest.raises(PreflightError, match=r"inference.backend = 'vllm' but 'vllm' is not installed") as e:
        preflight.check_backends(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_model_vllms_cpu_build_cannot_serve_fails_before_vllm_starts(tmp_path, monkeypatch):
    """vLLM's CPU build starts any model, then its engine dies at the first request when the heads are of a size its
    CPU attention lacks (qwen3-test's 8): preflight refuses that, for the policy and for a launched teacher."""
    monkeypatch.setattr(vllm_backend, "vllm_build", lambda: "cpu")
    monkeypatch.setattr(preflight, "_importable", lambda module: True)
    for flags in (
        ["--inference.backend", "vllm"],
        ["--teacher.model.name", "qwen3-test", "--teacher.backend", "vllm", "--trainer.loss.name", "distill"],
    ):
        cfg = load_config(RLConfig, ["--output-dir", str(tmp_path / "run"), *TINY, *flags])
        with pytest.raises(
            PreflightError,
            match=r"backend = 'vllm' with \w+.model.name 'qwen3-test': vLLM's CPU build "
            r"cannot serve attention heads of size 8 \(it serves 32, 64,",
        ) as e:
            preflight.check_backends(cfg)
        assert "\n" not in str(e.value)
    served = load_config(
        RLConfig,
        ["--output-dir", str(tmp_path / "run"), *TINY, "--inference.backend", "vllm", "--model.name", "qwen3-tiny"],
    )
    preflight.check_backends(served)
    monkeypatch.setattr(vllm_backend, "vllm_build", lambda: "gpu")  # CUDA attention kernels have their own sizes
    preflight.check_backends(cfg)


@pytest.mark.slow
def test_sft_dataset_unreadable_or_not_jsonl(tmp_path):
    line = _fails(tmp_path / "run", "--sft.steps", "2", "--sft.data", str(tmp_path / "missing.jsonl"))
    assert "sft.data" in line and "not readable" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text("prompt,completion\n")
    assert "not JSON" in _fails(tmp_path / "run2", "--sft.steps", "2", "--sft.data", str(bad))


@pytest.mark.slow
def test_environment_not_importable(tmp_path):
    line = _fails(tmp_path / "run", "--orchestrator.environment.id", "no_such_pkg.envs:make")
    assert "orchestrator.environment.id" in line and "not importable" in line


@pytest.mark.slow
def test_loss_or_advantage_module_not_importable(tmp_path):
    line = _fails(tmp_path / "run", "--trainer.loss.name", "no_such_pkg.losses:mine")
    assert "trainer.loss.name" in line and "not importable" in line
    line = _fails(tmp_path / "run2", "--orchestrator.advantage.name", "no_such_mod:adv")
    assert "orchestrator.advantage.name" in line


def test_checks_pass_for_a_valid_config(tmp_path):
    cfg = load_config(RLConfig, ["--output-dir", str(tmp_path / "run"), *TINY])
    preflight.run_checks(cfg)
    assert 0 < preflight.estimate_run_bytes(cfg) < 1e8


@pytest.mark.gpu(reason="compares preflight's CUDA device count with torch's")
def test_gpu_count_without_torch_matches_torch():
    import torch

    assert preflight.count_gpus() == torch.cuda.device_count()


def test_context_summariser_not_importable(tmp_path):
    cfg = load_config(
        RLConfig,
        [
            "--output-dir",
            str(tmp_path / "run"),
            *TINY,
            "--orchestrator.environment.id",
            "tool_use",
            "--orchestrator.environment.context.strategy",
            "summarise",
            "--orchestrator.environment.context.summariser",
            "no_such_module:summary",
        ],
    )
    with pytest.raises(PreflightError, match=r"orchestrator.environment.context.summariser 'no_such_module:summary'"):
        preflight.check_plugins(cfg)
    with pytest.raises(Exception, match="trigger_tokens is set but context.strategy is 'none'"):
        load_config(RLConfig, [*TINY, "--orchestrator.environment.context.trigger-tokens", "100"])


@pytest.mark.slow
def test_tokenizer_path_is_checked_with_a_preset_model(tmp_path):
    line = _fails(tmp_path / "run", "--model.tokenizer", str(tmp_path / "nonexistent"))
    assert "model.tokenizer" in line and "not a directory" in line


@pytest.mark.slow
def test_black_box_agent_file_or_program_missing(tmp_path):
    bb = ["--orchestrator.environment.id", "black_box"]
    line = _fails(
        tmp_path / "run", *bb, "--orchestrator.environment.args", f"{{ function = '{tmp_path}/agent.py:solve' }}"
    )
    assert "orchestrator.environment.args.function" in line and "does not exist" in line
    line = _fails(
        tmp_path / "run2", *bb, "--orchestrator.environment.args", "{ function = 'no_such_pkg.agents:solve' }"
    )
    assert "not importable" in line
    line = _fails(
        tmp_path / "run3", *bb, "--orchestrator.environment.args", f"{{ command = 'python {tmp_path}/a.py' }}"
    )
    assert "orchestrator.environment.args.command" in line and "a.py does not exist" in line
    line = _fails(tmp_path / "run4", *bb, "--orchestrator.environment.args", "{ command = 'no-such-agent-program' }")
    assert "'no-such-agent-program' is not found" in line


@pytest.mark.slow
def test_an_argument_unlike_any_the_environment_takes_fails_preflight(tmp_path):
    line = _fails(tmp_path / "run", "--orchestrator.environment.args", "{ anything_goes = true }")
    assert "orchestrator.environment.args" in line and "unknown argument 'anything_goes'" in line


@pytest.mark.slow
def test_no_task_fits_fails_naming_seq_len_max_tokens_and_the_shortest_prompt(tmp_path):
    # reverse_text's shortest prompt (byte tokenizer, chat template) is far longer than seq_len - max_tokens = 8.
    line = _fails(tmp_path / "run", "--seq-len", "16", "--orchestrator.sampling.max-tokens", "8")
    assert re.search(
        r"shortest prompt is \d+ tokens, which with sampling\.max_tokens = 8 exceeds seq_len = 16", line
    ), line


@pytest.mark.slow
def test_rl_check_runs_the_whole_preflight_and_starts_nothing(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "arbor.launch.rl", "--output-dir", str(tmp_path / "run"), *TINY, "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and "preflight passed" in ok.stdout, ok.stderr
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "configs").exists()
    line = _fails(tmp_path / "run2", "--check", "--model.tokenizer", str(tmp_path / "nonexistent"))
    assert "model.tokenizer" in line
    # --dry-run stays a pure config check: the same missing tokenizer passes it.
    dry = subprocess.run(
        [
            sys.executable,
            "-m",
            "arbor.launch.rl",
            "--output-dir",
            str(tmp_path / "run3"),
            *TINY,
            "--dry-run",
            "--model.tokenizer",
            str(tmp_path / "nonexistent"),
        ],
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 0, dry.stderr


def test_a_group_beyond_the_local_engines_slots_fails_preflight_unless_its_episodes_are_multi_turn():
    """A single-turn group is one request for group_size samples, which the local engine decodes together: with
    fewer slots it could never run (the run used to start and fail 9 groups in a row on the server's 400)."""
    small = ["--inference.max-batch-size", "2"]
    with pytest.raises(PreflightError, match=r"orchestrator\.group_size \(4\) exceeds inference\.max_batch_size \(2\)"):
        preflight.check_tasks_fit(load_config(RLConfig, [*TINY, *small], env={}))
    preflight.check_tasks_fit(load_config(RLConfig, [*TINY, "--inference.max-batch-size", "4"], env={}))
    multi_turn = ["--seq-len", "512", "--orchestrator.environment.id", "tool_use"]  # one sample per turn
    preflight.check_tasks_fit(load_config(RLConfig, [*TINY, *small, *multi_turn], env={}))
    on_vllm = load_config(RLConfig, [*TINY, *small, "--inference.backend", "vllm"], env={})
    preflight.check_group_fits_engine(on_vllm, object())  # vLLM queues a request's samples itself
