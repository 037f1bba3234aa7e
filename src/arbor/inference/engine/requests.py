"""The local engine's request records: what callers get back (`Completion`, `RequestOutput`, `EngineStats`) and
what the engine thread tracks per request and per running sample (`Request`, `Seq`).

Futures are resolved or failed through `resolve` / `fail`, which tolerate a caller cancelling in between.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import numpy as np
import torch

from arbor.inference.engine.params import PromptLogprobs, SamplingParams


@dataclasses.dataclass
class Completion:
    """One sampled continuation of a prompt; every per-token list has `len(token_ids)` entries."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    """Per token, the `top_logprobs` most likely (token id, logprob) pairs, most likely first (empty when 0)."""
    policy_versions: list[int]
    finish_reason: str
    """"stop" (eos or a stop string), "length" (max_tokens reached) or "abort" (`Engine.abort`: the lists hold
    what was generated until then, possibly nothing)."""
    stop_reason: str | None
    """The stop string that ended the sequence, if one did."""
    text: str
    """Decoded completion, cut before the stop string that ended it."""
    routed_experts: "np.ndarray | None" = None
    """MoE models: experts chosen for every prompt and completion token in every MoE layer,
    `[prompt + completion tokens, moe_layers, top_k]` (uint8, int16 past 256 experts). The final token is never
    fed to the model, so its row repeats the previous one (its output predicts nothing that is trained)."""


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    completions: list[Completion]
    prompt_logprobs: PromptLogprobs | None = None
    """Set when the request asked for `prompt_logprobs` (arbor.inference.engine.params.SamplingParams)."""


@dataclasses.dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    decode_steps: int = 0
    policy_version: int = 0
    max_decode_batch: int = 0
    paused: bool = False
    sleeping: int = 0
    """Sleep level (arbor.inference.engine.sleep): 0 awake, 1 cache released, 2 weights released too."""
    decode_tokens: int = 0
    """Tokens appended by decode steps (the prefill's first token of each sample excluded)."""
    decode_seq_steps: int = 0
    """Sequences decoded, summed over decode steps: decode_tokens / decode_seq_steps is the mean number of
    tokens a sequence gains per step (1 without speculative decoding)."""
    decode_seconds: float = 0.0
    """Wall-clock seconds spent in decode steps (decode_tokens / decode_seconds: decode tokens/s)."""
    draft_tokens: int = 0
    """Speculative decoding: drafts verified."""
    accepted_draft_tokens: int = 0
    """Speculative decoding: drafts accepted (accepted / draft tokens: the acceptance rate)."""


class Request:
    """One submitted prompt with its `params.n` samples (`seqs`, set when it is admitted) and its caller's future."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        request_id: str | None = None,
        adapter: str | None = None,
        images: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.prompt = prompt
        self.images = images
        """A vision-language prompt's image inputs (`pixel_values`, `image_grid_thw`); None for text."""
        self.rope_delta = 0
        """Rotary position minus cache position after the prompt (3-D multimodal positions; set at prefill)."""
        self.params = params
        self.seed = seed
        self.request_id = request_id
        self.adapter = adapter
        """Name of the LoRA adapter it is generated with (None: the base model)."""
        self.lora_slot = 0
        """The adapter's slot in the engine (arbor.inference.engine.adapters), set when the request is admitted."""
        self.future: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
        self.seqs: list[Seq] = []
        self.prompt_logprobs: PromptLogprobs | None = None  # written by the prefill when params ask for them

    @property
    def abandoned(self) -> bool:
        return self.future.done()  # cancelled by the caller, or already failed

    def output(self) -> RequestOutput:
        return RequestOutput(self.prompt, [s.completion() for s in self.seqs], self.prompt_logprobs)

    def aborted_output(self) -> RequestOutput:
        """The output of a request aborted before it was admitted: every sample empty."""
        return RequestOutput(
            self.prompt, [Completion(i, [], [], [], [], "abort", None, "") for i in range(self.params.n)]
        )


class Seq:
    """One running sample: its slot, generated tokens so far and their logprobs and versions."""

    def __init__(self, req: Request, index: int, slot: int, device: torch.device) -> None:
        self.req, self.index, self.slot = req, index, slot
        self.holds_slot = True
        p = req.params
        self.generator: torch.Generator | None = (
            torch.Generator(device=device).manual_seed(req.seed + index) if p.temperature > 0 else None
        )
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.text = ""
        self.routes: np.ndarray | None = None  # [seq_len, moe_layers, top_k] for MoE models, by position
        # speculative decoding: (first position, decoder hidden states [n, H]) awaiting their MTP cache entries
        self.spec_pending: tuple[int, torch.Tensor] | None = None

    @property
    def position(self) -> int:
        """Cache position of the newest token (written by the next decode step)."""
        return len(self.req.prompt) + len(self.tokens) - 1

    def completion(self) -> Completion:
        routes = None
        if self.routes is not None and self.tokens:
            n = len(self.req.prompt) + len(self.tokens)
            routes = self.routes[:n].copy()
            routes[n - 1] = routes[n - 2]
        return Completion(
            self.index,
            self.tokens,
            self.logprobs,
            self.top,
            self.versions,
            self.finish_reason or "length",
            self.stop_reason,
            self.text,
            routes,
        )


def by_request(seqs: list[Seq]) -> dict[int, list[Seq]]:
    """Groups sequences by their request (keyed by `id(request)`), in first-seen order."""
    groups: dict[int, list[Seq]] = {}
    for s in seqs:
        groups.setdefault(id(s.req), []).append(s)
    return groups


def resolve(fut: concurrent.futures.Future, value: Any) -> None:
    if not fut.done():
        try:
            fut.set_result(value)
        except concurrent.futures.InvalidStateError:  # cancelled by the caller in between
            pass


def fail(fut: concurrent.futures.Future, err: BaseException) -> None:
    if not fut.done():
        try:
            fut.set_exception(err)
        except concurrent.futures.InvalidStateError:
            pass
