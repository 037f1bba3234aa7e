"""The `local` inference backend: arbor's own engine (arbor.inference.engine.core), served in the `inference`
process itself by arbor.inference.server.

It loads weight updates from files only, implements both KV policies after an update ("recompute" by default),
runs on CPU (its torch threads are the launcher's core split to size) and returns at most `MAX_TOP_LOGPROBS`
logprobs per token. Importing this module loads neither torch nor the HTTP server: config validation reads
the capabilities; `serve` loads the rest.
"""

from __future__ import annotations

import asyncio
import logging

from arbor.config.base import MAX_TOP_LOGPROBS
from arbor.config.inference import InferenceConfig, KVPolicy, WeightKind
from arbor.monitor.heartbeat import beat, install

log = logging.getLogger("arbor.inference")

LOCAL_MEMORY_SHARE = 0.9
"""Share of a GPU's memory the planner budgets for the local engine (it has no setting of its own)."""


class LocalBackend:
    """arbor's continuous-batching engine in the server's own process (arbor.config.inference.InferenceBackend)."""

    title = "the local engine"
    weight_kinds: frozenset[WeightKind] = frozenset({"filesystem"})
    kv_policies: frozenset[KVPolicy] = frozenset({"recompute", "keep"})
    required_module: str | None = None
    install_hint = ""
    needs_gpu = False
    colocated = False
    core_split = True

    def serves_on_cpu_here(self) -> bool:
        return True

    def memory_share(self, cfg: InferenceConfig) -> float:
        return LOCAL_MEMORY_SHARE

    def batch_slots(self, cfg: InferenceConfig) -> int:
        return cfg.max_batch_size

    def max_logprobs(self, cfg: InferenceConfig) -> int | None:
        return MAX_TOP_LOGPROBS

    def preflight(self, cfg: InferenceConfig, where: str) -> str | None:
        return None

    def command(self, cfg: InferenceConfig) -> str | None:
        return None

    def serve(self, cfg: InferenceConfig) -> int:
        # torch, the engine and the HTTP server load here, in the inference process only: config validation
        # imports this module for the capabilities above. Under `rl` the heartbeat says where the start-up is
        # (the console's "waiting for" line, benchmarks/startup_phases.py).
        if cfg.output_dir is not None:
            install(cfg.output_dir, "inference", "loading the engine")
        import torch

        from arbor.inference.engine.core import build_engine
        from arbor.inference.server import serve

        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        beat("building the engine")
        engine, tokenizer = build_engine(cfg)
        engine.start()
        try:
            return asyncio.run(serve(cfg, engine, tokenizer))
        except OSError as e:  # the port is taken or the address is wrong: one line, not a traceback
            log.error("%s", e)
            return 1
        finally:
            engine.stop()


LOCAL = LocalBackend()
"""The registered object (arbor.registry.BACKENDS["local"])."""
