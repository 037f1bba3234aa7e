"""The inference backend seam: what differs between the engines an `inference` server can run (`inference.backend`).

Everything outside a backend's own file asks it through `InferenceBackend`: the server process runs
`serve(cfg)` (the local engine in-process; vLLM behind arbor's proxy, as a subprocess); config validation reads
the weight transports and KV policies it supports; `rl --dry-run` prints its `command`; preflight checks its
`required_module`, its GPU need and its own `preflight` hook; the planner reads `colocated` and `memory_share`,
the launcher's core split `core_split`, `fleet` its `batch_slots`, a launched teacher its `max_logprobs`.

The built-ins (`local`, `vllm`) are listed in `arbor.registry.BACKENDS`; a user backend is one module with an
object implementing this Protocol, named by its dotted path. Backend modules stay torch- and vLLM-free at import
(config validation loads them): the engine itself loads inside `serve`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from arbor.registry import BACKENDS

if TYPE_CHECKING:
    from arbor.config.inference import InferenceConfig

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


def load_backend(name: str) -> InferenceBackend:
    """The backend `inference.backend` names: a registered one (arbor.registry.BACKENDS) or a user's by dotted
    path (an instance, or a class built with no arguments). A ValueError in one line otherwise, without the field
    (the config validator adds `inference.backend` or `teacher.backend`)."""
    try:
        BACKENDS.check(name)
        obj = BACKENDS.load(name)
    except ValueError as e:
        raise ValueError(str(e).removeprefix(f"{BACKENDS.field}: ")) from None
    backend = obj() if isinstance(obj, type) else obj
    if not isinstance(backend, InferenceBackend):
        missing = ", ".join(m for m in MEMBERS if not hasattr(backend, m))
        raise ValueError(
            f"{name!r} is not an inference backend (arbor.inference.backend.InferenceBackend): it lacks {missing}"
        )
    return backend


def backends_with(predicate: str, value: str) -> str:
    """The registered backends whose `predicate` capability set holds `value`, quoted and joined by " or " (for
    refusals: "weights.kind = 'nccl' needs inference.backend = 'vllm'")."""
    names = [n for n in BACKENDS.names() if value in getattr(load_backend(n), predicate)]
    return " or ".join(repr(n) for n in names) or "a backend that supports it"
