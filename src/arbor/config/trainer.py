"""`trainer` process config: the RL loop's optimizer, loss, checkpoints and weight publishing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from arbor.config.base import Config, Count, FilePath, Float, Int, Ranks, Seconds, Seed, Tokens
from arbor.config.layout import check_indexer, check_model_split, check_transformers_path, model_shape
from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.config.transport import WeightTransportConfig, check_lora_transport

Beta = Annotated[Float, Field(ge=0, lt=1)]
"""An AdamW beta: a decay rate in [0, 1)."""


class OptimConfig(Config):
    name: Literal["adamw", "muon"] = "adamw"
    """Optimizer: "adamw", or "muon" (torch.optim.Muon on 2-D weight matrices; AdamW on embeddings, the head,
    norms, routers and 3-D expert weights)."""
    lr: Float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW's; Muon's too unless muon_lr is set)."""
    muon_lr: Float | None = Field(None, gt=0)
    """Muon's learning rate; default: lr."""
    muon_momentum: Float = Field(0.95, ge=0, lt=1)
    """Muon's momentum."""
    weight_decay: Float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas."""
    eps: Float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_norm: Float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""


class LRScheduleConfig(Config):
    """`[trainer.lr_schedule]` (formerly `[trainer.scheduler]`): the learning rate over the steps."""

    name: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up: constant, linear decay or cosine decay to min_lr_ratio x lr at
    max_steps."""
    warmup_steps: Int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to lr."""
    min_lr_ratio: Float = Field(0.0, ge=0, le=1)
    """Final learning rate of the decaying schedules, as a fraction of lr."""


class LossConfig(Config):
    name: str = "ppo_clip"
    """Policy loss: "ppo_clip" (token-level clipped ratio, DAPO clip-higher when clip_high > clip_low),
    "is_mask" (trust-region mask), "gspo" (sequence-level ratio), "cispo" (clipped stop-gradient IS weight times
    logprob), "opmd" (off-policy mirror descent, Trinity-RFT A.3), "cross_entropy" (SFT), "distill" (pure
    on-policy distillation: the reverse KL to `[orchestrator.teacher]` alone, see distill_weight), or a dotted path
    `module:function` implementing arbor.trainer.loss.LossFn."""
    clip_low: Float = Field(0.2, ge=0, le=1)
    """Lower bound of the trust region: ratio >= 1 - clip_low."""
    clip_high: Float = Field(0.28, ge=0)
    """Upper bound of the trust region: ratio <= 1 + clip_high (DAPO's clip-higher when above clip_low)."""
    gspo_clip_low: Float = Field(3e-4, ge=0, le=1)
    """GSPO: the sequence ratio's lower clip, 1 - gspo_clip_low (the paper's 3e-4)."""
    gspo_clip_high: Float = Field(4e-4, ge=0)
    """GSPO: the sequence ratio's upper clip, 1 + gspo_clip_high (the paper's 4e-4)."""
    cispo_clip_low: Float = Field(1.0, ge=0, le=1)
    """CISPO: the importance weight is clipped below at 1 - cispo_clip_low (1.0: no lower bound, as MiniMax-M1)."""
    cispo_clip_high: Float = Field(4.0, ge=0)
    """CISPO: the importance weight is clipped above at 1 + cispo_clip_high."""
    opmd_tau: Float = Field(1.0, ge=0)
    """OPMD: the KL regulariser tau; the loss is -A * logprob / (1 + tau)."""
    trust_region: Literal["auto", "behaviour", "proximal"] = "auto"
    """Which policy the loss's ratio (PPO/DAPO clip, is_mask's mask, GSPO's sequence clip, CISPO's weight) is
    measured against (arbor.trainer.loss states the decoupled objective): "behaviour" = the inference logprobs
    (coupled PPO: the one ratio bounds the update and corrects the off-policy samples), "proximal" = the
    trainer's own logprobs at the start of the step, with the behaviour gap left to mismatch_correction. "auto" =
    "proximal" for gspo (its band is meant for one update) and whenever a mismatch correction is on, else
    "behaviour"."""
    mismatch_correction: Literal["none", "tis", "mis"] = "none"
    """Behaviour correction, a detached weight on each token's loss from the ratio pi_proximal / pi_inference:
    "tis" (truncated IS) weighs it min(ratio, mismatch_cap); "mis" (masked IS, IcePop) weighs it by the ratio
    where the ratio lies in [mismatch_low, mismatch_cap] and drops it elsewhere (per token, or per sample, see
    mismatch_level)."""
    mismatch_level: Literal["token", "sequence"] = "token"
    """Ratio used by the mismatch correction: per token, or the sample's sequence ratio (mismatch_sequence) applied
    to all its tokens."""
    mismatch_sequence: Literal["geometric", "product"] = "geometric"
    """Sequence ratio of mismatch_level = "sequence": "geometric" = exp(mean of the token log-ratios) (low
    variance, biased), "product" = exp(sum) (the unbiased sequence importance ratio), computed in log space and
    capped there (log mismatch_cap), so a long sample's ratio never overflows."""
    mismatch_cap: Float = Field(2.0, gt=0)
    """Upper truncation (tis) or upper mask bound (mis) of the behaviour ratio."""
    mismatch_low: Float = Field(0.5, ge=0)
    """Lower mask bound of the behaviour ratio (mis only)."""
    ratio_mask: Literal["none", "token", "sequence"] = "none"
    """Outlier rejection on top of any correction: drop tokens whose behaviour ratio pi_proximal / pi_inference
    lies outside [ratio_mask_low, ratio_mask_high] ("token", IcePop-style two-sided), or whole samples whose
    geometric-mean ratio does ("sequence")."""
    ratio_mask_low: Float = Field(0.5, ge=0)
    """Lower bound of ratio_mask."""
    ratio_mask_high: Float = Field(2.0, gt=0)
    """Upper bound of ratio_mask."""
    max_staleness: Int | None = Field(None, ge=0)
    """Staleness bound at training time: a sample older than this many steps (the step that trains it minus the
    policy version of its first token, so queue time counts) is dropped or down-weighted (stale_policy).
    None: no bound."""
    stale_policy: Literal["drop", "decay"] = "drop"
    """Past max_staleness: "drop" the sample, or "decay" its loss by stale_decay per step beyond the bound."""
    stale_decay: Float = Field(0.5, gt=0, le=1)
    """Per-step factor of stale_policy = "decay"."""
    kl_coef: Float = Field(0.0, ge=0)
    """Weight of a k3-estimated KL(policy || reference) penalty per token; > 0 keeps a frozen copy of the initial
    weights as the reference model (one more forward pass per micro-batch)."""
    distill_weight: Float | None = Field(None, ge=0)
    """On-policy distillation: weight of the per-token reverse KL to a teacher (its logprobs on the policy's own
    samples, from `[orchestrator.teacher]`; see arbor.trainer.loss), added to the policy loss. Unset: 1 with
    name = "distill" (pure distillation: that term alone, rewards unused), else 0 (off)."""

    @property
    def distill_coef(self) -> float:
        """The reverse-KL term's weight (distill_weight resolved)."""
        if self.distill_weight is not None:
            return self.distill_weight
        return 1.0 if self.name == "distill" else 0.0

    @model_validator(mode="after")
    def _bounds(self) -> "LossConfig":
        if self.mismatch_low >= self.mismatch_cap:
            raise ValueError(f"mismatch_low ({self.mismatch_low}) must be below mismatch_cap ({self.mismatch_cap})")
        if self.ratio_mask_low >= self.ratio_mask_high:
            raise ValueError(
                f"ratio_mask_low ({self.ratio_mask_low}) must be below ratio_mask_high ({self.ratio_mask_high})"
            )
        if self.name == "distill" and self.distill_coef == 0:
            raise ValueError("distill_weight = 0 with name = 'distill' trains nothing: leave it unset (1) or raise it")
        if self.trust_region == "behaviour" and self.mismatch_correction != "none":
            raise ValueError(
                f"trust_region = 'behaviour' with mismatch_correction = {self.mismatch_correction!r} corrects the "
                "behaviour gap twice: use trust_region = 'proximal' (or 'auto')"
            )
        return self

    @property
    def decoupled(self) -> bool:
        """Whether the trust region is measured against the proximal policy (see trust_region)."""
        if self.trust_region != "auto":
            return self.trust_region == "proximal"
        return self.name == "gspo" or self.mismatch_correction != "none"


class DraftConfig(Config):
    """`[trainer.draft]`: online training of the model's MTP draft modules (`model.mtp_depth` > 0), the drafts of
    speculative decoding (arbor.trainer.draft). Their loss never changes the policy's loss or gradients."""

    enabled: bool = True
    """Train the MTP modules every step when the model has them; false keeps them as loaded (frozen)."""
    top_k: Count = Field(16, ge=1, le=1024)
    """K of the top-K KL: the drafts are fitted to the policy's probabilities of its K most likely next tokens
    and of all the others together."""
    weight: Float = Field(1.0, gt=0)
    """Multiplies the draft loss (it only reaches the MTP modules' gradients)."""


class IndexerConfig(Config):
    """`[trainer.indexer]`: training the lightning indexer of a DeepSeek sparse attention model (DeepSeek-V3.2,
    GLM-5) with its KL loss to the main attention over the keys it selects (arbor.models.dsa_indexer_loss). The
    indexer reads detached hidden states, so this loss never changes the policy's loss or gradients, and its
    gradients are clipped as their own group (`indexer/grad_norm`)."""

    train: bool = False
    """Train the indexer every RL step (reported as `indexer/kl`, the mean per query and layer); false keeps its
    weights as loaded (the RL loss never reaches them: top-k is not differentiable). Needs a DSA model."""
    weight: Float = Field(1.0, gt=0)
    """Multiplies the indexer loss (the sum over layers of each layer's mean KL; it only reaches the indexers'
    gradients, so it sets their step size relative to their clipping, not a trade-off with the policy)."""


class CheckpointConfig(Config):
    interval: Int = Field(10, ge=1)
    """Save trainer state every this many steps (and at the last step)."""
    keep: Int = Field(2, ge=1)
    """Checkpoints to retain."""
    on_damage: Literal["previous", "fail"] = "previous"
    """What a resume does with a checkpoint that fails verification (a checksum or size against its manifest, a
    missing file, a damaged orchestrator state): "previous" says so in one line, moves the step aside to
    `checkpoints/step_N.damaged/` (kept, never deleted; counted as `ckpt/damaged`) and resumes from the newest
    intact one; "fail" stops the resume on that line."""


class TrainerConfig(Config):
    """Trains the policy on the orchestrator's batches and publishes its weights after every step."""

    model: ModelConfig = ModelConfig()
    """The model to train."""
    output_dir: FilePath = Path("outputs/run")
    """Run directory shared with the orchestrator."""
    max_steps: Int = Field(20, ge=1)
    """Optimizer steps to take."""
    max_minutes: Float | None = Field(None, gt=0)
    """Wall-clock budget in minutes (None: none), counted as the rows' `elapsed_s` (arbor.monitor.metrics.RunClock:
    from this process's start, going on across a resume): the first step that ends past it is checkpointed and
    training stops there, writing `stopped.json` so that the orchestrator stops too."""
    seed: Seed = 0
    """Seed of anything random in training."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    """Learning-rate schedule."""
    loss: LossConfig = LossConfig()
    """Policy loss."""
    draft: DraftConfig = DraftConfig()
    """Online training of the MTP draft modules (models with `mtp_depth` > 0)."""
    indexer: IndexerConfig = IndexerConfig()
    """Training of a DeepSeek sparse attention model's lightning indexer (off by default)."""
    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    parallel: ParallelConfig = ParallelConfig()
    """Parallelism."""
    weights: WeightTransportConfig = WeightTransportConfig()
    """Weight transfer from the trainer (shared with `inference`/`trainer`; set it at the top level under `rl`)."""
    keep_broadcasts: Int = Field(3, ge=1)
    """Published weight directories to retain."""
    keep_rollouts: Int = Field(4, ge=1)
    """Rollout steps (`rollouts/step_N/`) to retain: the newest this many trained steps, plus every step not yet
    trained (rank 0 removes older ones after each step, once every rank has read them)."""
    rollout_timeout: Seconds = Field(3600.0, gt=0)
    """Seconds to wait for a step's rollouts (and, colocated, for the device: the engine asleep) before failing."""
    colocate: bool = False
    """Colocated run: wait for the device before each step, offload between steps (arbor.colocate). `rl` sets it
    from `inference.colocate`, the one place to turn it on."""
    num_threads: Ranks | None = Field(None, ge=1)
    """torch intra-op threads per rank; default: torch's choice."""
    mini_batches: Count = Field(1, ge=1)
    """Optimizer steps per batch: each rank's micro-batches are split, in order, into this many mini-batches of
    near-equal count, each with its own exact loss normaliser. Needs at least this many micro-batches per rank."""
    epochs: Count = Field(1, ge=1)
    """Passes over each batch (each pass takes mini_batches optimizer steps). With mini_batches x epochs > 1 the
    proximal policy's logprobs are computed once per batch, before the first step, with no gradient."""
    logprob_chunk_tokens: Tokens = Field(0, ge=0)
    """Tokens whose logits the trainer computes at a time when scoring a micro-batch (the lm_head is applied
    chunk by chunk and recomputed in backward, so `[tokens, vocab]` logits never exist at once); 0 = as many
    as fit one chunk's fp32 logits in 256 MiB (441 tokens at a vocabulary of 151,936)."""

    deprecated_aliases = {"scheduler": "lr_schedule"}

    @model_validator(mode="after")
    def _lora_over_files(self) -> "TrainerConfig":
        check_lora_transport(self.model, self.weights)
        return self

    @model_validator(mode="after")
    def _layout_fits_model(self) -> "TrainerConfig":
        if self.parallel.ep > 1 and self.parallel.ep_backend == "deepep" and self.model.dtype != "bfloat16":
            raise ValueError(
                f"trainer.parallel.ep_backend = 'deepep' needs model.dtype = 'bfloat16' (DeepEP dispatches bf16 "
                f"tokens only), got {self.model.dtype!r}; use ep_backend = 'all_to_all' for other dtypes"
            )
        check_transformers_path(self.model, self.parallel)
        if self.indexer.train:
            check_indexer(self.model)
        if self.parallel.cp == 1 and self.parallel.ep == 1:
            return self  # nothing to split: no need to read a checkpoint's config.json
        args = model_shape(self.model)
        if args is not None:
            check_model_split(self.parallel, args, self.model.name)
        return self
