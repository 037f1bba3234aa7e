"""Inference: the local CPU engine (`arbor.inference.engine.core`) behind an OpenAI/vLLM-compatible HTTP server
(`arbor.inference.server`, the `inference` entry point).

Importing this package stays light (no torch) so the server can parse its config before loading anything heavy;
import `arbor.inference.engine.core` for the engine itself.
"""

from arbor.inference.engine.params import InvalidRequest, SamplingParams, WeightUpdateError

__all__ = ["InvalidRequest", "SamplingParams", "WeightUpdateError"]
