"""`rl --fleet URL`: a run on a shared fleet. Registers the run (its name, its weight) with the fleet's router,
which hands back the run's own admin token (passed to the orchestrator through its environment only); at the
end, whatever ended the run, records what the run used of the fleet in `<output_dir>/fleet_usage.jsonl` (its
tokens, slot-seconds and utilisation, and the fleet's over the same span: arbor-report's cost share) and
unregisters it, which unloads its adapter and leaves the fleet running for the other runs.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from pydantic import SecretStr

from arbor import run_dir
from arbor.config.admin import bearer_headers, token_value
from arbor.config.loader import ConfigError
from arbor.config.rl import RLConfig
from arbor.transport.router_wire import parse_router_metrics, parse_run_metrics


def run_name(cfg: RLConfig) -> str:
    """The run's name on the fleet, which its adapter carries: `run_name`, else `model.lora.name`, else the name
    of its output directory."""
    lora = cfg.model.lora
    return cfg.run_name or (lora.name if lora is not None else None) or cfg.output_dir.resolve().name


def call(url: str, path: str, body: dict[str, Any], token: SecretStr | str | None) -> dict[str, Any]:
    """POSTs to the fleet's router; a refusal or no answer is a one-line error naming the fleet."""
    req = urllib.request.Request(
        url.rstrip("/") + path,
        json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **bearer_headers(token)},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise ConfigError(f"fleet {url} refused {path} ({e.code}): {detail}") from None
    except OSError as e:
        raise ConfigError(f"fleet {url} did not answer {path}: {e}") from None


def figures(url: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The fleet's counters and each run's, from its router's /metrics."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError as e:
        raise ConfigError(f"fleet {url} did not answer /metrics: {e}") from None
    return parse_router_metrics(text), parse_run_metrics(text)


class Registration:
    """The run's place on the fleet, from `register` to `end`."""

    def __init__(self, cfg: RLConfig) -> None:
        assert cfg.fleet is not None
        self.cfg, self.url, self.name = cfg, cfg.fleet, run_name(cfg)
        self.token: str | None = None
        self.start: dict[str, float] = {}
        self.t0 = 0.0

    def register(self) -> str:
        """Registers the run; returns its own admin token."""
        self.start, _ = figures(self.url)
        self.t0 = time.time()
        answer = call(
            self.url, "/runs/register", {"run": self.name, "weight": self.cfg.fleet_weight}, self.cfg.fleet_token
        )
        self.token = answer["token"]
        return self.token

    def end(self) -> None:
        """Records the run's use of the fleet, then unregisters it (the fleet stays up)."""
        if self.token is None:
            return
        fleet, runs = figures(self.url)
        mine = runs.get(self.name, {})
        seconds = time.time() - self.t0
        slots = fleet.get("slots")
        spent = fleet.get("slot_seconds", 0.0) - self.start.get("slot_seconds", 0.0)
        row = {
            "time": time.time(),
            "fleet": self.url,
            "run": self.name,
            "seconds": round(seconds, 3),
            **{
                k: mine.get(k, 0.0)
                for k in (
                    "requests",
                    "prompt_tokens",
                    "completion_tokens",
                    "slot_seconds",
                    "tokens_per_s",
                    "utilisation",
                    "adapter_choices",
                    "base_choices",
                    "foreign_choices",
                )
            },
            "fleet_completion_tokens": fleet.get("completion_tokens", 0.0) - self.start.get("completion_tokens", 0.0),
            "fleet_slot_seconds": spent,
            "fleet_utilisation": spent / (slots * seconds) if slots and seconds > 0 else None,
        }
        with open(run_dir.fleet_usage_path(self.cfg.output_dir), "a") as f:
            f.write(json.dumps(row) + "\n")
        call(self.url, "/runs/unregister", {"run": self.name}, self.token)
        self.token = None


def resolve_on_fleet(cfg: RLConfig) -> RLConfig:
    """Points the orchestrator at the fleet, as the run's adapter; no inference process is started."""
    if cfg.sft.steps:
        raise ConfigError(
            "sft.steps must be 0 with --fleet: a warm-up changes the base model, which the fleet shares between runs"
        )
    client = cfg.orchestrator.client
    name = run_name(cfg)
    client.base_urls, client.admin_urls = [cfg.fleet], []
    assert cfg.model.lora is not None  # RLConfig requires it with a fleet
    for section in (cfg, cfg.trainer, cfg.orchestrator, cfg.inference, cfg.sft):
        section.model.lora.name = name  # the trainer publishes the adapter under the run's name
    if token_value(cfg.run_admin_token()) is not None:
        raise ConfigError("admin_token is the fleet's own with --fleet: set fleet_token (ARBOR_FLEET_TOKEN) instead")
    return cfg
