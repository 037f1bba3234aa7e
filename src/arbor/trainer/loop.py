"""The trainer loop: waits for each step's rollouts, trains on them, publishes the new weights, checkpoints.

Step N consumes `rollouts/step_N/rank_R.safetensors` and publishes `broadcasts/step_{N+1}/`; rank 0 appends one
row per step to `metrics/trainer.jsonl` and, when `max_minutes` is spent, checkpoints and writes `stopped.json`.
The figures of a row: docs/training.md, "The trainer step".
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from arbor.checkpoint_manifest import CheckpointDamaged
from arbor.config.loader import ConfigError
from arbor.config.trainer import IndexerConfig, TrainerConfig
from arbor.models import build_empty, build_tokenizer, load_initial_weights
from arbor.models.dsa_indexer_loss import enable_indexer_training
from arbor.models.materialize import materialize
from arbor.monitor.heartbeat import beat
from arbor.monitor.metrics import RunClock
from arbor.run_dir import (
    damaged_checkpoints,
    latest_checkpoint,
    prune_rollouts,
    room_for,
    set_aside,
    stopped_path,
    trainer_metrics_path,
    write_text_atomic,
)
from arbor.trainer.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from arbor.trainer.loss import build_loss
from arbor.trainer.offload import ColocatedTurns, Offloader
from arbor.trainer.optim import build_optimizer, set_lr
from arbor.trainer.parallel import ParallelDims, forward_context, init_distributed, parallelize, reshard
from arbor.trainer.parallel_state import UNPREPARED, ParallelState
from arbor.trainer.republish import RolloutWait
from arbor.trainer.step import train_step
from arbor.transport.batch import StepBatch
from arbor.weights.publish import DeltaTracker, stream_publish, stream_publish_adapter
from arbor.weights.transport import make_transport


def run(cfg: TrainerConfig) -> int:
    """Trains until `cfg.max_steps`; returns 0. Sets up and tears down the process group itself."""
    try:
        loss_fn = build_loss(cfg.loss)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"loss.name: {e}") from None
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    device, _ = init_distributed(cfg.parallel.backend)
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        if local_world != cfg.parallel.nproc:
            raise ConfigError(
                f"parallel.nproc is {cfg.parallel.nproc} but {local_world} rank(s) run on this node: start with "
                f"`torchrun --nproc-per-node {cfg.parallel.nproc} -m arbor.trainer.main ...` or set --parallel.nproc"
            )
        train(cfg, device, loss_fn)
    except BaseException:
        # Tearing the group down while peers may sit in a collective can deadlock (torchtitan #1342); torchrun
        # kills the peers instead. Alone there is no peer, and an in-process caller may start again.
        if dist.get_world_size() == 1:
            dist.destroy_process_group()
        raise
    # Leave together: a gloo rank tearing down while a peer still finishes its last checkpoint write can abort
    # the peer ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


def build_training(
    cfg: TrainerConfig, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer, ParallelDims, ParallelState]:
    """The parallelised fp32 model and its optimizer (AdamW or Muon + AdamW), plus the ParallelDims in use and
    the model's ParallelState (what the step is handed)."""
    try:
        dims = ParallelDims.from_config(cfg.parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model, state = build_sharded(cfg, dims, device, indexer=cfg.indexer)
    return model, build_optimizer(model, cfg.optim), dims, state


def build_sharded(
    cfg: TrainerConfig, dims: ParallelDims, device: torch.device, indexer: IndexerConfig | None = None
) -> tuple[nn.Module, ParallelState]:
    """`cfg.model` in fp32, parallelised and loaded without any rank holding the whole model: built with its
    parameters on the meta device, sharded by `parallelize`, then each rank allocates its own parts on `device`
    and reads them from the checkpoint one layer at a time (arbor.models.materialize). Master weights are always
    fp32; a lower model.dtype is the compute dtype (see parallel.py). `indexer` (the policy's): DSA indexer
    training flags, set before FSDP2 as they live on the attention modules."""
    spec = cfg.model.model_copy(update={"dtype": "float32"})
    model = build_empty(spec)
    if indexer is not None and indexer.train:
        enable_indexer_training(model, indexer.weight)
    try:
        state = parallelize(model, dims, cfg, device.type)
    except ValueError as e:  # e.g. ep on a dense model, experts or heads not divisible: a config error
        raise ConfigError(str(e)) from None
    materialize(model, device)
    load_initial_weights(model, spec)
    reshard(model)  # the transformers path's two-token check left FSDP2's root gathered
    return model, state


def train(cfg: TrainerConfig, device: torch.device, loss_fn) -> None:
    """Builds the run (model, reference, publisher, resumed step), then trains step after step: wait for the
    step's rollouts, train, publish the next weights version, write the metrics row, checkpoint when due."""
    rank = dist.get_rank()
    beat("building the model")  # the entry point installed this rank's heartbeat
    model, optimizer, dims, state = build_training(cfg, device)
    data_rank = rank // dims.cp  # the ranks of a context-parallel group train on the same rollout file
    reference, ref_state = build_reference(cfg, device, dims) or (None, UNPREPARED)
    publish = Publisher(cfg, build_tokenizer(cfg.model) if rank == 0 else None, device)
    start = resume_and_republish(cfg, model, optimizer, publish)
    turns = colocated_turns(cfg, model, reference, optimizer, device)
    clock = RunClock(cfg.output_dir, start)
    # between steps the ranks answer the orchestrator's requests to publish a refused version again
    rollouts = RolloutWait(
        cfg.output_dir, data_rank, cfg.rollout_timeout, lambda v: publish(model, v, fresh=True), start, device
    )
    optimize = step_trainer(cfg, loss_fn, device, dims, (model, optimizer, state), (reference, ref_state))
    damaged = damaged_checkpoints(cfg.output_dir) if rank == 0 else 0  # steps a resume set aside, this run
    if rank == 0:
        stopped_path(cfg.output_dir).unlink(missing_ok=True)  # an earlier attempt's stop is not this one's
    last_checkpoint_seconds = 0.0  # reported once, with the step after the checkpoint
    for step in range(start, cfg.max_steps):
        t0 = time.perf_counter()
        if turns is not None:
            turns.before_step(step)
        batch = wait_for_batch(rollouts, step, data_rank)
        t1 = time.perf_counter()
        figures = optimize(batch, step)
        t2 = time.perf_counter()
        weight_figures = publish_step(cfg, publish, model, step, rank)
        t3 = time.perf_counter()
        stamp = clock.stamp()  # the row's time; max_minutes decides on the same elapsed_s
        # The metrics line goes out before the checkpoint: a run killed in between resumes after this step,
        # and its figures must already be on disk (metrics.jsonl may miss no step).
        if rank == 0:
            extra = {"ckpt/damaged": damaged, "weights/republished": rollouts.republished, **weight_figures}
            lr = optimizer.param_groups[0]["lr"]
            record = step_record(step, figures, lr, (t0, t1, t2, t3), last_checkpoint_seconds, extra, stamp)
            write_metrics(cfg.output_dir, record)
            last_checkpoint_seconds = 0.0
            log(
                rank,
                f"step {step}: loss {figures['loss']:.4f} mismatch_kl {figures['mismatch_kl']:.2e} "
                f"{record['tokens/s']:.0f} tok/s",
            )
        out_of_time = step + 1 < cfg.max_steps and over_budget(cfg, stamp["elapsed_s"])  # the last step ends anyway
        if (step + 1) % cfg.ckpt.interval == 0 or step + 1 == cfg.max_steps or out_of_time:
            save_checkpoint(cfg.output_dir, step + 1, model, optimizer, cfg.ckpt.keep)
            last_checkpoint_seconds = time.perf_counter() - t3
        if turns is not None:
            turns.after_step(step)
        if out_of_time:
            stop_for_time(cfg, rank, step + 1, clock)
            return


def resume_and_republish(
    cfg: TrainerConfig, model: nn.Module, optimizer: torch.optim.Optimizer, publish: Publisher
) -> int:
    """The step the run starts at: 0, or with `resume` the verified checkpoint's step, whose weights are then
    published again (collective) so the fleet never serves a `broadcasts/` version newer than the checkpoint."""
    start = resume(cfg, model, optimizer) if cfg.resume else 0
    if start:
        publish(model, start)  # the fleet's weights come from the verified checkpoint, never from broadcasts/
        log(dist.get_rank(), f"resumed from checkpoint step {start}; republished weights version {start}")
    return start


def step_trainer(
    cfg: TrainerConfig,
    loss_fn,
    device: torch.device,
    dims: ParallelDims,
    policy: tuple[nn.Module, torch.optim.Optimizer, ParallelState],
    ref: tuple[nn.Module | None, ParallelState],
) -> Callable[[StepBatch, int], dict[str, float]]:
    """`optimize(batch, step)`: sets the step's learning rate, trains on the batch (arbor.trainer.step.train_step,
    with the run's constant arguments bound here) and waits for the device; returns the step's figures."""
    model, optimizer, state = policy
    reference, ref_state = ref

    def optimize(batch: StepBatch, step: int) -> dict[str, float]:
        set_lr(optimizer, step, cfg.max_steps, cfg.lr_schedule)
        figures = train_step(
            model,
            optimizer,
            batch,
            loss_fn,
            cfg.loss,
            cfg.optim.max_norm,
            device,
            dims.dp_size,
            forward_context(dims, cfg, device.type),
            reference,
            router_replay=cfg.model.router_replay,
            mini_batches=cfg.mini_batches,
            epochs=cfg.epochs,
            draft=cfg.draft,
            state=state,
            ref_state=ref_state,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return figures

    return optimize


def wait_for_batch(rollouts: RolloutWait, step: int, data_rank: int) -> StepBatch:
    """This rank's rollouts of `step` (waiting for them, republishing on request meanwhile)."""
    beat(f"waiting for rollouts step {step}")
    batch = rollouts.batch(step)
    beat(f"training step {step}")
    if batch.step != step:
        raise ValueError(f"rollouts/step_{step}/rank_{data_rank} holds step {batch.step}")
    return batch


def publish_step(cfg: TrainerConfig, publish: Publisher, model: nn.Module, step: int, rank: int) -> dict[str, float]:
    """Publishes weights version `step + 1` (collective), then rank 0 prunes the rollouts no longer needed; the
    publish's figures."""
    beat(f"publishing weights version {step + 1}")
    weight_figures = publish(model, step + 1)
    if rank == 0:  # publish is collective: every rank has read this step's rollouts (and all before it)
        prune_rollouts(cfg.output_dir, cfg.keep_rollouts, step)
    return weight_figures


HEAD_FIGURES = ("loss", "mismatch_kl", "entropy", "grad_norm")
"""The step figures that lead a metrics row, after its step, weights version and before its lr."""


def step_record(
    step: int,
    figures: dict[str, float],
    lr: float,
    times: tuple[float, float, float, float],
    checkpoint_seconds: float,
    extra: dict[str, Any],
    stamp: dict[str, Any],
) -> dict[str, Any]:
    """One row of `metrics/trainer.jsonl`. `times`: the step's start, rollouts in, trained, published
    (perf_counter); `extra`: the run's counters and the publish's figures; `stamp`: RunClock's time fields."""
    t0, t1, t2, t3 = times
    return {
        "step": step,
        "weights_version": step + 1,
        **{k: figures[k] for k in HEAD_FIGURES},
        "lr": lr,
        "tokens/s": figures["num_tokens"] / max(t2 - t1, 1e-9),
        "time/step": t3 - t0,
        "time/wait": t1 - t0,
        "time/wait_ratio": (t1 - t0) / max(t3 - t0, 1e-9),  # throughput matching: trainer starved?
        "throughput/trainer_wait_frac": (t1 - t0) / max(t3 - t0, 1e-9),  # the orchestrator adapts on it
        "time/compute": t2 - t1,
        "time/publish": t3 - t2,
        "time/checkpoint": checkpoint_seconds,
        **extra,
        **{k: v for k, v in figures.items() if k not in HEAD_FIGURES},
        **stamp,
    }


def colocated_turns(
    cfg: TrainerConfig, model: nn.Module, reference: nn.Module | None, optimizer, device: torch.device
) -> ColocatedTurns | None:
    """A colocated run's turns (arbor.trainer.offload), its state offloaded and `ready` written; None otherwise."""
    if not cfg.colocate:
        return None
    modules = [model] if reference is None else [model, reference]
    turns = ColocatedTurns(Offloader(modules, optimizer, device), cfg.output_dir, cfg.rollout_timeout)
    turns.start()
    return turns


def resume(cfg: TrainerConfig, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Collective: loads the newest checkpoint that verifies (its files shared out among the ranks) and returns
    its step (0: none). A damaged newer one is set aside in one line (`ckpt.on_damage = "previous"`) or stops the
    trainer on that line ("fail"). Under `rl` the launcher has verified already, and this finds the same step."""
    rank = dist.get_rank()
    while True:
        found = [latest_checkpoint(cfg.output_dir) if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)  # every rank must load the same step
        step = found[0]
        if step is None:
            return 0
        try:
            verify_checkpoint(cfg.output_dir, step)
        except CheckpointDamaged as e:
            if cfg.ckpt.on_damage == "fail":
                raise
            if rank == 0:
                log(rank, f"{e}; moved to {set_aside(cfg.output_dir, step)}, resuming from the previous one")
            dist.barrier()  # the step is aside before any rank looks for the next one
            continue
        load_checkpoint(cfg.output_dir, step, model, optimizer, verify=False)
        return step


def over_budget(cfg: TrainerConfig, elapsed: float) -> bool:
    """Whether `max_minutes` has run out at `elapsed` seconds; collective when set (rank 0's clock decides for
    every rank)."""
    if cfg.max_minutes is None:
        return False
    decision = [elapsed >= cfg.max_minutes * 60]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def stop_for_time(cfg: TrainerConfig, rank: int, step: int, clock: RunClock) -> None:
    """After checkpoint `step`: tells the orchestrator where the run stopped (`stopped.json`), logs one line."""
    if rank == 0:
        write_text_atomic(
            stopped_path(cfg.output_dir),
            json.dumps({"step": step, "reason": "max_minutes", "elapsed_s": round(clock.elapsed(), 3)}),
        )
    log(
        rank,
        f"max_minutes ({cfg.max_minutes:g}) reached after {clock.elapsed() / 60:.1f} min: stopped at step "
        f"{step} of {cfg.max_steps} with a checkpoint; continue with --resume and a larger --max-minutes",
    )


def build_reference(
    cfg: TrainerConfig, device: torch.device, dims: ParallelDims
) -> tuple[nn.Module, ParallelState] | None:
    """The KL penalty's reference: the initial weights (built as `build_training` builds the policy, before any
    checkpoint is loaded), frozen and sharded like the policy (under FSDP2 its forward is a collective too),
    with its own ParallelState. None when `loss.kl_coef` is 0."""
    if cfg.loss.kl_coef <= 0:
        return None
    # LoRA: the reference is the base model, which a zero adapter leaves unchanged: none is added
    ref_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})
    with torch.random.fork_rng():  # the same initial weights as the policy's, without moving the global RNG
        torch.manual_seed(cfg.seed)
        ref, state = build_sharded(ref_cfg, dims, device)
    ref.requires_grad_(False).eval()
    return ref, state


class Publisher:
    """The run's weight publisher: one transport (so NCCL keeps one long-lived weight group) and the delta
    tracker. Calling it is collective: every rank takes part in each bucket's gather (arbor.weights.publish)."""

    def __init__(self, cfg: TrainerConfig, tokenizer, device: torch.device) -> None:
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.transport = make_transport(cfg.weights, cfg.keep_broadcasts)
        self.tracker = DeltaTracker(cfg.weights.delta)

    def __call__(self, model: nn.Module, version: int, fresh: bool = False) -> dict[str, float]:
        """Publishes `model` as `version` (collective); `fresh`: every bucket, none linked to an earlier version
        (a republish after the fleet refused one: a delta could link the damaged shard back)."""
        if fresh:
            self.tracker.version = None
        # inference runs in model.dtype: publish that, not the fp32 masters
        dtype, lora = getattr(torch, self.cfg.model.dtype), self.cfg.model.lora
        if lora is not None:  # the adapter only, as a PEFT directory
            return stream_publish_adapter(
                model, self.transport, self.cfg.output_dir, version, dtype, lora, self.cfg.model.name
            )
        return stream_publish(
            model,
            self.transport,
            self.cfg.output_dir,
            version,
            getattr(torch, self.cfg.model.dtype),
            self.cfg.model.fp8 == "block",
            self.tokenizer,
            self.tracker,
            self.device,
        )


def write_metrics(output_dir: str | Path, record: dict[str, Any]) -> None:
    path = trainer_metrics_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record) + "\n"
    with room_for(path, len(line)), open(path, "a") as f:
        f.write(line)
        f.flush()


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[trainer] {message}", file=sys.stderr, flush=True)
