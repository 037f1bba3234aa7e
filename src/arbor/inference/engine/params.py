"""Sampling parameters of the local engine and their validation (no torch here: the server imports it early).

Logprob convention (shared with the trainer): the logprob reported for a generated token is taken from the
temperature-scaled distribution `log_softmax(logits / T)` over the tokenizer's ids (a head padded past the
tokenizer has its extra rows left out, arbor.inference.engine.sampler); at T = 0 (greedy) it is `log_softmax(logits)`
and top_p is ignored. With top_p < 1 the server's engine reports the distribution the token was drawn from, the
top-p nucleus renormalised (as vLLM's `processed_logprobs`), and the trainer scores the same truncated
distribution (the trainer's `logprobs` module), so importance ratios compare like with like; an `Engine` built without
`nucleus_logprobs` (the library default) reports the full distribution's logprob instead.
"""

from __future__ import annotations

import dataclasses
import math

from arbor.config.base import MAX_TOP_LOGPROBS  # noqa: F401 (one bound for requests and configs; re-exported)
from arbor.transport.fields import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE

PromptLogprobs = list[dict[int, tuple[float, int]] | None]
"""Per prompt token, None for the first (nothing predicts it), else {token id: (logprob, rank)} holding the
prompt token itself and the requested alternatives; rank 1 is the most likely token (vLLM's `Logprob`)."""


class WeightUpdateError(ValueError):
    """A weights directory could not be loaded; the engine kept its previous weights and version."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take work: it was stopped, or its loop died (then `/health` says so as well)."""


class EngineBusy(RuntimeError):
    """A sleep asked for while sequences run (a colocated run sleeps the engine between steps only): a 409."""


class InvalidRequest(ValueError):
    """A request the engine cannot serve as given; `param` names the offending field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one prompt is sampled. `seed=None` draws a seed from the engine's own seeded generator."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion besides the tokenizer's own (`Tokenizer.stop_token_ids`); kept in it."""
    seed: int | None = None
    top_logprobs: int = 0
    """Alternatives reported per generated token (the chosen token's logprob is always recorded)."""
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    """vLLM's `prompt_logprobs`: report each prompt token's logprob (after the first token) with this many
    alternatives; None reports none. These are the raw model's, `log_softmax(logits)` over the tokenizer's ids at
    temperature 1 whatever the request's temperature (as vLLM's default `logprobs_mode`, which however spans the
    head's padding rows too): a teacher's scores in on-policy distillation."""

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        t = self.temperature
        if not (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise InvalidRequest(
                f"temperature must be 0 or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t}", "temperature"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {self.n}", "n")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}", "prompt_logprobs"
            )
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", "stop")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequest(f"seed must be in [0, {MAX_SEED}], got {self.seed}", "seed")
