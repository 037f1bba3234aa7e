"""`fleet` config: N inference servers and the router for one base model, shared by any number of runs
(`rl --fleet URL`); and the keys of `rl` that put a run on such a fleet live in `RLConfig` (`fleet`,
`fleet_weight`, `fleet_token`, `run_name`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from arbor.config.admin import AdminToken
from arbor.config.base import Config, FilePath, Seconds, Seed, Tokens
from arbor.config.cost import CostConfig
from arbor.config.inference import InferenceConfig
from arbor.config.model import ModelConfig

SHARED = ("model", "output_dir", "seq_len", "seed")


class FleetConfig(Config):
    """Starts `inference.replicas` servers and the router in front of them, and stays up until stopped."""

    model: ModelConfig = ModelConfig()
    """The base model every run's adapter applies to."""
    output_dir: FilePath = Path("outputs/fleet")
    """The fleet's directory: configs/, logs/, `url` (the router's address once it is up), `usage.jsonl` (the
    router's fleet-wide and per-run figures every `metrics_interval`) and `timings.jsonl`."""
    seq_len: Tokens = Field(512, ge=8)
    """Longest sequence (prompt + completion) a request may reach."""
    seed: Seed = 0
    """Default sampling seed of the servers."""
    admin_token: AdminToken | None = Field(None, exclude=True)
    """The fleet's own admin token: registering runs, base-weight updates, fleet-wide pause and aborts need it
    (each run gets a token of its own for its adapter). Required when the router or a server binds beyond
    loopback (`fleet` then generates one and writes it to `<output_dir>/admin_token`, mode 0600). Secret:
    never written into the configs; `ARBOR_ADMIN_TOKEN` sets it."""
    metrics_interval: Seconds = Field(5.0, gt=0)
    """Seconds between two rows of `usage.jsonl`."""
    startup_timeout: Seconds = Field(300.0, gt=0)
    """Seconds to wait for each server and the router to answer /health."""
    inference: InferenceConfig = InferenceConfig()
    """The servers (`replicas`, `max_batch_size`, `backend`, `max_loras`, `max_lora_rank`, `weight_roots`: the
    runs' output directories, where their adapters are published; `vllm.enable_lora` defaults to on) and, in
    `inference.router`, the router (host, port, policy, `backend_slots`: default `max_batch_size`, or vLLM's
    `max_num_seqs`)."""
    cost: CostConfig = CostConfig()
    """GPU-hour price and the fleet's GPUs (`inference_gpus`, default one per replica), for `arbor-report`."""

    @model_validator(mode="before")
    @classmethod
    def _push_down_shared(cls, data: Any) -> Any:
        """Copies the shared fields into `inference`, where a repeated one must agree."""
        if not isinstance(data, dict) or isinstance(data.get("inference"), Config):  # a re-validation on assignment
            return data
        data = dict(data)
        inf = dict(data.get("inference") or {})
        for key in SHARED:
            if key not in data:
                continue
            if key in inf and inf[key] != data[key]:
                raise ValueError(f"inference.{key} differs from {key}: set shared fields once, at the top level")
            inf[key] = data[key]
        data["inference"] = inf
        return data

    @model_validator(mode="after")
    def _slots(self) -> "FleetConfig":
        if self.inference.weights.kind == "nccl":
            raise ValueError(
                "inference.weights.kind = 'nccl' cannot serve a shared fleet: runs publish adapters as "
                "files (weights.kind = 'filesystem')"
            )
        router = self.inference.router
        if router.implementation == "vllm-router":
            raise ValueError(
                "inference.router.implementation = 'vllm-router' cannot serve a shared fleet (it has no "
                "run registration nor per-run sharing): use 'builtin'"
            )
        router.implementation = "builtin"
        if self.inference.vllm.enable_lora is None:  # the base model has no [model.lora]; the runs' adapters do
            self.inference.vllm.enable_lora = True
        if router.backend_slots is None:
            router.backend_slots = self.inference.engine_backend().batch_slots(self.inference)
        return self
