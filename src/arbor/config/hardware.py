"""`[hardware]` and `[plan]`: the machine's figures and the workload's assumptions that `rl plan` estimates
throughput, GPU split, idle fractions and cost from (arbor.planner). Nothing else reads them."""

from __future__ import annotations

from pydantic import Field

from arbor.config.base import Config, Float, Ranks, Seconds, Tokens


class HardwareConfig(Config):
    """Peak figures of one accelerator (a GPU; on a CPU layer, one trainer or inference thread) and its links."""

    accelerator: str = "gpu"
    """Name printed by `rl plan` (e.g. "H100 SXM")."""
    peak_tflops: Float = Field(gt=0)
    """Dense bfloat16 matrix throughput of one accelerator, TFLOP/s (H100/H200 SXM: 989)."""
    hbm_gb: Float = Field(gt=0)
    """Memory of one accelerator, GB (10^9 bytes; H100: 80, H200: 141)."""
    hbm_tb_s: Float = Field(gt=0)
    """Memory bandwidth of one accelerator, TB/s (H100 SXM: 3.35, H200: 4.8)."""
    interconnect_gb_s: Float = Field(gt=0)
    """Bandwidth one accelerator has to another node, GB/s (400 Gb/s InfiniBand per GPU: 50): the weight
    broadcast from the trainer to inference goes at this rate."""


class PlanConfig(Config):
    """What `rl plan` assumes about the workload and the software's efficiency; measured values make it exact."""

    prompt_tokens: Tokens | None = Field(None, ge=1)
    """Mean prompt length (multi-turn: the context before the last completion); default: seq_len -
    sampling.max_tokens."""
    completion_tokens: Tokens | None = Field(None, ge=1)
    """Mean tokens sampled per rollout; default: sampling.max_tokens (every rollout runs to its cap: an upper bound)."""
    env_seconds: Seconds = Field(0.0, ge=0)
    """Seconds a rollout spends in its environment (tools, sandbox, verifier), holding its inference slot."""
    acceptance: Float = Field(1.0, gt=0, le=1)
    """Share of dispatched rollouts the trainer gets (oversampling, filters and errors discard the rest;
    SemiAnalysis discarded 60 % on Qwen3-235B)."""
    train_mfu: Float = Field(0.3, gt=0, le=1)
    """Fraction of peak FLOP/s the trainer achieves (forward + backward). SemiAnalysis measured 10.5 % on
    Qwen3-235B with CPU-offloaded optimizer states; dense models on FSDP reach 30-45 %."""
    inference_mfu: Float = Field(0.4, gt=0, le=1)
    """Fraction of peak FLOP/s that prefill (and compute-bound decode) achieves."""
    decode_bandwidth: Float = Field(0.6, gt=0, le=1)
    """Fraction of memory bandwidth a decode step achieves reading the weights and the KV cache."""
    weight_bytes: Float = Field(2.0, gt=0, le=4)
    """Bytes per parameter of the inference weights (bfloat16: 2, FP8: 1)."""
    kv_bytes: Float = Field(2.0, gt=0, le=4)
    """Bytes per element of the KV cache (bfloat16: 2, FP8: 1)."""
    max_concurrency: Ranks | None = Field(None, ge=1)
    """Rollouts one inference instance decodes at once at most; default: inference.vllm.max_num_seqs, else 256."""
    host_gb_s: Float = Field(25.0, gt=0)
    """GB/s between a GPU and host memory (PCIe Gen4 x16 moves about 25): the colocated layout's cost of moving
    the trainer's state and the engine's weights out and back each step."""
