"""The inference backend seam (arbor.config.inference.InferenceBackend): a user's backend is one module and one
registry entry, and the server, the launcher, preflight, the planner, the core split, `fleet` and config
validation pick it up with no other change; the built-ins (`local`, `vllm`) satisfy the same contract."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest

from arbor.config.fleet import FleetConfig
from arbor.config.inference import InferenceBackend, InferenceConfig, KVPolicy, WeightKind, engine_backend
from arbor.config.loader import ConfigError, load_config
from arbor.config.rl import RLConfig
from arbor.inference import server
from arbor.launch import preflight
from arbor.launch import rl as rl_launch
from arbor.launch.cores import split_cores
from arbor.launch.preflight import PreflightError
from arbor.planner import layout
from arbor.registry import BACKENDS, Member

TOY = '''
"""A toy engine: what a user writes to add a backend."""

from arbor.config.inference import InferenceConfig


class ToyBackend:
    title = "the toy engine"
    weight_kinds = frozenset({"filesystem"})
    kv_policies = frozenset({"keep"})
    required_module = "toy_engine_not_installed"
    install_hint = "pip install toy-engine"
    needs_gpu = True
    colocated = False
    core_split = False

    def serves_on_cpu_here(self) -> bool:
        return False

    def memory_share(self, cfg: InferenceConfig) -> float:
        return 0.5

    def batch_slots(self, cfg: InferenceConfig) -> int:
        return 7

    def max_logprobs(self, cfg: InferenceConfig) -> int | None:
        return 3

    def preflight(self, cfg: InferenceConfig, where: str) -> str | None:
        if cfg.seq_len > 64:
            return f"{where}.seq_len {cfg.seq_len}: the toy engine serves at most 64 tokens"
        return None

    def command(self, cfg: InferenceConfig) -> str | None:
        return f"toy-engine --model {cfg.model.name} --max-len {cfg.seq_len}"

    def serve(self, cfg: InferenceConfig) -> int:
        with open(cfg.ready_file, "w") as f:
            f.write(f"toy serving {cfg.model.name}")
        return 0


TOY = ToyBackend()
'''

RUN = ["--model.name", "qwen3-test", "--seq-len", "48", "--orchestrator.sampling.max-tokens", "8"]


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> InferenceBackend:
    """The user's two steps: the module (here in a directory on sys.path) and its registry line."""
    (tmp_path / "toy_backend.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS.members, "toy", Member("toy_backend:TOY"))  # type: ignore[index]
    return engine_backend("toy")


def _rl(tmp_path: Path, *args: str) -> RLConfig:
    return load_config(RLConfig, ["--output-dir", str(tmp_path / "run"), *RUN, "--inference.backend", "toy", *args])


def _one_line_error(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_the_server_process_runs_a_registered_backend(toy, tmp_path):
    ready = tmp_path / "ready"
    assert server.main(["--backend", "toy", "--model.name", "qwen3-test", "--ready-file", str(ready)]) == 0
    assert ready.read_text() == "toy serving qwen3-test"


def test_rl_dry_run_renders_its_command_and_skips_the_core_split(toy, tmp_path, capsys):
    assert rl_launch.main(["--output-dir", str(tmp_path / "run"), *RUN, "--inference.backend", "toy", "--dry-run"]) == 0
    assert "the toy engine server command: toy-engine --model qwen3-test --max-len 48" in capsys.readouterr().out
    assert split_cores(_rl(tmp_path), cores=8) is None  # core_split = False: the backend sizes its own threads
    local = load_config(RLConfig, ["--output-dir", str(tmp_path / "run"), *RUN])
    assert split_cores(local, cores=8) is not None


def test_preflight_runs_its_checks_in_one_line(toy, tmp_path, monkeypatch):
    cfg = _rl(tmp_path)
    with pytest.raises(PreflightError) as e:
        preflight.check_backends(cfg)
    assert _one_line_error(e) == (
        "inference.backend = 'toy' but 'toy_engine_not_installed' is not installed (pip install toy-engine)"
    )
    monkeypatch.setattr(type(toy), "required_module", None)
    preflight.check_backends(cfg)  # seq_len 48: its own check passes
    with pytest.raises(PreflightError) as e:
        preflight.check_backends(_rl(tmp_path, "--seq-len", "96"))
    assert _one_line_error(e) == "inference.seq_len 96: the toy engine serves at most 64 tokens"
    monkeypatch.setattr(preflight, "count_gpus", lambda: 0)
    with pytest.raises(PreflightError, match=r"needs 1 CUDA GPU\(s\)"):
        preflight.check_gpus(cfg)


def test_its_capabilities_refuse_in_one_line_naming_the_backends_that_can(toy, tmp_path):
    with pytest.raises(ConfigError) as e:
        _rl(tmp_path, "--inference.kv-after-update", "recompute")
    assert (
        "kv_after_update = 'recompute' needs inference.backend = 'local' (the toy engine implements 'keep' only)"
        in (_one_line_error(e))
    )
    with pytest.raises(ConfigError) as e:
        load_config(
            InferenceConfig, ["--backend", "toy", "--weights.kind", "nccl", "--weights.nccl-inference-ranks", "1"]
        )
    assert _one_line_error(e) == (
        "weights.kind = 'nccl' needs inference.backend = 'vllm' (the toy engine loads 'filesystem' weights only)"
    )


def test_planner_fleet_and_teacher_read_its_figures(toy, tmp_path):
    assert layout(_rl(tmp_path)).memory_share == 0.5
    fleet = load_config(FleetConfig, ["--model.name", "qwen3-test", "--inference.backend", "toy"])
    assert fleet.inference.router.backend_slots == 7
    teacher = ["--teacher.model.name", "qwen3-test", "--teacher.backend", "toy", "--trainer.loss.name", "distill"]
    with pytest.raises(ConfigError) as e:
        _rl(tmp_path, *teacher, "--orchestrator.teacher.top-k", "4")
    assert "exceeds the 3 logprobs per token the teacher (toy backend) serves" in _one_line_error(e)


def test_a_backend_by_dotted_path_needs_no_registry_line(tmp_path, monkeypatch):
    (tmp_path / "toy_backend.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(InferenceConfig, ["--backend", "toy_backend:ToyBackend"])  # a class is built with no args
    assert cfg.engine_backend().batch_slots(cfg) == 7


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--inference.backend", "sglang"],
            "inference.backend: unknown inference backend 'sglang'; use one of local, vllm or a dotted path",
        ),
        (
            ["--teacher.model.name", "qwen3-test", "--teacher.backend", "sglang", "--trainer.loss.name", "distill"],
            "teacher.backend: unknown inference backend 'sglang'; use one of local, vllm or a dotted path",
        ),
        (["--inference.backend", "no_such_module:X"], "inference.backend: cannot import 'no_such_module:X'"),
        (
            ["--inference.backend", "arbor.registry:LOSSES"],
            "inference.backend: 'arbor.registry:LOSSES' is not an inference backend "
            "(arbor.config.inference.InferenceBackend): it lacks title, weight_kinds",
        ),
    ],
)
def test_a_bad_backend_is_one_line_naming_the_field(tmp_path, argv, line):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, ["--output-dir", str(tmp_path / "run"), *RUN, *argv])
    assert _one_line_error(e).startswith(line), str(e.value)


# ---- the built-ins' contract ----


@pytest.mark.parametrize("name", BACKENDS.names())
def test_builtin_backends_satisfy_the_interface(name):
    backend = engine_backend(name)
    assert isinstance(backend, InferenceBackend)
    for method in ("serves_on_cpu_here", "memory_share", "batch_slots", "max_logprobs", "preflight", "command"):
        ours = inspect.signature(getattr(InferenceBackend, method)).parameters
        assert list(inspect.signature(getattr(backend, method)).parameters) == list(ours)[1:], method
    assert list(inspect.signature(backend.serve).parameters) == ["cfg"]
    assert isinstance(backend.title, str) and backend.title
    assert backend.weight_kinds and backend.weight_kinds <= set(get_args(WeightKind))
    assert backend.kv_policies and backend.kv_policies <= set(get_args(KVPolicy))
    assert backend.required_module is None or (backend.required_module and backend.install_hint)
    cfg = load_config(InferenceConfig, ["--backend", name, "--model.name", "qwen3-tiny"])
    assert 0 < backend.memory_share(cfg) <= 1
    assert backend.batch_slots(cfg) >= 1
    assert backend.max_logprobs(cfg) is None or backend.max_logprobs(cfg) >= 1
    assert isinstance(backend.serves_on_cpu_here(), bool)
    assert backend.preflight(cfg, "inference") is None  # qwen3-tiny: served by both, on either vLLM build
    command = backend.command(cfg)
    assert command is None or (isinstance(command, str) and "\n" not in command)


def test_builtin_capabilities_are_the_ones_the_config_used_to_hard_code():
    local, vllm = engine_backend("local"), engine_backend("vllm")
    assert local.kv_policies == {"recompute", "keep"} and vllm.kv_policies == {"keep"}
    assert local.weight_kinds == {"filesystem"} and vllm.weight_kinds == {"filesystem", "nccl"}
    assert (local.required_module, vllm.required_module) == (None, "vllm")
    assert (local.needs_gpu, local.colocated, local.core_split) == (False, False, True)
    assert (vllm.needs_gpu, vllm.colocated, vllm.core_split) == (True, True, False)
    assert local.command(InferenceConfig()) is None
    assert "vllm.entrypoints.openai.api_server" in vllm.command(InferenceConfig(backend="vllm"))


def test_loading_the_builtins_imports_neither_torch_nor_vllm():
    code = (
        "import sys; from arbor.config.inference import engine_backend; from arbor.registry import BACKENDS; "
        "[engine_backend(n) for n in BACKENDS.names()]; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; assert not heavy, heavy"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_vllm_cpu_build_refuses_router_replay_before_anything_starts(monkeypatch):
    """vLLM's CPU build dies at start-up when asked for routed experts: preflight says so in one line."""
    from arbor.inference.vllm import backend as vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_build", lambda: "cpu")
    argv = ["--backend", "vllm", "--model.name", "qwen3-moe-tiny", "--router-replay", "true"]
    cfg = load_config(InferenceConfig, argv)
    error = engine_backend("vllm").preflight(cfg, "inference")
    assert error is not None and "\n" not in error
    assert error.startswith("inference.router_replay = true (model.router_replay sets it): vLLM's CPU build cannot")
    monkeypatch.setattr(vllm_backend, "vllm_build", lambda: "gpu")
    assert engine_backend("vllm").preflight(cfg, "inference") is None
