"""`rl` config: the three processes' sections plus shared fields that are pushed down into them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, model_validator

from arbor.config.admin import AdminToken, token_value
from arbor.config.base import Config, Count, FilePath, Float, Int, Seconds, Seed, Tokens
from arbor.config.cost import CostConfig
from arbor.config.hardware import HardwareConfig, PlanConfig
from arbor.config.inference import InferenceConfig
from arbor.config.layout import check_mesh, check_transformers_path
from arbor.config.model import ModelConfig
from arbor.config.monitor import WandbConfig
from arbor.config.orchestrator import OrchestratorConfig, TeacherConfig
from arbor.config.sft import SFTConfig
from arbor.config.slurm import SlurmConfig
from arbor.config.trainer import TrainerConfig
from arbor.config.transport import WeightTransportConfig
from arbor.registry import PER_STEP_MODES

SECTIONS = ("trainer", "orchestrator", "inference", "sft")
SHARED = ("model", "output_dir", "max_steps", "max_minutes", "seq_len", "seed", "resume", "weights")


class RLConfig(Config):
    """Runs inference, orchestrator and trainer together (and an optional SFT warm-up first)."""

    model: ModelConfig = ModelConfig()
    """The model, shared by every process."""
    output_dir: FilePath = Path("outputs/run")
    """Run directory: configs/, logs/, metrics.jsonl, rollouts/, broadcasts/, checkpoints/."""
    max_steps: Int = Field(20, ge=1)
    """RL training steps."""
    max_minutes: Float | None = Field(None, gt=0)
    """Wall-clock budget of the RL steps, in minutes (None: none), counted as metrics.jsonl's `elapsed_s` (from
    the start of trainer and orchestrator, the SFT warm-up and inference start-up excluded; going on across
    `--resume`). Once a trained step ends past it, the trainer writes a checkpoint and the run ends cleanly
    (exit 0) before max_steps; `--resume` with a larger budget continues it."""
    seq_len: Tokens = Field(512, ge=8)
    """Longest sequence (prompt + completion)."""
    seed: Seed = 0
    """Base seed."""
    resume: bool = False
    """Continue a killed run from its latest checkpoint."""
    max_restarts: Count = Field(0, ge=0)
    """Times `rl` resumes a failed run by itself from its latest checkpoint, as `--resume` would (every process
    stopped and started again), after a process died for good or the watchdog stopped a stall; only after an
    attempt that completed a step (a failure before any would only repeat). 0: a failure ends the run."""
    weights: WeightTransportConfig = WeightTransportConfig()
    """Weight transfer from trainer to inference, shared by both."""
    dry_run: bool = False
    """Check the config alone (no file of the model, dataset or agent is read: a cluster config checks on a
    laptop), write the resolved configs to `<output_dir>/configs/` and exit."""
    check: bool = False
    """Check the config and run the whole preflight (model and tokenizer files, environment, its arguments, agent
    files and dataset, loss and advantage paths, backends, GPUs, ports, disk), then exit without starting
    anything. `rl` runs the same preflight before it starts a run."""
    twin: bool = Field(False, exclude=True)
    """Run the config's twin here instead (arbor.launch.twin): a tiny random model of the same family and
    structure, the nodes and GPUs shrunk to CPU ranks keeping ep and cp where they divide them, shorter sequences,
    smaller batches and a few steps, in `<output_dir>-twin/`; dtype, FP8, loss, scheduler, environment, backend,
    weight transport and buffer as written. Every setting it changes is printed with its reason first; with
    `--dry-run` only that (and the resolved configs) is done. What a laptop runs before a GPU queue slot."""
    admin_token: AdminToken | None = Field(None, exclude=True)
    """Bearer token of the admin routes of the inference servers and the router, sent by the orchestrator;
    `rl` generates one per run when a server binds beyond loopback and none is given. Secret: never written
    out; `ARBOR_ADMIN_TOKEN` sets it (a section's own `admin_token` must then agree)."""
    fleet: str | None = Field(None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$", max_length=4095)
    """URL of a running fleet (`fleet @ fleet.toml`) to run on: `rl` then starts only the trainer and the
    orchestrator, registers the run with the fleet (its policy is a LoRA adapter named `run_name`), and
    unregisters it when it ends, leaving the fleet up. None: `rl` starts its own inference servers."""
    fleet_weight: Float = Field(1.0, gt=0)
    """The run's share of a saturated fleet relative to the other runs' (2.0: twice a run of weight 1)."""
    fleet_token: AdminToken | None = Field(None, exclude=True)
    """The fleet's admin token, to register the run (the fleet then hands the run a token of its own). Secret:
    never written out; `ARBOR_FLEET_TOKEN` sets it. None: the fleet has none (it binds loopback only)."""
    run_name: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$", max_length=255)
    """The run's name on a fleet, which is also its adapter's; default: the name of `output_dir`."""
    inference_startup_timeout: Seconds = Field(300.0, gt=0)
    """Seconds to wait for the inference server to become healthy."""
    stall_timeout: Seconds = Field(1800.0, gt=0)
    """Watchdog: when no RL step completes for this many seconds, dump every process's Python stacks into
    `<output_dir>/logs/stacks/`, name what each process was waiting on, and stop the run (exit code 3)."""
    trainer: TrainerConfig = TrainerConfig()
    """The trainer."""
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator."""
    inference: InferenceConfig = InferenceConfig()
    """The inference server."""
    teacher: InferenceConfig | None = None
    """On-policy distillation: a teacher inference server `rl` launches (arbor's local engine, or vLLM behind
    arbor's proxy with `backend = "vllm"`, with its own `model` and settings; seq_len defaults to the run's + 1)
    and points `orchestrator.teacher.url` at. Leave it out to use a running server (arbor's `inference`, or
    `vllm serve`) named by `orchestrator.teacher.url` instead. The teacher must share the policy's tokenizer."""
    sft: SFTConfig = SFTConfig()
    """Optional SFT warm-up run before RL (`steps = 0` skips it)."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases (trainer and orchestrator figures in one run)."""
    cost: CostConfig = CostConfig()
    """GPU-hour price and pool sizes for the cost figure of `arbor-report`."""
    hardware: HardwareConfig | None = None
    """The accelerators' peak figures, for `rl plan` (a configs/hardware/ layer sets them)."""
    plan: PlanConfig = PlanConfig()
    """The workload and efficiency assumptions of `rl plan` (mean lengths, MFU, bytes per weight)."""
    slurm: SlurmConfig | None = None
    """Submit the run to SLURM (writes `<output_dir>/rl.sbatch` and calls `sbatch`) instead of running it here."""

    @model_validator(mode="before")
    @classmethod
    def _push_down_shared(cls, data: Any) -> Any:
        """Copies each shared field into every section that has it; a section may only repeat the same value."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in SHARED:
            top = data.get(key, _default(cls, key))
            top_cmp = _comparable(top)
            for section in SECTIONS:
                if key not in cls.model_fields[section].annotation.model_fields:
                    continue
                sub = dict(data.get(section) or {})
                if key in sub:
                    if key in ("model", "weights"):
                        merged = {**_comparable(top), **_comparable(sub[key])}
                        if merged != _comparable(top):
                            diff = sorted(k for k in merged if merged[k] != _comparable(top).get(k))
                            raise ValueError(
                                f"{section}.{key}.{diff[0]} differs from {key}.{diff[0]}: set shared fields "
                                f"once, at the top level"
                            )
                    elif _comparable(sub[key]) != top_cmp:
                        raise ValueError(
                            f"{section}.{key} = {sub[key]!r} differs from {key} = {top!r}: set shared fields "
                            f"once, at the top level"
                        )
                sub[key] = top
                data[section] = sub
        if data.get("wandb") is not None:
            orch = dict(data.get("orchestrator") or {})
            orch["wandb"] = data["wandb"]
            data["orchestrator"] = orch
        return data

    @model_validator(mode="after")
    def _derived(self) -> "RLConfig":
        # The orchestrator writes one rollout file per data-parallel trainer rank (a context-parallel group of
        # cp ranks shares one).
        p = self.trainer.parallel
        nodes = self.slurm.trainer_nodes if self.slurm is not None else 1
        ranks = f"trainer.parallel.nproc ({p.nproc})" + (f" x slurm.trainer_nodes ({nodes})" if nodes > 1 else "")
        check_mesh(p, p.nproc * nodes, ranks)
        if p.nproc % p.cp:
            raise ValueError(f"trainer.parallel.cp ({p.cp}) must divide trainer.parallel.nproc ({p.nproc})")
        ranks = p.nproc // p.cp
        check_transformers_path(self.model, p, self.orchestrator.batching.prefix_merge)
        if self.orchestrator.batching.prefix_merge and p.cp > 1:
            raise ValueError(
                f"orchestrator.batching.prefix_merge = true needs trainer.parallel.cp = 1 (got {p.cp}): context "
                "parallelism splits rows by position and cannot carry a prefix tree's mask; turn one of them off"
            )
        if self.orchestrator.batching.trainer_ranks not in (1, ranks):
            raise ValueError(
                f"orchestrator.batching.trainer_ranks ({self.orchestrator.batching.trainer_ranks}) differs from "
                f"the trainer's data-parallel ranks ({ranks} = parallel.nproc / parallel.cp); leave it unset"
            )
        self.orchestrator.batching.trainer_ranks = ranks
        self._check_deepep_buffer()
        self._derive_router_replay()
        self.orchestrator.batching.min_micro_batches = max(
            self.orchestrator.batching.min_micro_batches, self.trainer.mini_batches
        )
        if self.trainer.mini_batches > max(1, self.orchestrator.batch_size // ranks):
            raise ValueError(
                f"trainer.mini_batches ({self.trainer.mini_batches}) exceeds the rollouts per trainer rank "
                f"({self.orchestrator.batch_size} / {ranks}): each mini-batch needs samples of its own"
            )
        batching = self.orchestrator.batching
        if self.trainer.loss.name == "gspo" and "normalization" not in batching.model_fields_set:
            batching.normalization = "sequence"  # GSPO's objective is a mean over sequences
        if self.sft.steps:
            self.sft.environment = self.orchestrator.environment
        if self.inference.frozen:
            raise ValueError(
                "inference.frozen = true: the policy's servers take the trainer's weights every step; frozen is "
                "for a server whose weights never change (a [teacher])"
            )
        self._check_teacher()
        self._check_colocate()
        self._check_weight_updates()
        if self.fleet is not None and self.model.lora is None:
            raise ValueError(
                "fleet needs [model.lora]: a run on a shared fleet trains and serves a LoRA adapter on "
                "the fleet's base model"
            )
        if self.fleet is not None and self.run_name is not None and self.model.lora.name not in (None, self.run_name):
            raise ValueError(
                f"model.lora.name ({self.model.lora.name!r}) differs from run_name ({self.run_name!r}): "
                "on a fleet the adapter is named after the run; set run_name only"
            )
        self.run_admin_token()
        return self

    def _check_colocate(self) -> None:
        """`inference.colocate` reaches the trainer and the orchestrator (their own fields are set from it, never
        by hand) and is refused, in one line naming the field, where trainer and fleet cannot take turns."""
        want = self.inference.colocate
        for section in (self.trainer, self.orchestrator):
            if "colocate" in section.model_fields_set and section.colocate != want:
                raise ValueError(
                    f"{'trainer' if section is self.trainer else 'orchestrator'}.colocate = {section.colocate} "
                    f"differs from inference.colocate = {want}: set inference.colocate only"
                )
            section.colocate = want
        if not want:
            return
        mode = self.orchestrator.scheduler.mode
        why = None
        if mode not in PER_STEP_MODES:
            why = f"orchestrator.scheduler.mode = 'sync' or 'one_step_off' (got {mode!r}): the phases alternate"
        elif self.fleet is not None:
            why = "the run's own fleet (fleet is set: a shared fleet's GPUs are not the trainer's)"
        elif self.slurm is not None and (self.slurm.trainer_nodes > 1 or self.slurm.inference_nodes > 0):
            why = "one node (slurm.trainer_nodes = 1 and slurm.inference_nodes = 0): turns are taken per device"
        elif self.weights.kind != "filesystem":
            why = f"weights.kind = 'filesystem' (got {self.weights.kind!r}: NCCL cannot join two ranks on one GPU)"
        if why is not None:
            raise ValueError(f"inference.colocate = true needs {why}")

    def _check_weight_updates(self) -> None:
        """`weight_updates = "between_steps"` loads exactly one version per step from its published directory."""
        if self.orchestrator.scheduler.weight_updates != "between_steps":
            return
        why = None
        if self.inference.colocate:
            why = "inference.colocate = false (a colocated fleet sleeps while the trainer trains: its batches are "
            why += "already sampled from one policy; leave weight_updates = 'in_flight')"
        elif self.weights.kind != "filesystem":
            why = f"weights.kind = 'filesystem' (got {self.weights.kind!r}: NCCL sends a version as it is published)"
        elif self.trainer.keep_broadcasts < 2:
            why = "trainer.keep_broadcasts >= 2 (the trainer may publish the next version before a step loads its own)"
        if why is not None:
            raise ValueError(f"orchestrator.scheduler.weight_updates = 'between_steps' needs {why}")

    def _derive_router_replay(self) -> None:
        """`model.router_replay` makes the trainer replay the fleet's routes, so the fleet must return them: the
        local engine records them for every MoE model, vLLM only when told (`inference.router_replay`, derived
        here). Without them the trainer would route by itself and nothing would say so."""
        if not self.model.router_replay:
            return
        inf = self.inference
        if "router_replay" in inf.model_fields_set and not inf.router_replay:
            raise ValueError(
                "inference.router_replay = false with model.router_replay = true: the fleet would not return the "
                "routes the trainer replays; drop inference.router_replay (model.router_replay sets it)"
            )
        inf.router_replay = True

    def _check_deepep_buffer(self) -> None:
        """DeepEP's buffer holds `ep_max_tokens_per_rank` tokens: a rank's share of a micro-batch row (the row over
        cp) must fit, or the first dispatch of a full row fails deep in its kernels."""
        p, row = self.trainer.parallel, self.orchestrator.batching.micro_batch_tokens
        if p.ep > 1 and p.ep_backend == "deepep" and -(-row // p.cp) > p.ep_max_tokens_per_rank:
            raise ValueError(
                f"orchestrator.batching.micro_batch_tokens ({row}) / trainer.parallel.cp ({p.cp}) exceeds "
                f"trainer.parallel.ep_max_tokens_per_rank ({p.ep_max_tokens_per_rank}), DeepEP's buffer per rank: "
                "raise ep_max_tokens_per_rank or lower micro_batch_tokens"
            )

    def _check_teacher(self) -> None:
        """Distillation needs a teacher and a teacher needs the loss term; `[teacher]` fills in the orchestrator's."""
        orch, coef = self.orchestrator, self.trainer.loss.distill_coef
        if self.teacher is not None:
            if orch.teacher is not None and orch.teacher.url is not None:
                raise ValueError(
                    f"orchestrator.teacher.url = {orch.teacher.url!r} and a [teacher] section to launch "
                    "one: keep one of them"
                )
            if self.slurm is not None:
                raise ValueError(
                    "[teacher] is launched by a local rl only: under slurm serve the teacher yourself "
                    "and set orchestrator.teacher.url"
                )
            orch.teacher = orch.teacher or TeacherConfig()
            self.teacher.frozen = True  # it scores with the weights it started with (no updates, served as published)
            allowed = self.teacher.engine_backend().max_logprobs(self.teacher)
            if allowed is not None and orch.teacher.top_k > allowed:
                raise ValueError(
                    f"orchestrator.teacher.top_k ({orch.teacher.top_k}) exceeds the {allowed} "
                    f"logprobs per token the teacher ({self.teacher.backend} backend) serves"
                )
            if "seq_len" not in self.teacher.model_fields_set:
                self.teacher.seq_len = self.seq_len + 1  # the scoring request asks for one token past a sample
            elif self.teacher.seq_len <= self.seq_len:
                raise ValueError(
                    f"teacher.seq_len ({self.teacher.seq_len}) must exceed seq_len ({self.seq_len}): "
                    "the teacher scores whole samples and generates one token past them"
                )
        elif orch.teacher is not None and orch.teacher.url is None:
            raise ValueError(
                "orchestrator.teacher.url is not set: give the teacher server's URL, or add a [teacher] "
                "section for rl to launch one"
            )
        if coef > 0 and orch.teacher is None:
            raise ValueError(
                "trainer.loss.distill_weight > 0 (or loss.name = 'distill') needs a teacher: set "
                "orchestrator.teacher.url or add a [teacher] section"
            )
        if coef == 0 and orch.teacher is not None:
            raise ValueError(
                "a teacher is set but trainer.loss.distill_weight is 0: set trainer.loss.distill_weight "
                "(or loss.name = 'distill'), or remove the teacher"
            )

    def run_admin_token(self) -> SecretStr | None:
        """The run's one admin token: the top-level one, or the one a section sets; two different ones fail."""
        places = {
            "admin_token": self.admin_token,
            "inference.admin_token": self.inference.admin_token,
            "inference.router.admin_token": self.inference.router.admin_token,
            "orchestrator.client.admin_token": self.orchestrator.client.admin_token,
        }
        given = {k: v for k, v in places.items() if v is not None}
        if len({token_value(v) for v in given.values()}) > 1:
            raise ValueError(f"{' and '.join(given)} differ: set admin_token once, at the top level")
        return next(iter(given.values()), None)


def _default(cls: type[Config], key: str) -> Any:
    return cls.model_fields[key].get_default(call_default_factory=True)


def _comparable(value: Any) -> Any:
    if isinstance(value, Config):
        return value.model_dump(exclude_unset=True, mode="json")
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    return value
