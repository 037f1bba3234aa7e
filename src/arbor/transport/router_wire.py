"""What the launcher, the router and the orchestrator's client agree on about the router in front of the fleet.

The router's /metrics page carries fleet-wide counters as `arbor_router_<name> <value>` lines
(`parse_router_metrics` reads them back); and where the `vllm-router` console script is used instead of arbor's
built-in router, `use_vllm_router` finds it and `vllm_router_argv` renders its command line (its flags follow the
sglang-router lineage; least_outstanding maps to its load-aware `power_of_two`, the closest it offers). Shared
here so that neither the launcher nor the orchestrator imports the inference package for it.
"""

from __future__ import annotations

import shutil

from arbor.config.inference import RouterConfig
from arbor.config.loader import ConfigError

METRIC_PREFIX = "arbor_router_"
RUN_HEADER = "X-Arbor-Run"
"""The header naming the run a generation request belongs to on a shared fleet (else its `model` does)."""
VLLM_ROUTER_POLICY = {
    "round_robin": "round_robin",
    "least_outstanding": "power_of_two",
    "consistent_hash": "consistent_hash",
}


ENGINE_PREFIX = "arbor_"
"""The local engine's /metrics lines (arbor.inference.server): decode and speculative-decoding counters."""


def parse_router_metrics(text: str) -> dict[str, float]:
    """The fleet-wide `arbor_router_*` counters of a /metrics page (empty when it is not a router's)."""
    return parse_metrics(text, METRIC_PREFIX)


def parse_metrics(text: str, prefix: str) -> dict[str, float]:
    """The unlabelled `<prefix><name> <value>` lines of a Prometheus text page, by name without the prefix."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix) and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name[len(prefix) :]] = float(value)
            except ValueError:
                continue
    return out


def parse_run_metrics(text: str) -> dict[str, dict[str, float]]:
    """The per-run `arbor_router_run_<name>{run="..."} <value>` lines of a router's /metrics, by run ("" is
    the fleet's own requests)."""
    out: dict[str, dict[str, float]] = {}
    prefix = METRIC_PREFIX + "run_"
    for line in text.splitlines():
        if not line.startswith(prefix) or '{run="' not in line:
            continue
        head, _, value = line.rpartition(" ")
        name, _, label = head[len(prefix) :].partition('{run="')
        try:
            out.setdefault(label.removesuffix('"}'), {})[name] = float(value)
        except ValueError:
            continue
    return out


def vllm_router_argv(cfg: RouterConfig, backends: list[str], port: int, exe: str = "vllm-router") -> list[str]:
    """The `vllm-router` command line for these backends."""
    return [
        exe,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--worker-urls",
        *backends,
        "--policy",
        VLLM_ROUTER_POLICY[cfg.policy],
        "--health-check-interval-secs",
        str(max(1, round(cfg.health_interval))),
        "--health-check-timeout-secs",
        str(max(1, round(cfg.health_timeout))),
        "--health-failure-threshold",
        str(cfg.eject_after),
        "--retry-max-retries",
        str(cfg.max_retries),
        "--request-timeout-secs",
        str(max(1, round(cfg.request_timeout))),
    ]


def use_vllm_router(cfg: RouterConfig) -> str | None:
    """The vllm-router executable to use, or None for the built-in router."""
    if cfg.implementation == "builtin":
        return None
    exe = shutil.which("vllm-router")
    if exe is None and cfg.implementation == "vllm-router":
        raise ConfigError("inference.router.implementation = 'vllm-router' but no vllm-router is on PATH")
    return exe
