"""`inference` process config: an OpenAI-compatible server in front of one engine."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from arbor.config.base import Config
from arbor.config.model import ModelConfig


class InferenceConfig(Config):
    """Serves /v1/completions and /v1/chat/completions with token ids and logprobs, plus weight updates."""

    model: ModelConfig = ModelConfig()
    """The model to serve."""
    backend: Literal["local"] = "local"
    """Engine: "local" is arbor's CPU engine (continuous batching, KV cache)."""
    host: str = "127.0.0.1"
    """Address to bind. Keep loopback unless the network is trusted."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to bind; 0 picks a free one (written to the ready file). Under `rl`, unset means a free port."""
    seq_len: int = Field(512, ge=8)
    """Longest sequence (prompt + completion) a request may reach: the KV cache length per slot."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences decoded together (KV cache slots); later requests queue and join as slots free up."""
    seed: int = 0
    """Default sampling seed for requests that give none."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads for the engine; default: torch's choice."""
    output_dir: Path | None = None
    """Run directory for heartbeats and stack dumps (`rl` sets it); none: the server writes neither."""
    ready_file: str | None = None
    """When set, the server writes its base URL to this file once it accepts requests."""
