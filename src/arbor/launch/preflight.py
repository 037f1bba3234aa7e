"""Preflight checks `rl` runs after validating the config and before starting any process.

Each check answers in one line naming what to fix, so that a run that cannot work fails in a second instead of
hours in: output directory writable with room for the retained checkpoints and weight broadcasts, the inference
port free (when set explicitly), model and tokenizer files present (a Hugging Face hub id is fetched into the
cache once, here; a quantised checkpoint served by vLLM with room under $TMPDIR for its dequantised copy), the
GPUs a config asks for present, requested backends importable (an inference server's backend,
arbor.config.inference.InferenceBackend, says which module it needs and adds its own checks; DeepEP), the SFT
dataset readable, the environment importable with arguments its built-in takes and the black-box agent it names
present, any loss or advantage function given by dotted path importable, and, last, the orchestrator's tokenizer
and environment built as the orchestrator builds them, with the chat template a chat prompt needs
(`prompt_format`) and at least one task of the dataset short enough to leave room for a completion (else the
orchestrator could only skip tasks). `rl` runs these before starting anything, and `rl --check` runs them alone.
A config with a `[slurm]` table is checked where it is submitted (a laptop, a login node): what only the job's
nodes have (GPUs, GPU backends, a hub model not cached here) is reported as skipped, not failed.
Nothing here imports torch or the backends themselves: GPUs are counted with `nvidia-smi -L` (or
/proc/driver/nvidia), modules are found with `importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from arbor.config.env_args import check_env_args
from arbor.config.environment import EnvironmentConfig
from arbor.config.inference import InferenceConfig
from arbor.config.loader import ConfigError
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.environments.protocol import check_some_task_fits, is_multi_turn, load_environment
from arbor.inference.vllm.launch import materialized_path, serves_as_published, vllm_build
from arbor.models import build_tokenizer
from arbor.models.args import DSAArgs, ModelArgs
from arbor.models.family import UnsupportedArchitecture, architecture_of, choose_family, read_config
from arbor.models.hub import HubError, cached_config, is_hub_id, resolve_dir
from arbor.models.presets import PRESETS
from arbor.models.quantization import block_fp8_bytes, is_quantized, is_served_block_fp8, quantization_note
from arbor.models.tokenizer import Tokenizer, tokenizer_has_template
from arbor.registry import ENVIRONMENTS
from arbor.run_dir import format_bytes

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Config values that name a trainer backend -> the module it needs (a key named `backend` or ending in `_backend`);
# an inference server's `backend` is its backend object's to say (arbor.config.inference.InferenceBackend).
BACKEND_MODULES = {"deepep": "deep_ep", "deep_ep": "deep_ep"}
BACKEND_NEEDS_GPU = {"nccl", "deepep", "deep_ep"}


class PreflightError(ConfigError):
    """A preflight check failed; the message is one line."""


def run_checks(cfg: RLConfig) -> list[str]:
    """Runs every check; raises PreflightError (or NoTaskFits, also a ConfigError) with the first failure.
    Returns the checks skipped, one line each: with a `[slurm]` table the processes run on the allocated nodes,
    so checks of what only those nodes have (GPUs and GPU backends when this machine has no GPU, a hub model
    not in this machine's cache: its files, the prompt lengths its tokenizer measures, the disk its checkpoints
    take) are reported instead of failing on a laptop or login node."""
    skipped: list[str] = []
    cluster = cfg.slurm is not None
    model_here = not (cluster and is_hub_id(cfg.model.name) and cached_config(cfg.model.name) is None)
    if model_here:
        check_model_files(cfg.model)
        check_lora_head(cfg)
        if not cluster:  # a job's nodes have their own $TMPDIR
            check_served_copies(cfg)
    else:
        skipped.append(
            f"model files, tokenizer, prompt lengths, checkpoint disk space: {cfg.model.name} is not in "
            "this machine's Hugging Face cache (the job's nodes fetch it; nothing is downloaded here)"
        )
    if cfg.teacher is not None:  # `[teacher]` is local only (RLConfig): its files must be here
        try:
            check_model_files(cfg.teacher.model)
        except PreflightError as e:
            raise PreflightError(f"teacher.{e}") from None
    check_environments(cfg)
    check_plugins(cfg)
    check_dataset(cfg)
    check_extras(cfg)
    if cluster and count_gpus() == 0:
        gpu_backends = sorted(
            {v for _, v in _backend_values(cfg) if v in BACKEND_NEEDS_GPU}
            | {s.backend for _, s in _servers(cfg) if s.engine_backend().needs_gpu}
        )
        skipped.append(
            f"GPU checks (GPUs per node; GPU backends installed: {', '.join(gpu_backends) or 'none'}): no GPU on "
            f"this machine; the job's {cfg.slurm.nodes} node(s) have them (`srun rl --check ...` there checks them)"
        )
    else:
        check_backends(cfg, model_here)
        check_gpus(cfg)
    if not cluster:  # a job's ports are bound on its nodes
        check_port(cfg)
    check_output_dir(cfg, disk=model_here)
    if model_here:
        check_tasks_fit(cfg)
    return skipped


def estimate_run_bytes(cfg: RLConfig) -> int:
    """Disk the run keeps at its peak: trainer checkpoints (fp32 weights + two AdamW moments, one more while a new
    one is written), weight broadcasts in the model dtype, and the SFT warm-up's output."""
    n = model_params(cfg.model)
    ckpt = 12 * n * (cfg.trainer.ckpt.keep + 1)
    broadcasts = BYTES[cfg.model.dtype] * n * (cfg.trainer.keep_broadcasts + 1)
    sft = BYTES[cfg.model.dtype] * n if cfg.sft.steps else 0
    return ckpt + broadcasts + sft


def model_args(model: ModelConfig) -> ModelArgs | DSAArgs:
    """The preset's, or the checkpoint's config.json read as arbor reads it (by the family serving its
    architecture: one that none serves fails in one line)."""
    if model.name in PRESETS:
        return PRESETS[model.name]
    try:
        return ModelArgs.from_dir(resolve_dir(model.name), model.impl)
    except UnsupportedArchitecture as e:
        raise PreflightError(str(e)) from None


def model_path_line(model: ModelConfig) -> str | None:
    """The one line saying which implementation builds the checkpoint and why (arbor.models.family.choose_family);
    None for a preset (always native) and for a hub model not in this machine's cache (a `[slurm]` job's nodes
    fetch it, and preflight's model-files check has reported it)."""
    if model.name in PRESETS:
        return None
    try:
        path = resolve_dir(model.name)
    except HubError:
        return None
    try:
        config = read_config(path)
        why = choose_family(architecture_of(config), model.impl, str(path), config)[1]
        return f"model: {why}{quantization_note(config, model.dtype)}"
    except UnsupportedArchitecture as e:
        raise PreflightError(str(e)) from None


def model_params(model: ModelConfig) -> int:
    return model_args(model).num_params()


def check_output_dir(cfg: RLConfig, disk: bool = True) -> None:
    """Writable, and (with `disk`) room for what the run keeps (`estimate_run_bytes`)."""
    out = cfg.output_dir
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".preflight"):
            pass
    except OSError as e:
        raise PreflightError(f"output_dir {out} is not writable: {e.strerror or e}") from None
    if not disk:
        return
    need = estimate_run_bytes(cfg)
    free = shutil.disk_usage(out).free
    if free < need:
        raise PreflightError(
            f"output_dir {out} has {format_bytes(free)} free but the run keeps up to {format_bytes(need)} "
            f"(trainer.ckpt.keep = "
            f"{cfg.trainer.ckpt.keep} checkpoints, trainer.keep_broadcasts = {cfg.trainer.keep_broadcasts}): "
            f"free space or lower them"
        )


def check_port(cfg: RLConfig) -> None:
    inf = cfg.inference
    if "port" not in inf.model_fields_set or inf.port == 0:
        return  # `rl` picks a free one
    with socket.socket() as s:
        try:
            s.bind((inf.host, inf.port))
        except OSError as e:
            raise PreflightError(
                f"inference.port {inf.port} on {inf.host} is not free ({e.strerror}): choose another or leave it unset"
            ) from None


def check_model_files(model: ModelConfig) -> None:
    """Model and tokenizer present: a preset, a checkpoint directory, or a hub id (fetched into the Hugging Face
    cache here, once, so that no process downloads it)."""
    if model.tokenizer not in (None, "byte"):
        tokenizer = _resolve(model.tokenizer, "model.tokenizer")
        if not tokenizer.is_dir():
            raise PreflightError(
                f"model.tokenizer {model.tokenizer} is not a directory (a Hugging Face tokenizer "
                'directory or hub id, or "byte" for the built-in byte tokenizer)'
            )
    if model.name in PRESETS:
        return
    path = _resolve(model.name, "model.name")
    if not path.is_dir():
        raise PreflightError(
            f"model.name {model.name!r} is neither a preset ({', '.join(PRESETS)}), a directory "
            "nor a Hugging Face hub id (org/name)"
        )
    if not (path / "config.json").is_file():
        raise PreflightError(
            f"model.name {model.name}: config.json is missing (expected a Hugging Face checkpoint directory)"
        )
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f" ({pickled[0]} is a pickled PyTorch checkpoint, which arbor does not load: re-save it with transformers' "
            "`from_pretrained(dir).save_pretrained(new_dir)`, which writes safetensors)"
            if pickled
            else ""
        )
        raise PreflightError(f"model.name {model.name}: no *.safetensors weight files{hint}")
    model_args(model)  # an architecture arbor builds


def check_served_copies(cfg: RLConfig) -> None:
    """Room under $TMPDIR for the copies vLLM is started from (arbor.models.checkpoint_copies), for the policy's
    servers and a launched teacher: a quantised checkpoint's dequantised copy (gpt-oss-120b's is ~230 GB in bf16)
    and with `model.fp8 = "block"` a checkpoint's block-FP8 copy (Qwen3-235B's ~460 GB: its experts stay bf16),
    unless one is written already or none is needed (served as published, already block FP8)."""
    for section, inf in _servers(cfg):
        copy = _served_copy(inf)
        if copy is None or (copy[0] / "config.json").exists():
            continue
        out, need, what = copy
        root = next(p for p in out.parents if p.exists())  # a hub id's copy sits under arbor-vllm/<org>/
        free = shutil.disk_usage(root).free
        if free < need:
            key = "model.name" if section == "inference" else f"{section}.model.name"
            raise PreflightError(
                f"{key} {inf.model.name} is served by vLLM as {what} ({format_bytes(need)}) written under "
                f"{root}, which has {format_bytes(free)} free: set TMPDIR to a disk with room"
            )


def _served_copy(inf: InferenceConfig) -> tuple[Path, int, str] | None:
    """(directory, about its size, what it is) of the copy a vLLM server of `inf` writes; None when it needs none."""
    if inf.backend != "vllm" or inf.model.name in PRESETS:
        return None
    config, args, width = read_config(resolve_dir(inf.model.name)), model_args(inf.model), BYTES[inf.model.dtype]
    if inf.model.fp8 == "block":
        if is_served_block_fp8(config, args):
            return None
        what = 'its block-FP8 copy (model.fp8 = "block")'
        return materialized_path(inf, fp8=True), block_fp8_bytes(args, width), what
    if serves_as_published(inf, vllm_build()) or not is_quantized(config):
        return None
    what = f"a dequantised copy (it is quantised; {inf.model.dtype})"
    return materialized_path(inf, fp8=False, dequantized=True), width * args.num_params(), what


def check_lora_head(cfg: RLConfig) -> None:
    """The SFT warm-up with `sft.adapter` merges its adapter into the base RL starts from, which an adapter on a
    head tied to the embeddings cannot be (arbor.models.lora.check_mergeable, read here from the model's args)."""
    lora = cfg.model.lora
    if lora is None or "lm_head" not in lora.target_modules or not (cfg.sft.steps and cfg.sft.adapter):
        return
    if model_args(cfg.model).tie_word_embeddings:
        raise PreflightError(
            f"model.lora.target_modules has lm_head, whose weight {cfg.model.name} ties to its "
            "embeddings, and sft.adapter = true merges the warm-up's adapter into the base, which "
            "such an adapter cannot be: set sft.adapter = false or leave lm_head out"
        )


def _resolve(name: str, key: str) -> Path:
    try:
        return resolve_dir(name, key)
    except HubError as e:
        raise PreflightError(str(e)) from None


def check_environments(cfg: RLConfig) -> None:
    """The orchestrator's environment and, when periodic evaluation is on, each eval environment: importable,
    given only arguments its built-in takes, and the black-box agent it names present."""
    envs = [("orchestrator.environment", cfg.orchestrator.environment)]
    if cfg.orchestrator.eval.interval:
        envs += [(f"orchestrator.eval.environments.{i}", e) for i, e in enumerate(cfg.orchestrator.eval.environments)]
    for where, env in envs:
        check_environment(env.id, where)
        try:
            check_env_args(env.id, env.args, strict=True)
        except ValueError as e:
            raise PreflightError(f"{where}.args: {e}") from None
        if env.id == "black_box":
            check_agent(env, where)


def check_environment(env_id: str, where: str = "orchestrator.environment") -> None:
    """A registered environment (arbor.registry.ENVIRONMENTS) or a dotted path, whose module is importable."""
    path = ENVIRONMENTS.members[env_id].path if env_id in ENVIRONMENTS.members else env_id
    module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
    if not module:
        raise PreflightError(
            f"{where}.id {env_id!r} is neither a built-in ({', '.join(ENVIRONMENTS.names())}) nor a dotted path "
            f"'package.module:factory'"
        )
    if not _importable(module):
        raise PreflightError(
            f"{where}.id {env_id!r}: module {module!r} is not importable (not installed, or not on PYTHONPATH)"
        )
    if env_id == "verifiers" and not _importable("verifiers"):
        raise PreflightError(f"{where}.id 'verifiers': the adapter needs the optional extra: uv sync --extra verifiers")


def check_agent(env: EnvironmentConfig, where: str) -> None:
    """A black-box agent's `function` file or module, or its `command`'s program (and Python script), exist."""
    function, command = env.args.get("function"), env.args.get("command")
    if function:
        file, sep, _ = function.rpartition(":")
        if sep and file.endswith(".py"):
            if not Path(file).is_file():
                raise PreflightError(
                    f"{where}.args.function {function!r}: the agent file {file} does not exist "
                    f"(a relative path starts at {Path.cwd()})"
                )
        else:
            module = function.partition(":")[0] if ":" in function else function.rpartition(".")[0]
            if not module or not _importable(module):
                raise PreflightError(f"{where}.args.function {function!r}: module {module!r} is not importable")
    if command:
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        program = sys.executable if argv[0] == "python" else argv[0]  # as the environment runs it
        if shutil.which(program) is None:
            raise PreflightError(
                f"{where}.args.command: the program {argv[0]!r} is not found (not on PATH, or not executable)"
            )
        script = argv[1] if len(argv) > 1 and Path(program).name.startswith("python") else ""
        if script.endswith(".py") and not Path(script).is_file():
            raise PreflightError(
                f"{where}.args.command: the agent script {script} does not exist "
                f"(a relative path starts at {Path.cwd()})"
            )


def check_tasks_fit(cfg: RLConfig) -> None:
    """Builds the orchestrator's tokenizer and environment as the orchestrator will and fails, naming seq_len,
    max_tokens and the shortest prompt, unless some task's prompt leaves room for a completion."""
    orch = cfg.orchestrator
    try:
        tokenizer = build_tokenizer(orch.model)
    except Exception as e:  # whatever the tokenizer library raises: the user needs the key and the reason
        source = "model.tokenizer" if orch.model.tokenizer else "model.name"
        raise PreflightError(
            f"{source} {orch.model.tokenizer or orch.model.name}: the tokenizer cannot be loaded ({_one_line(e)})"
        ) from None
    try:
        env = load_environment(orch.environment)
        tasks = env.dataset(orch.seed)
    except Exception as e:  # a plugin environment can fail any way: the user needs the key and the reason
        raise PreflightError(
            f"orchestrator.environment {orch.environment.id!r} cannot be built ({_one_line(e)})"
        ) from None
    check_prompt_format(orch.environment, env, tokenizer, "orchestrator.environment")
    if orch.eval.interval:
        for i, eval_env in enumerate(orch.eval.environments):  # the template alone: these are built by the run
            check_prompt_format(eval_env, None, tokenizer, f"orchestrator.eval.environments.{i}")
    check_some_task_fits(env, tasks, tokenizer, orch.seq_len, orch.sampling.max_tokens, orch.environment.prompt_format)
    check_group_fits_engine(cfg, env)


def check_group_fits_engine(cfg: RLConfig, env: Any) -> None:
    """A single-turn group is one request for `group_size` samples, which arbor's local engine decodes together,
    one cache slot each: more than `inference.max_batch_size` could never run (vLLM queues them; a multi-turn
    episode asks for one sample a turn)."""
    group, slots = cfg.orchestrator.group_size, cfg.inference.max_batch_size
    if cfg.fleet is None and cfg.inference.backend == "local" and group > slots and not is_multi_turn(env):
        raise PreflightError(
            f"orchestrator.group_size ({group}) exceeds inference.max_batch_size ({slots}): the local engine "
            "decodes a group's samples together, one slot each; raise inference.max_batch_size or lower group_size"
        )


def check_prompt_format(cfg: EnvironmentConfig, env: Any, tokenizer: Tokenizer, where: str) -> None:
    """A chat prompt needs the tokenizer's chat template; a raw prompt, a single-turn environment."""
    if cfg.prompt_format == "chat" and not tokenizer_has_template(tokenizer):
        raise PreflightError(
            f"{where}.prompt_format = 'chat' but the tokenizer {getattr(tokenizer, 'name', '')} has no "
            f"chat template (a base model's): set {where}.prompt_format = 'raw' or use a tokenizer "
            "with a template"
        )
    if cfg.prompt_format == "raw" and is_multi_turn(env):
        raise PreflightError(
            f"{where}.prompt_format = 'raw' but environment {cfg.id!r} is multi-turn (its turns "
            "need a chat template): use 'chat'"
        )


def check_plugins(cfg: RLConfig) -> None:
    """A loss or advantage function given by dotted path must be importable (built-in names pass)."""
    plugins = [
        ("trainer.loss.name", cfg.trainer.loss.name),
        ("orchestrator.advantage.name", cfg.orchestrator.advantage.name),
    ]
    context = cfg.orchestrator.environment.context
    if context.strategy == "summarise":
        plugins.append(("orchestrator.environment.context.summariser", context.summariser))
    for field, value in plugins:
        if ":" not in value and "." not in value:
            continue  # a built-in name, checked by the process that uses it
        module = value.partition(":")[0] if ":" in value else value.rpartition(".")[0]
        if not _importable(module):
            raise PreflightError(
                f"{field} {value!r}: module {module!r} is not importable (not installed, or not on PYTHONPATH)"
            )


def check_extras(cfg: RLConfig) -> None:
    """Optional features need their extra installed."""
    if cfg.wandb is not None and not _importable("wandb"):
        raise PreflightError("[wandb] is set but wandb is not installed (the `wandb` extra: uv sync --extra wandb)")


def check_dataset(cfg: RLConfig) -> None:
    if not cfg.sft.steps or not cfg.sft.data:
        return
    path = Path(cfg.sft.data)
    if path.suffix == ".parquet":
        if not path.is_file():
            raise PreflightError(f"sft.data {path} does not exist")
        if not _importable("pyarrow"):
            raise PreflightError(
                f"sft.data {path}: parquet data needs pyarrow (the `parquet` extra: uv sync --extra parquet)"
            )
        return
    try:
        with open(path) as f:
            first = f.readline()
    except OSError as e:
        raise PreflightError(f"sft.data {path} is not readable: {e.strerror or e}") from None
    try:
        row = json.loads(first)
    except ValueError:
        raise PreflightError(f"sft.data {path}: the first line is not JSON (expected JSONL rows)") from None
    if not isinstance(row, dict) or not ({"prompt", "completion"} <= row.keys() or "messages" in row):
        raise PreflightError(f'sft.data {path}: rows need "prompt" and "completion", or "messages"')


def check_backends(cfg: RLConfig, model_here: bool = True) -> None:
    """Every backend's module installed; then each inference server's backend's own checks (the policy's only
    where its model is here; a launched teacher's always: `[teacher]` is local only)."""
    for where, value in _backend_values(cfg):
        module = BACKEND_MODULES.get(value)
        if module and not _importable(module):
            raise PreflightError(
                f"{where} = {value!r} but {module!r} is not installed "
                "(install arbor's `gpu` extra: uv sync --extra gpu)"
            )
    for where, served in _servers(cfg):
        backend = served.engine_backend()
        if backend.required_module and not _importable(backend.required_module):
            raise PreflightError(
                f"{where}.backend = {served.backend!r} but {backend.required_module!r} is not installed "
                f"({backend.install_hint})"
            )
    for where, served in _servers(cfg):
        if where == "inference" and not model_here:
            continue
        error = served.engine_backend().preflight(served, where)
        if error is not None:
            raise PreflightError(error)


def check_gpus(cfg: RLConfig) -> None:
    need = 0
    for where, value in _backend_values(cfg):
        if value in BACKEND_NEEDS_GPU:
            need = max(need, cfg.trainer.parallel.nproc if where.startswith("trainer.") else 1)
    for _, served in _servers(cfg):
        backend = served.engine_backend()
        if backend.needs_gpu and not backend.serves_on_cpu_here():
            need = max(need, 1)
    if not need:
        return
    have = count_gpus()
    if have < need:
        raise PreflightError(
            f"the config needs {need} CUDA GPU(s) (a backend asks for nccl/vllm/DeepEP) but {have} are visible "
            f"on {socket.gethostname()}"
        )


def count_gpus() -> int:
    """Visible NVIDIA GPUs, honouring CUDA_VISIBLE_DEVICES, without importing torch."""
    count = 0
    if shutil.which("nvidia-smi"):
        res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        count = sum(1 for line in res.stdout.splitlines() if line.startswith("GPU "))
    elif Path("/proc/driver/nvidia/gpus").is_dir():
        count = len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    return count


def _servers(cfg: RLConfig) -> list[tuple[str, InferenceConfig]]:
    """The inference servers `rl` starts, by section: the policy's and a launched teacher's."""
    return [("inference", cfg.inference)] + ([("teacher", cfg.teacher)] if cfg.teacher is not None else [])


def _backend_values(cfg: RLConfig) -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every string config value whose key is `backend` or ends in `_backend`, but an
    inference server's `backend` (`_servers`)."""

    def walk(prefix: str, d: Any) -> Iterator[tuple[str, str]]:
        if isinstance(d, dict):
            for k, v in d.items():
                key = f"{prefix}.{k}" if prefix else k
                if isinstance(v, str) and (k == "backend" or k.endswith("_backend")):
                    yield key, v.lower()
                else:
                    yield from walk(key, v)

    servers = {"inference": {"backend"}, "teacher": {"backend"}}
    yield from walk("", cfg.model_dump(mode="json", exclude={"slurm": True, **servers}))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package
        return False


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
