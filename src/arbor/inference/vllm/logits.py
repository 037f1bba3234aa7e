"""The logits processor vLLM loads by name (`--logits-processors arbor.inference.vllm.logits:PaddingRowsMask`)
when the served model's head has more rows than its tokenizer has ids (Qwen3: 151,936 rows, 151,669 ids; the
presets: 264 rows, 259 byte-tokenizer ids).

vLLM samples over every row of the head, so without it a padding row, which decodes to nothing and was never a
training target, can be drawn, or win a greedy argmax. The processor sets those rows' logits to -inf in every
request of every step, before penalties, temperature, top-p and the greedy argmax, so vLLM never returns one.
The bound (the tokenizer's id count) comes from `ARBOR_VLLM_VOCAB_SIZE`, which `arbor.inference.vllm.server`
sets in the server's environment (every vLLM process inherits it); the processor fails at start-up without it.

What the reported logprobs then are: with `--logprobs-mode processed_logprobs` vLLM reports logprobs of the
distribution it samples from, so after this mask they are the tempered distribution renormalised over the real
ids: the policy arbor's local engine (arbor.inference.engine.sampler) samples and reports and the trainer (its
`logprobs` module) scores, so the three agree (docs/models.md, "Padding rows"). vLLM's prompt logprobs
(a teacher's scores) are computed before any logits processor: they stay the raw model's, over every row.
This module imports vLLM: only vLLM's own processes import it.
"""

from __future__ import annotations

import os

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from arbor.inference.vllm.launch import PADDING_MASK, VOCAB_ENV


class PaddingRowsMask(LogitsProcessor):
    """Sets the logits of rows `>= ARBOR_VLLM_VOCAB_SIZE` to -inf for every request (greedy ones included)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        if VOCAB_ENV not in os.environ:
            raise ValueError(f"{PADDING_MASK} needs {VOCAB_ENV} (the tokenizer's id count) in the server's environment")
        self.vocab = int(os.environ[VOCAB_ENV])
        rows = vllm_config.model_config.get_vocab_size()
        if not 0 < self.vocab <= rows:
            raise ValueError(
                f"{VOCAB_ENV}={self.vocab}: the tokenizer's id count must be in 1..{rows} (the head's rows)"
            )

    def is_argmax_invariant(self) -> bool:
        return False  # a padding row may hold the largest logit: greedy requests are masked too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None  # the same mask for every request: no per-request state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[:, self.vocab :] = float("-inf")
        return logits
