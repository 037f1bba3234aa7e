"""The local inference engine: continuous batching over a fixed pool of KV-cache slots, in a background thread.

One thread owns the model and the cache and, each turn of its loop, applies commands (weight and adapter updates,
pause, resume), admits queued requests into free slots and decodes one token (or verifies MTP drafts) for every
running sequence, so requests join and leave the batch between decode steps; callers get futures. This module is
the thin threaded front (`Engine`); the work is split into inbox, slots, sampler, runner and requests. Every token
carries the policy version that sampled it (docs/inference.md, "arbor's engine")."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from arbor.colocate import return_freed_memory
from arbor.inference.engine.inbox import ABORT_MEMORY, Command, Inbox
from arbor.inference.engine.params import (
    EngineBusy,
    EngineUnavailable,
    InvalidRequest,
    SamplingParams,
    WeightUpdateError,
)
from arbor.inference.engine.requests import Completion, EngineStats, RequestOutput, fail, resolve
from arbor.inference.engine.runner import ModelRunner
from arbor.inference.engine.sampler import Sampler
from arbor.inference.engine.sleep import Released, engine_bytes, release, restore
from arbor.inference.engine.slots import SlotScheduler
from arbor.inference.engine.speculative import SpeculativeDecoder
from arbor.models import build_model, build_tokenizer
from arbor.models.fp8 import apply_fp8
from arbor.models.tokenizer import Tokenizer
from arbor.weights.transport import FilesystemTransport

__all__ = ["ABORT_MEMORY", "Completion", "Engine", "EngineStats", "RequestOutput", "build_engine"]

log = logging.getLogger("arbor.inference.engine.core")


class Engine:
    """Continuous-batching generation over `max_batch_size` cache slots of `seq_len` positions each.

    `submit(prompt_ids, params)` -> Future[RequestOutput]; `update_weights(path, version)` -> Future[int];
    `pause()` / `resume()` -> Future[bool] (resolved once the engine thread has applied them);
    `abort(request_ids)` -> Future[int]; `stats()`.
    Call `start()` once and `stop()` at the end (also usable as a context manager).
    `nucleus_logprobs`: with top_p < 1, report the truncated distribution's logprobs (arbor.inference.engine.sampler);
    the server's engine (`build_engine`) does, like vLLM's `processed_logprobs`, so the trainer's match.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        max_batch_size: int,
        seed: int = 0,
        version: int = 0,
        weights: Any = None,
        nucleus_logprobs: bool = False,
        draft_tokens: int = 0,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        recompute_on_update: bool = True,
    ) -> None:
        """`draft_tokens > 0`: speculative decoding with the model's MTP module drafting that many tokens per
        sequence and step (arbor.inference.engine.speculative). `recompute_on_update`: rebuild the running sequences'
        KV caches after a weight or adapter update (False: keep the older weights' entries, as vLLM does)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.max_batch_size = max_batch_size
        self.vocab_size: int = model.args.vocab_size
        self.eos_token_id: int = tokenizer.eos_token_id
        # Loads published directories: checksums verified, bounded by the transport's timeout.
        self.runner = ModelRunner(
            self.model,
            seq_len=seq_len,
            max_batch_size=max_batch_size,
            weights=weights if weights is not None else FilesystemTransport(),
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            keep_hidden=draft_tokens > 0,
            vocab=tokenizer.vocab_size,
        )
        self._inbox = Inbox(seed)
        sampler = Sampler(tokenizer, nucleus_logprobs)
        spec = (
            SpeculativeDecoder(self.model, self.runner.kv, sampler, draft_tokens=draft_tokens, seq_len=seq_len)
            if draft_tokens > 0
            else None
        )
        self._scheduler = SlotScheduler(
            self.runner, sampler, self._inbox, max_batch_size=max_batch_size, version=version, spec=spec
        )
        self._loop = _EngineLoop(self._inbox, self._scheduler, recompute_on_update)
        self._thread = threading.Thread(target=self._loop.run, name="arbor-engine", daemon=True)

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stops the engine thread; unfinished requests fail with "engine stopped"."""
        self._inbox.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: fail what was queued here
            self._loop.shutdown()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def version(self) -> int:
        return self._scheduler.stats.policy_version

    @property
    def failure(self) -> BaseException | None:
        """What ended the engine loop on its own (None while it runs, and after a clean `stop`)."""
        return self._inbox.dead

    @property
    def alive(self) -> bool:
        """Whether the engine loop is running and takes work (False once it died or was stopped)."""
        return self._thread.is_alive() and self._inbox.dead is None and not self._inbox.stopping

    @property
    def adapters(self) -> dict[str, int]:
        """Loaded LoRA adapters: name -> version."""
        return {name: e.version for name, e in list(self.runner.adapters.loaded.items())}

    def check(self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None) -> None:
        """Raises InvalidRequest if the request can never be served (bad ids, too long, too many samples, an
        adapter that is not loaded)."""
        params.validate()
        if adapter is not None and adapter not in self.runner.adapters.loaded:
            raise InvalidRequest(f"adapter {adapter!r} is not loaded", "model")
        if not prompt_ids:
            raise InvalidRequest("prompt must contain at least one token", "prompt")
        bad = next(
            (t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size),
            None,
        )
        if bad is not None:
            raise InvalidRequest(f"token id {bad!r} is not in the vocabulary [0, {self.vocab_size})", "prompt")
        if len(prompt_ids) >= self.seq_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; the engine's seq_len is {self.seq_len}", "prompt"
            )
        if len(prompt_ids) + params.max_tokens > self.seq_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds seq_len {self.seq_len}",
                "max_tokens",
            )
        if params.n > self.max_batch_size:
            raise InvalidRequest(f"n={params.n} exceeds max_batch_size {self.max_batch_size}", "n")

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        adapter: str | None = None,
        images: dict[str, torch.Tensor] | None = None,
    ) -> concurrent.futures.Future[RequestOutput]:
        """Queues a request (generated with LoRA adapter `adapter` when given); cancel the future to drop it (its
        slots are freed at the next step, its output is lost), or `abort(request_id)` to finish it with what it
        has generated so far. Several requests may share one `request_id` (one abort ends them all). `images`:
        a vision-language prompt's `pixel_values` and `image_grid_thw` (arbor.models.vision.VisionPrompt), its
        placeholders in `prompt_ids`; the image encoder runs once, in the prompt's prefill."""
        self.check(prompt_ids, params, adapter)
        if images and not self.runner.vision:
            raise InvalidRequest("the prompt carries images and the model is text-only", "messages")
        if self.runner.vision and not images and self.runner.model.image_token_id in prompt_ids:
            raise InvalidRequest("the prompt has image placeholder tokens but no images", "images")
        return self._inbox.submit([int(t) for t in prompt_ids], params, request_id, adapter, images).future

    def abort(self, request_ids: Sequence[str] | None = None) -> concurrent.futures.Future[int]:
        """Finishes the requests with these ids (None: every request) between two decode steps: their futures
        resolve with the tokens, logprobs and versions generated so far and finish_reason "abort" (samples that
        had already finished keep theirs). Resolves to the number of requests aborted. An id not seen yet is
        remembered, so a request that arrives after its abort ends at once."""
        ids = None if request_ids is None else frozenset(request_ids)
        if ids:
            self._inbox.remember_aborted(ids)
        return self._inbox.command("abort", ids)

    def update_weights(self, path: str | Path, version: int) -> concurrent.futures.Future[int]:
        """Loads a Hugging Face checkpoint directory between decode steps; on error the old weights stay."""
        return self._inbox.command("update", str(path), int(version))

    def load_adapter(self, name: str, path: str | Path, version: int) -> concurrent.futures.Future[int]:
        """Loads (or replaces with a new version) LoRA adapter `name` from a PEFT directory between decode steps;
        resolves to `version`. On error the adapter's previous version (if any) stays."""
        return self._inbox.command("load_lora", name, str(path), int(version))

    def unload_adapter(self, name: str) -> concurrent.futures.Future[int]:
        """Removes adapter `name`, aborting its queued and running requests; resolves to how many were aborted."""
        return self._inbox.command("unload_lora", name)

    def pause(self) -> concurrent.futures.Future[bool]:
        """Stops scheduling (running sequences wait, new requests queue); resolves once no step is in flight."""
        return self._inbox.command("pause")

    def resume(self) -> concurrent.futures.Future[bool]:
        return self._inbox.command("resume")

    def sleep(self, level: int) -> concurrent.futures.Future[int]:
        """Releases the KV cache (and at level 2 the weights; arbor.inference.engine.sleep) once no sequence runs;
        requests queue until `wake_up` (and, after level 2, the next weight update). Resolves to the bytes
        released; EngineBusy while sequences run."""
        return self._inbox.command("sleep", int(level))

    def wake_up(self) -> concurrent.futures.Future[int]:
        """Allocates again what `sleep` released; resolves to the bytes the engine holds again (0: was awake)."""
        return self._inbox.command("wake_up")

    @property
    def sleeping(self) -> int:
        """The sleep level (0: awake)."""
        return self._scheduler.stats.sleeping

    def held_bytes(self) -> int:
        """Bytes of weights and KV cache the engine holds now (a colocated run's figure)."""
        return engine_bytes(self.model, self.runner.kv)

    def stats(self) -> EngineStats:
        return self._inbox.snapshot(self._scheduler.stats)


class _EngineLoop:
    """The engine thread: applies commands, then admits and decodes, until stopped; fails what is left."""

    def __init__(self, inbox: Inbox, scheduler: SlotScheduler, recompute_on_update: bool = True) -> None:
        self.inbox = inbox
        self.scheduler = scheduler
        self.recompute_on_update = recompute_on_update
        self.released: Released | None = None
        """What the current sleep released (None: awake)."""
        self.needs_weights = False
        """Woken from level 2: no request is admitted until a weight update fills the weights again."""
        self._last_log, self._last_tokens = time.monotonic(), 0

    def run(self) -> None:
        sched = self.scheduler
        try:
            with torch.inference_mode():
                while (commands := self.inbox.wait_for_work(self.held, bool(sched.running))) is not None:
                    for cmd in commands:
                        self._apply(cmd)
                    if self.held:
                        continue
                    sched.drop_abandoned()
                    sched.admit()
                    if sched.running:
                        sched.decode_step()
                    if log.isEnabledFor(logging.DEBUG) and time.monotonic() - self._last_log >= 1.0:
                        self._log_progress()
        except BaseException as e:  # a bug in the loop itself: fail everything rather than hang callers
            log.exception("inference engine thread failed")
            self.inbox.dead = e  # seen by `Engine.alive`: /health turns non-200 and the server process exits
        finally:
            self.shutdown()

    @property
    def held(self) -> bool:
        """No admission nor decoding: paused, asleep, or woken without weights yet."""
        return self.scheduler.stats.paused or self.released is not None or self.needs_weights

    def shutdown(self) -> None:
        """Fails every queued and running request and every pending command."""
        dead = self.inbox.dead
        err = EngineUnavailable(f"inference engine failed: {dead!r}" if dead else "inference engine stopped")
        queued, commands = self.inbox.close()
        for req in queued + self.scheduler.take_running():
            fail(req.future, err)
        for cmd in commands:
            fail(cmd.future, err)

    def _apply(self, cmd: Command) -> None:
        """Applies one command; one that fails fails its caller, never the loop."""
        try:
            self._apply_command(cmd)
        except Exception as e:
            log.exception("engine command %s failed", cmd.kind)
            fail(cmd.future, e)

    def _apply_command(self, cmd: Command) -> None:
        stats = self.scheduler.stats
        if cmd.kind == "pause":
            stats.paused = True
            resolve(cmd.future, True)
        elif cmd.kind == "resume":
            stats.paused = False
            resolve(cmd.future, False)
        elif cmd.kind == "sleep":
            self._sleep(cmd, cmd.args[0])
        elif cmd.kind == "wake_up":
            self._wake(cmd)
        elif cmd.kind == "abort":
            resolve(cmd.future, self.scheduler.abort(cmd.args[0]))
        elif cmd.kind == "update":
            self._update(cmd, Path(cmd.args[0]), cmd.args[1])
        elif cmd.kind == "load_lora":
            self._load_adapter(cmd, *cmd.args)
        elif cmd.kind == "unload_lora":
            name = cmd.args[0]
            self.scheduler.runner.adapters.unload(name)
            resolve(cmd.future, self.scheduler.abort_where(lambda r: r.adapter == name))
        else:
            fail(cmd.future, ValueError(f"unknown engine command {cmd.kind!r}"))

    def _sleep(self, cmd: Command, level: int) -> None:
        """Releases the cache (and weights at level 2) when no sequence runs; asleep already: resolves to 0."""
        if self.released is not None:
            resolve(cmd.future, 0)
            return
        running = len(self.scheduler.running)
        if running:
            fail(cmd.future, EngineBusy(f"cannot sleep while {running} sequence(s) run: abort or finish them first"))
            return
        runner = self.scheduler.runner
        self.released = release(runner.model, runner.kv, level)
        return_freed_memory()
        self.scheduler.stats.sleeping = level
        log.info("asleep (level %d): released %.1f MB of weights and KV cache", level, self.released.held_bytes / 1e6)
        resolve(cmd.future, self.released.held_bytes)

    def _wake(self, cmd: Command) -> None:
        """Allocates again what the sleep released; after level 2 the engine waits for a weight update."""
        if self.released is None:
            resolve(cmd.future, 0)
            return
        restore(self.released)
        self.needs_weights = self.released.level >= 2
        self.released = None
        self.scheduler.stats.sleeping = 0
        runner = self.scheduler.runner
        resolve(cmd.future, engine_bytes(runner.model, runner.kv))

    def _update(self, cmd: Command, path: Path, version: int) -> None:
        """Loads new weights, tags later tokens with `version` and (by default) recomputes the running caches."""
        stats = self.scheduler.stats
        if self.released is not None:
            fail(cmd.future, WeightUpdateError("the engine is asleep: /wake_up before loading weights"))
            return
        try:
            self.scheduler.runner.load_weights(path)
        except Exception as e:
            log.warning("weight update from %s failed, keeping version %d: %s", path, stats.policy_version, e)
            err = WeightUpdateError(f"could not load weights from {path}: {e}")
            err.__cause__ = e
            fail(cmd.future, err)
            return
        stats.policy_version = version
        self.needs_weights = False
        if self.recompute_on_update:
            self.scheduler.recompute_caches()
        log.info("loaded weights from %s as policy version %d", path, version)
        resolve(cmd.future, version)

    def _load_adapter(self, cmd: Command, name: str, path: str, version: int) -> None:
        """Loads an adapter version; the running requests of that adapter get their caches recomputed with it
        (by default)."""
        try:
            self.scheduler.runner.load_adapter(name, Path(path), version)
        except Exception as e:
            log.warning("loading adapter %s from %s failed: %s", name, path, e)
            err = WeightUpdateError(f"could not load adapter {name!r} from {path}: {e}")
            err.__cause__ = e
            fail(cmd.future, err)
            return
        if self.recompute_on_update:
            self.scheduler.recompute_caches(adapter=name)
        log.info("loaded adapter %s from %s as version %d", name, path, version)
        resolve(cmd.future, version)

    def _log_progress(self) -> None:
        s = self.inbox.snapshot(self.scheduler.stats)
        now = time.monotonic()
        log.debug(
            "engine: %d running, %d waiting, %.1f tok/s, version %d",
            s.running,
            s.waiting,
            (s.generated_tokens - self._last_tokens) / (now - self._last_log),
            s.policy_version,
        )
        self._last_log, self._last_tokens = now, s.generated_tokens


def build_engine(cfg: Any) -> tuple[Engine, Any]:
    """The engine and tokenizer described by an `InferenceConfig` (not started), serving `model.lora.path`
    (when set) under the run's adapter name as version 0. Its logprobs under top_p < 1 are the
    nucleus-truncated distribution's, as vLLM's and the trainer's are."""
    model = build_model(cfg.model)
    apply_fp8(model, cfg.model)  # the trainer's FP8 forward, so both sides compute alike
    tokenizer = build_tokenizer(cfg.model)
    w = cfg.weights
    spec = cfg.speculative
    engine = Engine(
        model,
        tokenizer,
        seq_len=cfg.seq_len,
        max_batch_size=cfg.max_batch_size,
        seed=cfg.seed,
        weights=FilesystemTransport(
            timeout=w.timeout, max_shard_gb=w.max_shard_gb, verify=w.verify_checksums, checksum=w.checksum
        ),
        nucleus_logprobs=True,
        draft_tokens=spec.draft_tokens if spec.enabled else 0,
        max_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank,
        recompute_on_update=cfg.kv_after_update != "keep",
    )
    lora = cfg.model.lora
    if lora is not None and lora.path is not None:  # the engine thread is not running yet: load it here
        engine.runner.load_adapter(lora.adapter_name(cfg.output_dir), Path(lora.path), 0)
    return engine, tokenizer
