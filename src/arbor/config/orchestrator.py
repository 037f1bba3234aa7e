"""`orchestrator` process config: rollouts, rewards, advantages, batching and the off-policy bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from arbor.config.admin import AdminToken
from arbor.config.base import (
    Config,
    Count,
    FilePath,
    Float,
    Int,
    Port,
    Ranks,
    Seconds,
    Seed,
    Temperature,
    Tokens,
    warn_config,
    warn_deprecated,
)
from arbor.config.environment import EnvironmentConfig
from arbor.config.eval import OrchestratorEvalConfig
from arbor.config.model import ModelConfig
from arbor.config.monitor import WandbConfig
from arbor.registry import ADVANTAGES, MODES, PER_STEP_MODES


class SamplingConfig(Config):
    temperature: Temperature = 1.0
    """Sampling temperature (0: greedy); the trainer scales its logits by the same value."""
    max_tokens: Tokens = Field(64, ge=1)
    """Most tokens generated per completion."""
    top_p: Float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (ignored at temperature 0). Below 1 the tokens come from the truncated, renormalised
    distribution, and that is the one whose logprobs both backends report (vLLM's `processed_logprobs`, the
    local engine alike) and the trainer scores (it renormalises its own distribution over its top-p nucleus), so
    importance ratios compare the same kind of probability and the policy trained is the one sampled."""


class ClientConfig(Config):
    base_urls: list[str] = ["http://127.0.0.1:8000"]
    """Inference servers (or one router). `rl` fills this in."""
    admin_urls: list[str] = []
    """Where weight updates, pause and resume go when not to `base_urls` (e.g. every backend behind a router
    without admin fan-out, such as vllm-router); empty means `base_urls`. `rl` fills this in."""
    admin_token: AdminToken | None = Field(None, exclude=True)
    """Bearer token sent with admin calls (the servers' `admin_token`). Secret: never written out
    (`ARBOR_CLIENT__ADMIN_TOKEN` sets it; `rl` passes the run's token that way)."""
    timeout: Seconds = Field(600.0, gt=0)
    """Seconds one generation request may take."""
    max_retries: Count = Field(3, ge=0)
    """Retries of a failed request (connection errors and 5xx) before the run fails."""
    max_failed_groups: Count = Field(8, ge=0)
    """Groups in a row whose generation failed for good (a request the fleet rejected with a 4xx, or one that failed
    all `max_retries`) that are skipped, each logged and counted in `generate/failed_groups`, before the run fails
    with the last error; 0 fails at the first."""
    reconnect_timeout: Seconds = Field(600.0, gt=0)
    """Seconds a request waits for a server that refuses or drops connections (its process died and is being
    restarted) to answer /health again; the server then gets the fleet's current weights before it serves. Unset
    under `rl`: at least `inference_startup_timeout` plus the restart back-off."""


class AdvantageConfig(Config):
    name: str = "grpo"
    """Advantage function: a built-in (arbor.registry.ADVANTAGES, each a rollout's reward against a baseline from
    its own group): "grpo" (reward minus group mean; divided by the group std with std_normalize), "drgrpo"
    (Dr. GRPO: mean baseline, never std-normalised), "rloo" (leave-one-out mean baseline); or a dotted path
    `module:function` implementing arbor.orchestrator.advantages.AdvantageFn."""
    std_normalize: bool = False
    """Divide by the group's reward standard deviation (GRPO); off is Dr. GRPO's unbiased choice."""
    std_ddof: Literal[0, 1] = 0
    """Delta degrees of freedom of that standard deviation: 0 = the population std (numpy's default), 1 = the
    sample std (torch.std's default, as in the GRPO reference code); a group of one with ddof 1 gets std 0."""
    gamma: Float = Field(1.0, ge=0, le=1)
    """Discount of reward-to-go for rollouts with per-turn/process rewards: a token's advantage is the discounted
    sum of the group-normalised rewards of its turn and the turns after it."""
    completion_time_weight: Float = Field(0.0, ge=0)
    """Composite reward: a rollout with positive reward gains up to this much for finishing faster than the other
    successful rollouts of its group (relative completion time: latency when measured, else completion tokens).
    With per-turn rewards the bonus is added to the last turn's reward (the episode's outcome)."""

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        try:
            ADVANTAGES.check(name)
        except ValueError as e:  # the registry names the field as `rl` spells it; the loader names where it is
            raise ValueError(str(e).removeprefix(f"{ADVANTAGES.field}: ")) from None
        return name


class BatchingConfig(Config):
    micro_batch_tokens: Tokens = Field(4096, ge=16)
    """Token budget of one packed micro-batch row; a longer sample gets a row of its own."""
    trainer_ranks: Ranks = Field(1, ge=1)
    """Trainer data-parallel ranks to write a file for; `rl` sets it from the trainer's world size."""
    min_micro_batches: Count = Field(1, ge=1)
    """Micro-batches each rank's file holds at least (rows are packed to a smaller budget until they are, as far
    as the step's samples allow); `rl` sets it from `trainer.mini_batches`, since each optimizer step of a
    batch takes micro-batches of its own."""
    normalization: Literal["token", "sequence", "group"] = "token"
    """Loss normalisation, written into the batch as per-token weights: "token" = mean over the step's loss
    tokens (DAPO), "sequence" = mean over samples of each sample's token mean (GRPO, GSPO), "group" = mean over
    groups of each group's token mean. Unset under `rl` with `trainer.loss.name = "gspo"`: "sequence" (the
    paper's mean over sequences); set it to override."""
    prefix_merge: bool = False
    """Prefix-tree merging: samples of a row that share token prefixes (multi-turn histories, a common system
    prompt) are merged into a trie and trained once per shared token, with a tree attention mask; the loss,
    gradients and metrics stay those of the unmerged samples. The row budget (`micro_batch_tokens`) counts trie
    tokens. With router replay, samples share a prefix only where their routed experts agree too. Not with
    context parallelism (`trainer.parallel.cp > 1`)."""


class FilterConfig(Config):
    drop_zero_advantage: bool = False
    """Drop groups whose advantages are all zero (every rollout scored the same: no learning signal), and
    generate replacements."""
    min_solve_rate: Float = Field(0.0, ge=0, le=1)
    """Online difficulty filtering: drop groups whose solve rate (fraction of rollouts with reward >=
    solve_threshold) is below this."""
    max_solve_rate: Float = Field(1.0, ge=0, le=1)
    """Online difficulty filtering: drop groups whose solve rate is above this."""
    solve_threshold: Float = 1.0
    """A rollout with at least this reward counts as solving its task (solve rates, curriculum, difficulty mix)."""

    @model_validator(mode="after")
    def _range(self) -> "FilterConfig":
        if self.min_solve_rate > self.max_solve_rate:
            raise ValueError(f"min_solve_rate ({self.min_solve_rate}) exceeds max_solve_rate ({self.max_solve_rate})")
        return self


class CurriculumConfig(Config):
    enabled: bool = False
    """Sample tasks from easy / normal / hard pools by their recent solve rate instead of in dataset order."""
    easy_above: Float = Field(0.8, ge=0, le=1)
    """A task whose recent solve rate is at least this is easy."""
    hard_below: Float = Field(0.2, ge=0, le=1)
    """A task whose recent solve rate is at most this is hard; unseen tasks are normal."""
    weights: tuple[Float, Float, Float] = (0.1, 0.6, 0.3)
    """Sampling weights of the easy, normal and hard pools (an empty pool's weight goes to the others)."""
    history: Count = Field(4, ge=1)
    """Recent groups per task that its solve rate averages over."""

    @model_validator(mode="after")
    def _check(self) -> "CurriculumConfig":
        if self.hard_below >= self.easy_above:
            raise ValueError(f"hard_below ({self.hard_below}) must be below easy_above ({self.easy_above})")
        if min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(f"weights {self.weights} must be non-negative with a positive sum")
        return self


class BufferConfig(Config):
    enabled: bool = False
    """Store every finished group in the persistent experience buffer and fill batches from it."""
    path: FilePath | None = None
    """SQLite file; default `<output_dir>/buffer.sqlite`."""
    order: Literal["fifo", "priority", "recency"] = "fifo"
    """Which ready groups a batch takes first: oldest, largest mean |advantage|, or newest."""
    train_only: bool = False
    """Generate nothing: train on the groups already in the buffer (needs no inference server); a step takes
    what is left when fewer than a batch remain, and the run fails when none is."""
    reuse: bool = False
    """Release every earlier claim at start, so the buffer's whole content is trainable again (another epoch)."""


class RolloutScheduleConfig(Config):
    """`[orchestrator.scheduler]`: how generation overlaps training (see arbor.orchestrator.scheduler)."""

    mode: str = "one_step_off"
    """The scheduling mode: how generation overlaps training and which finished groups a batch may take
    (arbor.orchestrator.modes, one module per mode). "sync" (on-policy: a step's generation waits for the weights
    of every step before it; see sync_interval), "one_step_off" (generation runs one step ahead of training), or
    a continuous mode, which launches groups ahead across step boundaries: "async" (strict FIFO), "greedy"
    (first finished first out), "windowed_fifo" (Forge). A user's mode: its dotted path "package.module:Class"
    (a class implementing arbor.orchestrator.scheduler.SchedulingMode). Replaces `orchestrator.async_lag`
    (0 = "sync", 1 = "one_step_off", k > 1 = "async" with `lag = k`)."""
    lag: Int | None = Field(None, ge=0)
    """Continuous modes: policy versions a step's generation may trail the step by (weights version >= step - lag
    before its groups are launched or taken). Default: max_off_policy_steps (windowed_fifo: less its slack)."""
    sync_interval: Int = Field(1, ge=1)
    """sync: every this many steps generation waits for the newest weights (1 = fully on-policy)."""
    window: Count | None = Field(None, ge=1)
    """windowed_fifo: W, in groups, of the visible part [H, H+W) of the generation queue; default: half a step.
    A group can be overtaken by up to W - 1 others, i.e. trained up to ceil(W / groups per step) steps later than
    its launch planned, so windowed_fifo launches (and takes batches) only up to max_off_policy_steps minus that
    slack ahead of the trainer (arbor.orchestrator.scheduler)."""
    max_in_flight: Count | None = Field(None, ge=1)
    """Groups generating at once. Default: two steps' worth for the continuous modes (async, greedy,
    windowed_fifo), max_concurrent_groups (or one step) for the per-step ones (times `oversample`)."""
    adaptive: bool = True
    """Live throughput matching (arbor.orchestrator.concurrency): after each step the in-flight limit rises
    while the trainer waits for rollouts and falls while finished groups queue up beyond the staleness budget,
    within [adaptive_min, adaptive_max]. Off when `max_in_flight` or `max_concurrent_groups` is set by hand (the
    user's figure is kept) or here with false."""
    adaptive_min: Count = Field(1, ge=1)
    """Lowest in-flight limit the adaptation may choose (groups)."""
    adaptive_max: Count | None = Field(None, ge=1)
    """Highest in-flight limit the adaptation may choose (groups). Default: the most the mode can use, i.e. one
    step's launches in the per-step modes, (max_off_policy_steps - slack + 1) steps' groups in the continuous
    ones (the staleness rule admits no more)."""
    weight_updates: Literal["in_flight", "between_steps"] = "in_flight"
    """When the fleet takes a new policy. "in_flight": as soon as the trainer publishes it (servers swap weights
    between decode steps, so a sample's later tokens may come from the newer policy: fresher samples, but which
    token an update lands on depends on timing). "between_steps" (per-step modes only): the fleet loads exactly
    the version a step waits for (step - lag) before that step's groups launch, and nothing while they generate,
    so every sample of a batch comes from one policy (staleness exactly the lag; the first step after a resume
    samples from the checkpoint's policy, as in_flight does) and a run with the same seed samples the same
    batches again (arbor.orchestrator.weight_sync). one_step_off keeps its overlap: the trainer
    trains step N while step N + 1 is sampled from the policy before it."""
    oversample: Float = Field(1.0, ge=1.0)
    """Per-step modes (sync, one_step_off): launch ceil(oversample x groups per step) groups; once the batch is
    full, the surplus still generating is cancelled (counted as partial/cancelled) or, with
    `[orchestrator.partial]` enabled, aborted and parked with its tokens and resumed first at the next step
    (slime's design). Surplus groups that already finished are kept for the next step."""

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str) -> str:
        MODES.check(mode)
        return mode

    @model_validator(mode="after")
    def _lag_is_continuous(self) -> "RolloutScheduleConfig":
        if self.lag is not None and self.mode in PER_STEP_MODES:
            continuous = ", ".join(n for n in MODES.names() if n not in PER_STEP_MODES)
            raise ValueError(f"lag applies to the continuous modes ({continuous}), not to {self.mode!r}")
        if self.weight_updates == "between_steps" and self.mode not in PER_STEP_MODES and ":" not in self.mode:
            raise ValueError(
                f"weight_updates = 'between_steps' needs a per-step mode (sync, one_step_off), not {self.mode!r}: "
                "a continuous mode's groups generate across step boundaries, so no point lies between steps"
            )
        if self.adaptive_max is not None and self.adaptive_max < self.adaptive_min:
            raise ValueError(f"adaptive_max ({self.adaptive_max}) is below adaptive_min ({self.adaptive_min})")
        return self


class PartialConfig(Config):
    enabled: bool = False
    """Partial rollouts: generation that is aborted mid-way keeps its tokens, logprobs and per-token policy
    versions (and its environment's state) and is resumed later (arbor.orchestrator.partial)."""
    straggler_factor: Float = Field(4.0, gt=0)
    """Continuous modes with a window (async, windowed_fifo): while a step is collected, a group inside the
    window [H, H+W) that has run longer than this many times the median duration of the last 1024 finished groups
    (no group before 8 have finished) leaves its queue position (so the head advances) and goes to the tail as
    straggler_action says. The check runs only when the loop is about to wait (nothing in the window is ready).
    benchmarks/scheduler_sim.py models exactly this rule."""
    straggler_action: Literal["resume", "retry"] = "resume"
    """What happens to a window member found straggling (straggler_factor): "resume" aborts it and continues it at
    the queue's tail with its tokens kept (partial rollout; its staleness still counts from its first token, so a
    moved group often ends up too stale and is dropped); "retry" cancels it (its tokens are discarded) and
    launches its task again, as a new group, at the tail: the task's difficulty stays in the batch mix and the
    staleness counts from the retry, at the cost of the generation thrown away and of a bias against the slowest
    samples of a task. benchmarks/scheduler_sim.py shows why windowed FIFO needs "retry" to beat greedy's mix."""
    max_resumes: Count = Field(3, ge=0)
    """A group moved or parked this many times is not aborted by the scheduler again: it finishes where it is.
    With straggler_action = "retry", a task retried this many times is given up (cancelled, counted in
    partial/given_up) when it straggles again, so no straggler can stall the window for its whole latency."""
    abort_on_weight_update: bool = False
    """Abort every running group before a weight update and resume it after: no token of the new policy is
    then computed on KV cache from older weights (needed with vLLM, which keeps in-flight KV; the local engine
    recomputes it). These pauses do not count towards max_resumes."""


LOOPBACK = ("127.0.0.1", "localhost", "::1")
"""Addresses only this machine can reach."""


class GatewayConfig(Config):
    """`[orchestrator.gateway]`: the OpenAI-compatible server black-box agents call (see
    arbor.orchestrator.gateway.service)."""

    enabled: bool = False
    """Start the gateway in the orchestrator process (the black_box environment starts it regardless)."""
    host: str = "127.0.0.1"
    """Address to bind; anything but a loopback address requires `api_key`."""
    port: Port = 0
    """Port to bind; 0 picks a free one (logged, and written to `<output_dir>/gateway_url`)."""
    api_key: str | None = None
    """Bearer token every request must carry (`OPENAI_API_KEY` for the agent); required beyond loopback."""
    max_request_bytes: Int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body accepted; bigger ones get 413."""
    max_open_sessions: Count = Field(4096, ge=1)
    """Open sessions at once; opening another gets 429."""
    override_sampling: bool = True
    """Sample at the run's temperature/top_p and at most `sampling.max_tokens`, whatever the agent asks: the
    trainer's importance ratios assume the run's sampling distribution."""
    model_name: str = "arbor"
    """The model id /v1/models lists and responses carry."""
    image_dirs: list[str] | None = None
    """Directories whose files an agent may name as images (a local path or a `file://` URL in an `image_url` /
    `input_image` part); a file outside them (symlinks followed) is refused in one 400 line. None: any file the
    orchestrator can read while the gateway binds a loopback address (agents on this machine), none beyond it
    (remote agents send data URLs). [] refuses every local path. Data URLs are always accepted."""

    @model_validator(mode="after")
    def _key_beyond_loopback(self) -> "GatewayConfig":
        if self.host not in LOOPBACK and not self.api_key:
            raise ValueError(f"api_key is required when the gateway binds {self.host!r} (beyond loopback)")
        return self


class TeacherConfig(Config):
    """`[orchestrator.teacher]`: the teacher of on-policy distillation (arbor.orchestrator.teacher). After a step's
    groups are collected, each sample's prompt + completion goes to the teacher as token ids and its logprob of
    every completion token (vLLM's `prompt_logprobs` of /v1/completions) ships in the batch, for the trainer's
    reverse-KL term (`trainer.loss.distill_weight`, or `trainer.loss.name = "distill"`), with `top_k` also its k
    most likely tokens at each position. The teacher must use the policy's tokenizer (the same token ids), and
    its context must hold seq_len + 1 tokens."""

    url: str | None = None
    """Base URL of an OpenAI-compatible server that returns prompt logprobs: arbor's `inference` (local engine) or
    vLLM (`vllm serve`), or a router in front of either. `rl` fills it in when its `[teacher]` section launches
    the teacher; otherwise required."""
    model: str | None = None
    """The model name sent with each request (vLLM checks it against its served name); unset: none is sent (the
    server's only model)."""
    timeout: Seconds = Field(600.0, gt=0)
    """Seconds one scoring request may take."""
    max_retries: Count = Field(3, ge=0)
    """Retries of a failed scoring request (connection errors, timeouts, 5xx) before the run fails."""
    max_concurrent: Count = Field(64, ge=1)
    """Scoring requests in flight at once."""
    top_k: Int = Field(0, ge=0)
    """The teacher's k most likely tokens at every completion position also ship in the batch (their ids and
    logprobs; the request's `prompt_logprobs = k`), and the trainer's distillation term sums the reverse KL over
    them exactly instead of estimating it from the sampled token alone (arbor.trainer.loss). 0: the sampled
    token's logprob only. At most what the teacher allows (arbor's local engine and vLLM's default
    `max_logprobs`: 20); needs `sampling.top_p = 1` (the top-k term is defined on the full distribution)."""
    api_key: AdminToken | None = Field(None, exclude=True)
    """Bearer token sent with every scoring request (vLLM's `--api-key`). Secret: never written out
    (`ARBOR_TEACHER__API_KEY` sets it for the orchestrator)."""


class OrchestratorConfig(Config):
    """Samples tasks, generates rollouts through the inference API, scores them and writes training batches."""

    model: ModelConfig = ModelConfig()
    """The model (the orchestrator only loads its tokenizer)."""
    output_dir: FilePath = Path("outputs/run")
    """Run directory shared with the trainer."""
    max_steps: Int = Field(20, ge=1)
    """Training steps to produce batches for."""
    seq_len: Tokens = Field(512, ge=8)
    """Longest sample (prompt + completion); longer prompts are skipped and counted."""
    seed: Seed = 0
    """Seed of task sampling and of per-request sampling seeds."""
    batch_size: Count = Field(64, ge=1)
    """Rollouts per training step (a multiple of group_size): each step trains batch_size / group_size groups of
    group_size rollouts, a rollout being one episode. For black_box an episode is one agent run, which yields one
    sample per chain of its calls (several when the agent branches its history, none when it fails), so there
    batch_size counts agent runs and a step's sample count varies."""
    group_size: Count = Field(8, ge=1)
    """Rollouts per task; advantages are relative to the group."""
    max_off_policy_steps: Int = Field(2, ge=0)
    """Drop (and count) rollouts with a token sampled more than this many policy versions before the step."""
    max_concurrent_groups: Count | None = Field(None, ge=1)
    """Groups in flight at once; default: one step's worth of groups."""
    resume: bool = False
    """Continue from the latest trainer checkpoint in output_dir."""
    weight_update_timeout: Seconds = Field(1800.0, gt=0)
    """Seconds to wait for the trainer to publish the weights a step needs before failing (colocated: to train,
    publish and hand the device back)."""
    republish_timeout: Seconds = Field(1800.0, gt=0)
    """Seconds to wait for the trainer to publish again a version the fleet refused (a checksum that does not
    match its manifest) before stopping on one line; the trainer answers between steps, so allow one step."""
    colocate: bool = False
    """Colocated run: put the fleet to sleep and hand the device to the trainer whenever the next step needs a
    newer policy (arbor.colocate). `rl` sets it from `inference.colocate`, the one place to turn it on."""
    sampling: SamplingConfig = SamplingConfig()
    """Generation settings."""
    client: ClientConfig = ClientConfig()
    """How to reach the inference servers."""
    environment: EnvironmentConfig = EnvironmentConfig()
    """The environment."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimation."""
    scheduler: RolloutScheduleConfig = RolloutScheduleConfig()
    """Scheduling of generation against training: the async mode."""
    partial: PartialConfig = PartialConfig()
    """Partial rollouts (abort, park, resume with tokens kept)."""
    buffer: BufferConfig = BufferConfig()
    """Persistent experience buffer."""
    eval: OrchestratorEvalConfig = OrchestratorEvalConfig()
    """Periodic evaluation of the served policy (off unless `interval` > 0)."""
    filters: FilterConfig = FilterConfig()
    """Groups dropped (and replaced) before they enter a batch."""
    curriculum: CurriculumConfig = CurriculumConfig()
    """Difficulty pools for task sampling."""
    batching: BatchingConfig = BatchingConfig()
    """Packing into micro-batches."""
    gateway: GatewayConfig = GatewayConfig()
    """The OpenAI-compatible gateway for black-box agents."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: the teacher whose logprobs of the samples ship in the batch (off when absent)."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases when present."""
    log_level: Literal["debug", "info", "warning"] = "info"
    """Log verbosity."""

    retired_keys = frozenset({"async_lag", "temperature"})

    @classmethod
    def retire(cls, key: str, value: Any) -> dict[str, Any]:
        """`async_lag` as the scheduler mode it meant: 0 = sync, 1 = one_step_off, k > 1 = async with lag k;
        `temperature` as `sampling.temperature`, beside the other sampling settings."""
        if key == "temperature":
            warn_deprecated("orchestrator.temperature is deprecated; use orchestrator.sampling.temperature")
            return {"sampling": {"temperature": value}}
        if key != "async_lag":
            return super().retire(key, value)
        mode = {0: "sync", 1: "one_step_off"}.get(value, "async") if isinstance(value, int) else "async"
        new = f"scheduler.mode = {mode!r}" + (f" and scheduler.lag = {value}" if mode == "async" else "")
        warn_deprecated(f"orchestrator.async_lag is deprecated; use orchestrator.{new}")
        return {"scheduler": {"mode": mode, **({"lag": value} if mode == "async" else {})}}

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        """Configs built in Python (the loader translates the keys itself): the new key, when also set, wins."""
        if not isinstance(data, dict) or not cls.retired_keys & data.keys():
            return data
        data = dict(data)
        for key in sorted(cls.retired_keys & data.keys()):
            ((table, replacement),) = cls.retire(key, data.pop(key)).items()
            current = data.get(table) or {}
            if isinstance(current, Config):
                current = current.model_dump(exclude_unset=True)
            if not isinstance(current, dict) or (key == "async_lag" and "mode" in current):
                continue  # left for validation to name; an explicit mode also decides the lag that came with it
            data[table] = {**replacement, **current}
        return data

    @model_validator(mode="after")
    def _batch_is_whole_groups(self) -> "OrchestratorConfig":
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
        # Every built-in advantage is group-relative (arbor.registry.ADVANTAGES); a plugin may need no group.
        if self.group_size == 1 and self.teacher is None and self.advantage.name in ADVANTAGES.members:
            raise ValueError(
                f"group_size = 1 with advantage.name = {self.advantage.name!r} gives every rollout an "
                "advantage of 0 (its reward minus its own group's baseline): nothing would be learned; "
                "use group_size >= 2, a teacher, or an advantage function that needs no group"
            )
        if self.sampling.max_tokens >= self.seq_len:
            raise ValueError(f"sampling.max_tokens ({self.sampling.max_tokens}) must be below seq_len ({self.seq_len})")
        if self.partial.enabled and self.environment.id == "black_box":
            # A black-box agent calls the gateway itself: arbor cannot park and resume its requests mid-way.
            raise ValueError(
                "partial.enabled cannot be used with environment.id = 'black_box' (agents drive their "
                "own generation through the gateway); set partial.enabled = false"
            )
        if self.teacher is not None and self.teacher.top_k > 0 and self.sampling.top_p < 1:
            raise ValueError(
                f"teacher.top_k = {self.teacher.top_k} needs sampling.top_p = 1 (got "
                f"{self.sampling.top_p}): the top-k distillation term is defined on the student's full "
                "distribution; set teacher.top_k = 0 or sampling.top_p = 1"
            )
        if self.sampling.top_p < 1 and not self.gateway.override_sampling:
            warn_config(
                f"orchestrator.gateway.override_sampling = false with orchestrator.sampling.top_p = "
                f"{self.sampling.top_p}: an agent that asks for another top_p or temperature samples a "
                "distribution the trainer does not score (it truncates at the run's top_p)"
            )
        return self
