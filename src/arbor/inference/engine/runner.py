"""The local engine's model side: the model and its slot KV cache, the forwards that fill it (prefill, batched
decode, recomputation after a weight update; prefills and recomputations of several rows in left-padded
batches), MoE router-replay route recording, weight loading, and the LoRA adapter slots each forward's rows use
(arbor.inference.engine.adapters).

Only the engine thread calls it. Routes (MoE models) are recorded per sequence by cache position, so a prefix
computed in several forwards (prefill, decode steps, recomputation) ends up with one row per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from arbor.inference.engine.adapters import AdapterSlots
from arbor.inference.engine.params import PromptLogprobs
from arbor.inference.engine.requests import Request, Seq
from arbor.models.fp8 import dequantize_state
from arbor.models.hf import copy_state_into
from arbor.models.lora_peft import arbor_tensors
from arbor.models.qwen3 import lm_logits


def prompt_logprobs(prompt: list[int], logits: torch.Tensor, top: int, vocab: int | None = None) -> PromptLogprobs:
    """vLLM's prompt logprobs from the logits `[L, V]` of every prompt position: None for the first token, then
    each token's raw logprob `log_softmax(logits)` at temperature 1 and rank, with the `top` most likely
    alternatives. The softmax runs over the tokenizer's ids (the first `vocab` columns, None for all), the
    distribution the engine samples from and the trainer scores; vLLM's prompt logprobs span every row of the
    head instead (its logits processors do not apply to them)."""
    logp = torch.log_softmax(logits[:-1, :vocab], dim=-1)
    target = torch.tensor(prompt[1:], dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, target[:, None])
    ranks = ((logp > chosen).sum(-1) + 1).tolist()
    alt_lps, alt_ids = logp.topk(top, dim=-1) if top else (None, None)
    alt_lps = [[]] * len(ranks) if alt_lps is None else alt_lps.tolist()
    alt_ids = [[]] * len(ranks) if alt_ids is None else alt_ids.tolist()
    out: PromptLogprobs = [None]
    for t, lp, rank, ids, lps in zip(prompt[1:], chosen[:, 0].tolist(), ranks, alt_ids, alt_lps):
        entry = {a: (v, r + 1) for r, (a, v) in enumerate(zip(ids, lps))}
        entry[t] = (lp, rank)
        out.append(entry)
    return out


def row_chunks(lengths: list[int], budget: int, groups: list[int]) -> list[list[int]]:
    """The rows (by index) of each batched forward: sorted by group and length, each chunk one group's, with its
    rows x (longest length)^2 within `budget` (a lone row whatever its length)."""
    chunks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (groups[i], lengths[i])):
        last = chunks[-1] if chunks else None
        if last is None or groups[i] != groups[last[0]] or (len(last) + 1) * lengths[i] ** 2 > budget:
            chunks.append([i])
        else:
            last.append(i)
    return chunks


def left_padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions `[B, T]` of `rows` written at positions 0.. of their slots in one forward,
    left-padded so that every row's last token is the last column. A row of n tokens holds positions 0 .. n - 1
    in its last n columns; its padding takes positions n .. T - 1, which its real queries never attend to (the
    cache mask admits keys at or before a query's position) and whose cache entries each later write overwrites
    before any read reaches them (decode, verification and drafting write a position before attending to it)."""
    B, T = len(rows), max(map(len, rows))
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.empty(B, T, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row)
        ids[b, T - n :] = torch.tensor(row, dtype=torch.long)
        pos[b, T - n :] = torch.arange(n)
        pos[b, : T - n] = torch.arange(n, T)
    return ids.to(device), pos.to(device)


class ModelRunner:
    """Runs `model` over `max_batch_size` cache slots of `seq_len` positions; `weights` loads published
    directories (a `FilesystemTransport`: checksums verified, bounded by its timeout); up to `max_loras` LoRA
    adapters of rank up to `max_lora_rank` are served beside the base model. With `keep_hidden` (speculative
    decoding) each `forward` leaves the decoder's hidden states of its tokens in `last_hidden`. `vocab`: the
    tokenizer's id count, the ids prompt logprobs are normalised over (None: every row of the head)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        seq_len: int,
        max_batch_size: int,
        weights: Any,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        keep_hidden: bool = False,
        vocab: int | None = None,
    ) -> None:
        self.model = model
        self.vocab = vocab
        self.weights = weights
        self.adapters = AdapterSlots(model, max_loras, max_lora_rank)
        self.keep_hidden = keep_hidden
        self.last_hidden: torch.Tensor | None = None
        self.kv = model.make_kv_cache(max_batch_size, seq_len)
        # A recurrent model (the transformers path's TokenCache) runs its backbone once per row, where the adapter
        # layers' per-token slot map of the whole batch does not apply: its rows go one adapter per forward.
        self.adapters.uniform_rows = bool(getattr(model.args, "recurrent", False))
        self.device: torch.device = next(model.parameters()).device
        self.vision = hasattr(model, "mrope_positions")
        """A vision-language model (arbor.models.hf_vision): 3-D rotary positions, image prompts."""
        args = model.args
        self._route_shape: tuple[int, int, int] | None = (
            (seq_len, len(args.moe_layers), args.num_experts_per_tok) if getattr(args, "is_moe", False) else None
        )
        self._route_dtype = np.uint8 if getattr(args, "num_experts", 0) <= 256 else np.int16

    def prefill(self, seqs: list[Seq]) -> torch.Tensor:
        """Writes the prompt of the request `seqs` belong to into their slots (computed once, copied to the
        others); returns fp32 logits `[1, V]` of its last position."""
        req = seqs[0].req
        prompt = req.prompt
        if req.images:
            grid = req.images["image_grid_thw"]
            req.rope_delta = self.model.rope_delta(torch.tensor(prompt, device=self.device), grid.to(self.device))
        with self.adapters.rows([req.lora_slot], len(prompt)):
            if req.params.prompt_logprobs is None:
                logits = self.forward(prompt, 0, seqs[0].slot, images=req.images)
            else:  # every position's logits, scored against the next prompt token
                every = self.forward(prompt, 0, seqs[0].slot, keep=0, images=req.images)
                req.prompt_logprobs = prompt_logprobs(prompt, every, req.params.prompt_logprobs, self.vocab)
                logits = every[-1:]
        if self._route_shape is not None:
            self._routes_of(seqs[0])[: len(prompt)] = self._routes_of_last_forward()[0]
        self._share_prompt(seqs, len(prompt))
        return logits

    def decode(self, seqs: list[Seq]) -> torch.Tensor:
        """One `[B, 1]` forward of every sequence's newest token (rows of different adapters together, or one
        forward per adapter when a layer read as a weight is adapted); returns fp32 logits `[B, V]`."""
        lora = [s.req.lora_slot for s in seqs]
        if self.adapters.uniform_rows and len(set(lora)) > 1:
            groups: dict[int, list[int]] = {}
            for i, slot in enumerate(lora):
                groups.setdefault(slot, []).append(i)
            parts = {slot: self.decode([seqs[i] for i in idx]) for slot, idx in groups.items()}
            order = [i for idx in groups.values() for i in idx]
            stacked = torch.cat(list(parts.values()))
            return stacked[torch.tensor(order, device=stacked.device).argsort()]
        dev = self.device
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long, device=dev)
        pos = torch.tensor([[s.position] for s in seqs], dtype=torch.long, device=dev)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        extra = self._rope(pos, [s.req.rope_delta for s in seqs])
        with self.adapters.rows(lora, 1):
            logits = self.model(ids, pos, kv_cache=self.kv, cache_slots=slots, **extra)[:, -1].float()
        if self._route_shape is not None:
            routes = self._routes_of_last_forward()
            for b, s in enumerate(seqs):
                self._routes_of(s)[s.position] = routes[b, 0]
        return logits

    def prefill_many(self, requests: list[Request]) -> list[torch.Tensor]:
        """`prefill` of several requests (none asking for prompt logprobs) in batched forwards, one row per
        request; returns each one's fp32 logits `[1, V]`."""
        heads = [req.seqs[0] for req in requests]
        logits = dict(zip(map(id, heads), self._forward_rows(heads, [req.prompt for req in requests])))
        for req in requests:
            self._share_prompt(req.seqs, len(req.prompt))
        return [logits[id(req.seqs[0])][None] for req in requests]

    def _share_prompt(self, seqs: list[Seq], length: int) -> None:
        """Copies the first sample's prompt cache (and MoE routes) to the request's other samples."""
        if len(seqs) < 2:
            return
        self.kv.copy_slot(seqs[0].slot, [s.slot for s in seqs[1:]], length)
        if seqs[0].routes is not None:
            for s in seqs[1:]:
                self._routes_of(s)[:length] = seqs[0].routes[:length]

    def recompute(self, seqs: list[Seq]) -> None:
        """Rebuilds the caches of running sequences (of any requests) with the current weights: every position
        before each one's newest token, which the next decode step writes. Batched forwards rather than one per
        request and sample: after a weight update mid-generation (every step of an async run) the per-row
        forwards cost about 30 decode steps of a 64-sequence batch on one CPU thread, the batched ones 13.
        Prompt logprobs keep the values their prefill computed. A sequence with images is recomputed alone
        (its image encoder runs again, with the new weights)."""
        text = [s for s in seqs if not s.req.images]
        if text:
            self._forward_rows(text, [s.req.prompt + s.tokens[:-1] for s in text])
        for s in seqs:
            if s.req.images:
                with self.adapters.rows([s.req.lora_slot], len(s.req.prompt) + len(s.tokens) - 1):
                    self.forward(s.req.prompt + s.tokens[:-1], 0, s.slot, images=s.req.images)

    @property
    def rows_budget(self) -> int:
        """Rows x length^2 of one batched prefill or recomputation: its attention scores never outgrow one
        full-length prefill's (or 1024 positions'), whatever the number of rows."""
        return max(self.kv.max_len, 1024) ** 2

    def _forward_rows(self, seqs: list[Seq], rows: list[list[int]]) -> list[torch.Tensor]:
        """Writes `rows[i]` at positions 0.. of `seqs[i]`'s slot; returns each row's fp32 logits `[V]` of its last
        token. One adapter per forward when a layer read as a weight is adapted."""
        groups = [s.req.lora_slot if self.adapters.uniform_rows else 0 for s in seqs]
        logits: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        for chunk in row_chunks([len(r) for r in rows], self.rows_budget, groups):
            for i, row in zip(chunk, self._forward_chunk([seqs[i] for i in chunk], [rows[i] for i in chunk])):
                logits[i] = row
        return logits

    def _forward_chunk(self, seqs: list[Seq], rows: list[list[int]]) -> torch.Tensor:
        """One `[B, T]` forward of `rows` left-padded (`left_padded`); fp32 logits `[B, V]` of each last token."""
        ids, pos = left_padded(rows, self.device)
        T = ids.shape[1]
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)
        extra = self._rope(pos, [s.req.rope_delta for s in seqs])
        with self.adapters.rows([s.req.lora_slot for s in seqs], T):
            logits = self.model(ids, pos, kv_cache=self.kv, cache_slots=slots, logits_to_keep=1, **extra)
        if self._route_shape is not None:
            routes = self._routes_of_last_forward()
            for b, (s, row) in enumerate(zip(seqs, rows)):
                self._routes_of(s)[: len(row)] = routes[b, T - len(row) :]
        return logits[:, -1].float()

    def load_weights(self, path: Path) -> None:
        """Reads and checks every tensor before copying any, so a bad directory leaves the model untouched."""
        if not path.is_dir():
            raise FileNotFoundError(f"weights directory {path} does not exist")
        # verified against the publish manifest; FP8 weights (model.fp8 = "block") dequantised: the FP8 layers
        # requantise them to the same values; names mapped by the model's family (MoE experts fused); checked in
        # full before any copy
        copy_state_into(self.model, dequantize_state(self.weights.load(path)), path)

    def load_adapter(self, name: str, path: Path, version: int) -> int:
        """Loads the PEFT directory at `path` (checked by the weight transport: manifest checksums when it has
        one) as adapter `name`; returns its slot. On error nothing changes."""
        if not path.is_dir():
            raise FileNotFoundError(f"adapter directory {path} does not exist")
        return self.adapters.load(name, str(path), arbor_tensors(self.weights.load(path)), version)

    def _rope(self, pos: torch.Tensor, deltas: list[int]) -> dict[str, torch.Tensor]:
        """A vision-language model's rotary positions `[3, B, T]` for text tokens at cache positions `pos`:
        each row's position plus its prompt's delta (the same on all three axes); {} for other models."""
        if not self.vision:
            return {}
        delta = torch.tensor(deltas, dtype=pos.dtype, device=pos.device)[:, None]
        return {"rope_positions": (pos + delta)[None].expand(3, -1, -1)}

    def forward(
        self, ids: list[int], start: int, slot: int, keep: int = 1, images: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Writes `ids` at positions start.. of `slot`; returns fp32 logits `[keep, V]` of the last `keep`
        positions (0: of every position). `images` (a whole prompt from position 0) run the image encoder."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        if images:
            pixels = {k: v.to(self.device) for k, v in images.items()}
            logits = self.model(x, pos, kv_cache=self.kv, cache_slots=slots, logits_to_keep=keep, **pixels)
            return logits[0].float()
        if self.keep_hidden:
            hidden = self.model.hidden_states(x, pos, self.kv, slots)
            self.last_hidden = hidden[0]
            return lm_logits(self.model, hidden, keep)[0].float()
        return self.model(x, pos, kv_cache=self.kv, cache_slots=slots, logits_to_keep=keep)[0].float()

    def _routes_of(self, s: Seq) -> np.ndarray:
        """The sequence's route buffer, allocated on first use (MoE models only)."""
        assert self._route_shape is not None
        if s.routes is None:
            s.routes = np.zeros(self._route_shape, self._route_dtype)
        return s.routes

    def _routes_of_last_forward(self) -> np.ndarray:
        return self.model.last_routed_experts.to("cpu", torch.int16).numpy().astype(self._route_dtype)
