"""The local inference engine: continuous batching over a fixed pool of KV-cache slots, in a background thread.

One thread owns the model and the cache. Each turn of its loop it (1) applies control commands (weight updates,
pause, resume), (2) admits queued requests into free slots (one prefill per prompt; a request with `n > 1`
copies the prompt's slot to its other samples), and (3) decodes one token for every running sequence with a
single `[B, 1]` forward. Requests therefore join and leave the running batch between decode steps.

Callers get `concurrent.futures.Future`s; asyncio code awaits them with `asyncio.wrap_future`, which hands the
result to the event loop with `loop.call_soon_threadsafe`. Torch releases the GIL inside its ops, so an HTTP
loop in the main thread stays responsive while the engine computes.

Policy versions: every generated token is tagged with the version of the weights it was sampled from. A weight
update is applied between decode steps; the KV cache of every running sequence is then recomputed with the new
weights, so a token tagged with version v is exactly a sample of policy v given its prefix (its logprob is what
the trainer computes with version v's weights). Logprobs follow the convention in `arbor.inference.sampling`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import random
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from arbor.inference.sampling import InvalidRequest, SamplingParams, WeightUpdateError
from arbor.models import build_model, build_tokenizer
from arbor.models.fp8 import apply_fp8, dequantize_state
from arbor.models.hf import copy_state_into, fuse_experts
from arbor.transport.weights import FilesystemTransport

log = logging.getLogger("arbor.inference.engine")


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


class _Request:
    def __init__(self, prompt: list[int], params: SamplingParams, seed: int, request_id: str | None = None) -> None:
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.request_id = request_id
        self.future: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
        self.seqs: list[_Seq] = []

    @property
    def abandoned(self) -> bool:
        return self.future.done()  # cancelled by the caller, or already failed


class _Seq:
    """One running sample: its slot, generated tokens so far and their logprobs and versions."""

    def __init__(self, req: _Request, index: int, slot: int, device: torch.device) -> None:
        self.req, self.index, self.slot = req, index, slot
        self.holds_slot = True
        p = req.params
        self.generator = (torch.Generator(device=device).manual_seed(req.seed + index)
                          if p.temperature > 0 else None)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.text = ""
        self.routes: np.ndarray | None = None  # [seq_len, moe_layers, top_k] for MoE models, by position

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
        return Completion(self.index, self.tokens, self.logprobs, self.top, self.versions,
                          self.finish_reason or "length", self.stop_reason, self.text, routes)


@dataclasses.dataclass
class _Command:
    kind: str
    args: tuple[Any, ...]
    future: concurrent.futures.Future


class Engine:
    """Continuous-batching generation over `max_batch_size` cache slots of `seq_len` positions each.

    `submit(prompt_ids, params)` -> Future[RequestOutput]; `update_weights(path, version)` -> Future[int];
    `pause()` / `resume()` -> Future[bool] (resolved once the engine thread has applied them);
    `abort(request_ids)` -> Future[int]; `stats()`.
    Call `start()` once and `stop()` at the end (also usable as a context manager).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        seq_len: int,
        max_batch_size: int,
        seed: int = 0,
        version: int = 0,
        weights: Any = None,
    ) -> None:
        # Loads published directories: checksums verified, bounded by the transport's timeout.
        self.weights = weights if weights is not None else FilesystemTransport()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.max_batch_size = max_batch_size
        self.vocab_size: int = model.args.vocab_size
        self.eos_token_id: int = tokenizer.eos_token_id
        self.kv = model.make_kv_cache(max_batch_size, seq_len)
        args = model.args
        self._route_shape = ((seq_len, len(args.moe_layers), args.num_experts_per_tok)
                             if getattr(args, "is_moe", False) else None)
        self._route_dtype = np.uint8 if getattr(args, "num_experts", 0) <= 256 else np.int16
        self._device = next(model.parameters()).device
        self._free = list(range(max_batch_size - 1, -1, -1))  # pop() hands out low slots first
        self._waiting: collections.deque[_Request] = collections.deque()
        self._commands: collections.deque[_Command] = collections.deque()
        self._running: list[_Seq] = []
        self._cv = threading.Condition()
        self._seeds = random.Random(seed)  # seeds for requests that bring none: reproducible per server run
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats = EngineStats(policy_version=version)
        # Ids aborted recently: a request that reaches the engine after its abort (it was still in transit)
        # finishes at once instead of running to the end. Bounded: only the newest ABORT_MEMORY are kept.
        self._aborted_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._thread = threading.Thread(target=self._run, name="arbor-engine", daemon=True)

    # ---- caller side (any thread) ----

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stops the engine thread; unfinished requests fail with "engine stopped"."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: fail what was queued here
            self._shutdown()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def version(self) -> int:
        return self._stats.policy_version

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidRequest if the request can never be served (bad ids, too long, too many samples)."""
        params.validate()
        if not prompt_ids:
            raise InvalidRequest("prompt must contain at least one token", "prompt")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad!r} is not in the vocabulary [0, {self.vocab_size})", "prompt")
        if len(prompt_ids) >= self.seq_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; the engine's seq_len is {self.seq_len}", "prompt")
        if len(prompt_ids) + params.max_tokens > self.seq_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds seq_len "
                f"{self.seq_len}", "max_tokens")
        if params.n > self.max_batch_size:
            raise InvalidRequest(f"n={params.n} exceeds max_batch_size {self.max_batch_size}", "n")

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> concurrent.futures.Future[RequestOutput]:
        """Queues a request; cancel the future to drop it (its slots are freed at the next step, its output is
        lost), or `abort(request_id)` to finish it with what it has generated so far. Several requests may
        share one `request_id` (one abort ends them all)."""
        self.check(prompt_ids, params)
        with self._cv:
            self._raise_if_stopped()
            seed = params.seed if params.seed is not None else self._seeds.randrange(2**62)
            req = _Request([int(t) for t in prompt_ids], params, seed, request_id)
            if request_id is not None and request_id in self._aborted_ids:
                _resolve(req.future, _aborted_output(req))
                return req.future
            self._waiting.append(req)
            self._cv.notify_all()
        return req.future

    def abort(self, request_ids: Sequence[str] | None = None) -> concurrent.futures.Future[int]:
        """Finishes the requests with these ids (None: every request) between two decode steps: their futures
        resolve with the tokens, logprobs and versions generated so far and finish_reason "abort" (samples that
        had already finished keep theirs). Resolves to the number of requests aborted. An id not seen yet is
        remembered, so a request that arrives after its abort ends at once."""
        ids = None if request_ids is None else frozenset(request_ids)
        if ids:
            with self._cv:
                for rid in ids:
                    self._aborted_ids[rid] = None
                    self._aborted_ids.move_to_end(rid)
                while len(self._aborted_ids) > ABORT_MEMORY:
                    self._aborted_ids.popitem(last=False)
        return self._command("abort", ids)

    def update_weights(self, path: str | Path, version: int) -> concurrent.futures.Future[int]:
        """Loads a Hugging Face checkpoint directory between decode steps; on error the old weights stay."""
        return self._command("update", str(path), int(version))

    def pause(self) -> concurrent.futures.Future[bool]:
        """Stops scheduling (running sequences wait, new requests queue); resolves once no step is in flight."""
        return self._command("pause")

    def resume(self) -> concurrent.futures.Future[bool]:
        return self._command("resume")

    def stats(self) -> EngineStats:
        with self._cv:
            s = dataclasses.replace(self._stats)
            s.waiting = sum(r.params.n for r in self._waiting)
            return s

    def _command(self, kind: str, *args: Any) -> concurrent.futures.Future:
        cmd = _Command(kind, args, concurrent.futures.Future())
        with self._cv:
            self._raise_if_stopped()
            self._commands.append(cmd)
            self._cv.notify_all()
        return cmd.future

    def _raise_if_stopped(self) -> None:
        if self._dead is not None:
            raise RuntimeError(f"inference engine failed: {self._dead!r}")
        if self._stopping:
            raise RuntimeError("inference engine stopped")

    # ---- engine thread ----

    def _run(self) -> None:
        last_log, last_tokens = time.monotonic(), 0
        try:
            with torch.inference_mode():
                while True:
                    with self._cv:
                        while not (self._stopping or self._commands or (not self._stats.paused and
                                                                          (self._running or self._waiting))):
                            self._cv.wait(timeout=1.0)
                        if self._stopping:
                            break
                        commands = list(self._commands)
                        self._commands.clear()
                    for cmd in commands:
                        self._apply(cmd)
                    if self._stats.paused:
                        continue
                    self._drop_abandoned()
                    self._admit()
                    if self._running:
                        self._decode_step()
                    if log.isEnabledFor(logging.DEBUG) and time.monotonic() - last_log >= 1.0:
                        s = self.stats()
                        log.debug("engine: %d running, %d waiting, %.1f tok/s, version %d", s.running, s.waiting,
                                  (s.generated_tokens - last_tokens) / (time.monotonic() - last_log),
                                  s.policy_version)
                        last_log, last_tokens = time.monotonic(), s.generated_tokens
        except BaseException as e:  # a bug in the loop itself: fail everything rather than hang callers
            log.exception("inference engine thread failed")
            self._dead = e
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        err = RuntimeError(f"inference engine failed: {self._dead!r}" if self._dead else "inference engine stopped")
        with self._cv:
            self._stopping = True
            pending = list(self._waiting) + list({id(s.req): s.req for s in self._running}.values())
            commands = list(self._commands)
            self._waiting.clear()
            self._commands.clear()
        self._running = []
        for req in pending:
            _fail(req.future, err)
        for cmd in commands:
            _fail(cmd.future, err)

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind == "pause":
            self._stats.paused = True
            _resolve(cmd.future, True)
        elif cmd.kind == "resume":
            self._stats.paused = False
            _resolve(cmd.future, False)
        elif cmd.kind == "abort":
            _resolve(cmd.future, self._abort(cmd.args[0]))
        elif cmd.kind == "update":
            path, version = cmd.args
            try:
                self._load_weights(Path(path))
            except Exception as e:
                log.warning("weight update from %s failed, keeping version %d: %s", path, self.version, e)
                err = WeightUpdateError(f"could not load weights from {path}: {e}")
                err.__cause__ = e
                _fail(cmd.future, err)
                return
            self._stats.policy_version = version
            self._recompute_caches()
            log.info("loaded weights from %s as policy version %d", path, version)
            _resolve(cmd.future, version)
        else:
            _fail(cmd.future, ValueError(f"unknown engine command {cmd.kind!r}"))

    def _abort(self, ids: frozenset[str] | None) -> int:
        """Finishes matching requests now: queued ones with no tokens, running ones with their tokens so far."""
        hit = lambda r: ids is None or r.request_id in ids  # noqa: E731
        with self._cv:
            queued = [r for r in self._waiting if hit(r)]
            self._waiting = collections.deque(r for r in self._waiting if not hit(r))
        for req in queued:
            _resolve(req.future, _aborted_output(req))
        running = {id(s.req): s.req for s in self._running if hit(s.req)}
        for req in running.values():
            for s in req.seqs:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
                    s.text = self.tokenizer.decode(s.tokens, skip_special_tokens=req.params.skip_special_tokens)
                self._release(s)
            _resolve(req.future, RequestOutput(req.prompt, [x.completion() for x in req.seqs]))
        self._running = [s for s in self._running if not hit(s.req)]
        self._stats.running = len(self._running)
        return len(queued) + len(running)

    def _load_weights(self, path: Path) -> None:
        """Reads and checks every tensor before copying any, so a bad directory leaves the model untouched."""
        if not path.is_dir():
            raise FileNotFoundError(f"weights directory {path} does not exist")
        # verified against the publish manifest; FP8 weights (model.fp8 = "block") dequantised: the FP8 layers
        # requantise them to the same values; MoE experts fused; checked in full before any copy
        copy_state_into(self.model, fuse_experts(dequantize_state(self.weights.load(path))), path)

    def _recompute_caches(self) -> None:
        """Rebuilds the KV cache of running sequences with the current weights (prompt once per request)."""
        by_req: dict[int, list[_Seq]] = {}
        for s in self._running:
            by_req.setdefault(id(s.req), []).append(s)
        for seqs in by_req.values():
            try:
                req = seqs[0].req
                self._forward(req.prompt, 0, seqs[0].slot)
                self._record_routes(seqs, 0, len(req.prompt))
                if len(seqs) > 1:
                    self.kv.copy_slot(seqs[0].slot, [s.slot for s in seqs[1:]], len(req.prompt))
                for s in seqs:
                    if len(s.tokens) > 1:  # the newest token is written by the next decode step
                        self._forward(s.tokens[:-1], len(req.prompt), s.slot)
                        self._record_routes([s], len(req.prompt), len(s.tokens) - 1)
            except Exception as e:
                self._fail_request(seqs[0].req, e)

    def _forward(self, ids: list[int], start: int, slot: int) -> torch.Tensor:
        """Writes `ids` at positions start.. of `slot`; returns fp32 logits `[1, V]` of the last position."""
        x = torch.tensor([ids], dtype=torch.long, device=self._device)
        pos = torch.arange(start, start + len(ids), device=self._device)[None]
        slots = torch.tensor([slot], dtype=torch.long, device=self._device)
        return self.model(x, pos, kv_cache=self.kv, cache_slots=slots, logits_to_keep=1)[:, -1].float()

    def _record_routes(self, seqs: list["_Seq"], start: int, length: int) -> None:
        """Copies the last one-row forward's routing (positions start..start+length) into every sequence in
        `seqs` (a prefill shared by a request's samples, or one sequence's recomputed tokens)."""
        if self._route_shape is None:
            return
        routes = self._routes_of_last_forward()[0]
        for s in seqs:
            if s.routes is None:
                s.routes = np.zeros(self._route_shape, self._route_dtype)
            s.routes[start:start + length] = routes

    def _routes_of_last_forward(self) -> np.ndarray:
        return self.model.last_routed_experts.to("cpu", torch.int16).numpy().astype(self._route_dtype)

    def _release(self, s: _Seq) -> None:
        if s.holds_slot:
            self._free.append(s.slot)
            s.holds_slot = False

    def _drop_abandoned(self) -> None:
        if any(s.req.abandoned for s in self._running):
            for s in self._running:
                if s.req.abandoned:
                    self._release(s)
            self._running = [s for s in self._running if not s.req.abandoned]
            self._stats.running = len(self._running)

    def _admit(self) -> None:
        """Prefills queued requests, first come first served, while the head of the queue fits."""
        while True:
            with self._cv:
                while self._waiting and self._waiting[0].abandoned:
                    self._waiting.popleft()
                if not self._waiting or self._waiting[0].params.n > len(self._free):
                    return
                req = self._waiting.popleft()
            req.seqs = [_Seq(req, i, self._free.pop(), self._device) for i in range(req.params.n)]
            try:
                logits = self._forward(req.prompt, 0, req.seqs[0].slot)
                self._record_routes(req.seqs, 0, len(req.prompt))
                if len(req.seqs) > 1:
                    self.kv.copy_slot(req.seqs[0].slot, [s.slot for s in req.seqs[1:]], len(req.prompt))
                self._stats.requests += 1
                self._stats.prompt_tokens += len(req.prompt)
                self._running.extend(req.seqs)
                self._sample(req.seqs, logits.expand(len(req.seqs), -1))
            except Exception as e:
                log.exception("prefill failed")
                self._fail_request(req, e)

    def _decode_step(self) -> None:
        seqs = self._running
        dev = self._device
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long, device=dev)
        pos = torch.tensor([[s.position] for s in seqs], dtype=torch.long, device=dev)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev)
        try:
            logits = self.model(ids, pos, kv_cache=self.kv, cache_slots=slots)[:, -1].float()
            if self._route_shape is not None:
                routes = self._routes_of_last_forward()
                for b, s in enumerate(seqs):
                    if s.routes is None:
                        s.routes = np.zeros(self._route_shape, self._route_dtype)
                    s.routes[s.position] = routes[b, 0]
            self._stats.decode_steps += 1
            self._stats.max_decode_batch = max(self._stats.max_decode_batch, len(seqs))
            self._sample(seqs, logits)
        except Exception as e:
            log.exception("decode step failed")
            for req in {id(s.req): s.req for s in seqs}.values():
                self._fail_request(req, e)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Chooses one token per sequence from `logits` `[B, V]`, records it, and retires finished sequences."""
        temps = torch.tensor([s.req.params.temperature for s in seqs], dtype=torch.float32, device=logits.device)
        logp = scaled_logprobs(logits, temps)
        greedy = logp.argmax(-1).tolist()
        k = max(s.req.params.top_logprobs for s in seqs)
        top_vals, top_ids = (logp.topk(k, dim=-1) if k else (None, None))
        top_vals = top_vals.tolist() if k else None
        top_ids = top_ids.tolist() if k else None
        version = self.version
        for b, s in enumerate(seqs):
            p = s.req.params
            tok = greedy[b] if s.generator is None else draw(logp[b], p.top_p, s.generator)
            s.tokens.append(tok)
            s.logprobs.append(float(logp[b, tok]))
            s.versions.append(version)
            if p.top_logprobs:
                s.top.append(list(zip(top_ids[b][:p.top_logprobs], top_vals[b][:p.top_logprobs])))
            self._check_finished(s)
        self._stats.generated_tokens += len(seqs)
        done = [s for s in seqs if s.finish_reason is not None]
        if done:
            for s in done:
                self._release(s)
            self._running = [s for s in self._running if s.finish_reason is None]
            for req in {id(s.req): s.req for s in done}.values():
                if all(x.finish_reason is not None for x in req.seqs):
                    _resolve(req.future, RequestOutput(req.prompt, [x.completion() for x in req.seqs]))
        self._stats.running = len(self._running)

    def _check_finished(self, s: _Seq) -> None:
        p = s.req.params
        if s.tokens[-1] == self.eos_token_id:
            s.finish_reason = "stop"
        elif p.stop:
            text = self.tokenizer.decode(s.tokens, skip_special_tokens=p.skip_special_tokens)
            hits = [(text.find(stop), stop) for stop in p.stop if stop in text]
            if hits:
                cut, stop = min(hits)
                s.finish_reason, s.stop_reason, s.text = "stop", stop, text[:cut]
                return
        if s.finish_reason is None and len(s.tokens) >= p.max_tokens:
            s.finish_reason = "length"
        if s.finish_reason is not None:
            s.text = self.tokenizer.decode(s.tokens, skip_special_tokens=p.skip_special_tokens)

    def _fail_request(self, req: _Request, err: BaseException) -> None:
        """Frees every slot the request holds and hands the error to its caller."""
        for s in req.seqs:
            self._release(s)
        self._running = [s for s in self._running if s.req is not req]
        self._stats.running = len(self._running)
        _fail(req.future, err)


ABORT_MEMORY = 65536
"""Aborted request ids an engine remembers (for requests that arrive after their abort)."""


def _aborted_output(req: _Request) -> RequestOutput:
    """The output of a request aborted before it was admitted: every sample empty."""
    return RequestOutput(req.prompt, [Completion(i, [], [], [], [], "abort", None, "") for i in range(req.params.n)])


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits / T)` per row in fp32; rows with T = 0 use T = 1 (greedy reports the raw distribution)."""
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits.float() / t[:, None], dim=-1)


def draw(logprobs: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    """Samples one token id from a row of (temperature-scaled) logprobs, keeping the smallest top-p nucleus."""
    probs = logprobs.exp()
    if top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=generator))
    sorted_p, order = probs.sort(descending=True)
    # Keep a token if the mass strictly before it is below top_p: the most likely token always survives.
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return int(order[int(torch.multinomial(kept, 1, generator=generator))])


def _resolve(fut: concurrent.futures.Future, value: Any) -> None:
    if not fut.done():
        try:
            fut.set_result(value)
        except concurrent.futures.InvalidStateError:  # cancelled by the caller in between
            pass


def _fail(fut: concurrent.futures.Future, err: BaseException) -> None:
    if not fut.done():
        try:
            fut.set_exception(err)
        except concurrent.futures.InvalidStateError:
            pass


def build_engine(cfg: Any) -> tuple[Engine, Any]:
    """The engine and tokenizer described by an `InferenceConfig` (not started)."""
    model = build_model(cfg.model)
    apply_fp8(model, cfg.model)  # the trainer's FP8 forward, so both sides compute alike
    tokenizer = build_tokenizer(cfg.model)
    w = cfg.weights
    engine = Engine(model, tokenizer, seq_len=cfg.seq_len, max_batch_size=cfg.max_batch_size, seed=cfg.seed,
                    weights=FilesystemTransport(timeout=w.timeout, max_shard_gb=w.max_shard_gb, verify=w.verify_checksums,
                                                checksum=w.checksum))
    return engine, tokenizer

