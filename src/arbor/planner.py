"""Throughput-matching planner (`rl plan`): from the model's shape, the `[hardware]` figures, the sequence lengths
and the batch size, estimates the trainer's and the generator's samples/s, the split of GPUs between them that
matches the two, the idle fraction each side will see, the step time and the dollars per million tokens.

A roofline model, no measurement (docs/planner.md states its assumptions and compares it with published runs):
- trainer: 3 x the forward FLOPs of each sequence (matmuls over the active parameters + causal attention) at
  `plan.train_mfu` of peak, then one weight broadcast per step over the interconnect;
- generator: per inference instance (the fewest GPUs, from the configured tensor parallelism up in powers of two,
  whose memory holds the weights with room for a KV cache), concurrency is bounded by the KV cache, by the
  server's sequence cap and by the rollouts the orchestrator keeps in flight; a decode step costs the larger of
  reading weights + KV cache at `plan.decode_bandwidth` of HBM bandwidth and its FLOPs at `plan.inference_mfu`;
  prefill is compute-bound; a group ends with its longest rollout (`sampling.max_tokens`), so the rollouts in
  flight over that latency bound the rate too; environment seconds hold a slot; `plan.acceptance` of the rollouts reach
  the trainer;
- disaggregated pools run at the slower pool's rate, the faster one idles the rest; a colocated layout (trainer and
  vLLM on the same GPUs) alternates, so the rate is the harmonic combination of the two.
Nothing here imports torch: `rl plan` answers in well under a second.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arbor.config.base import ConfigError
from arbor.config.layout import model_shape
from arbor.config.rl import RLConfig
from arbor.models.args import DSAArgs, ModelArgs
from arbor.models.published import PUBLISHED_SHAPES, PUBLISHED_VISION
from arbor.models.vision_params import vision_tower_params

WEIGHT_SHARE = 0.8
"""Largest share of an instance's usable memory the weights may take (the rest is KV cache and activations)."""
DEFAULT_CONCURRENCY = 256
"""vLLM's default `max_num_seqs`."""
TRAIN_BYTES = 16
"""Trainer memory per parameter: bfloat16 weights and gradients, float32 master weights and two Adam moments."""
TRAIN_PHASE_BYTES = 8
"""A colocated trainer's device memory per parameter during its step: float32 weights and gradients; the Adam
moments stay in host memory and come to the device one parameter at a time (arbor.trainer.optim)."""
SPLIT_CEILING = 0.9
"""Most of a GPU the split layout's two processes take together (vLLM's default gpu_memory_utilization)."""


@dataclasses.dataclass
class ModelFigures:
    """What the throughput arithmetic needs of an architecture."""

    total_params: int
    active_params: int
    """Parameters in a token's matmuls (routed experts: only the top-k; the input embedding is a lookup)."""
    routed_params: int
    """Parameters of all routed experts (read in part by a decode step, depending on the tokens in flight)."""
    experts: int
    top_k: int
    kv_elems: int
    """KV-cache elements per token, all layers."""
    attn_flops: int
    """Forward attention FLOPs per token per attended position, all layers."""
    window: int | None
    """Positions a token attends at most (DeepSeek sparse attention's index_topk); None: all before it."""
    vision_params: int = 0
    """A vision-language model's vision tower (in `total_params`: held, trained and published with the decoder;
    not in `active_params`: it runs per image patch, not per text token)."""


def model_figures(args: ModelArgs | DSAArgs, vision_params: int = 0) -> ModelFigures:
    """The figures of `args` (arbor's args, or a transformers checkpoint's HFArgs: dense, its experts inside
    transformers' modules) with a vision tower of `vision_params` parameters."""
    h, L = args.hidden_size, args.num_hidden_layers
    moe_layers = len(getattr(args, "moe_layers", ()))
    n_experts = getattr(args, "num_experts", 0)
    expert = 3 * h * getattr(args, "moe_intermediate_size", 0)
    routed = moe_layers * n_experts * expert
    idle_experts = moe_layers * (n_experts - args.num_experts_per_tok) * expert if args.is_moe else 0
    embedding = 0 if args.tie_word_embeddings else args.vocab_size * h
    total = args.num_params() + vision_params
    if isinstance(args, DSAArgs):
        kv, window = L * args.cache_width, args.index_topk
        attn = 2 * L * args.num_attention_heads * (args.qk_head_dim + args.v_head_dim)
    else:
        kv, window = 2 * L * args.num_key_value_heads * args.head_dim, None
        attn = 4 * L * args.num_attention_heads * args.head_dim
    return ModelFigures(
        total,
        total - idle_experts - embedding - vision_params,
        routed,
        max(n_experts, 1),
        args.num_experts_per_tok if args.is_moe else 1,
        kv,
        attn,
        window,
        vision_params,
    )


def vision_params(name: str, args: ModelArgs | DSAArgs) -> int:
    """The vision tower's parameters of model `name`: from its checkpoint's config (a transformers checkpoint's
    HFArgs keeps it), else arbor's table of published vision configs; 0 for a text-only model."""
    config = getattr(args, "config", None) or PUBLISHED_VISION.get(name)
    return (vision_tower_params(config) or 0) if config else 0


def attended(tokens: float, window: int | None) -> float:
    """Sum over a sequence's positions of the positions each attends (causal, capped by the window)."""
    if window is None or tokens <= window:
        return tokens * tokens / 2
    return window * window / 2 + (tokens - window) * window


def forward_flops(m: ModelFigures, tokens: float) -> float:
    return 2 * m.active_params * tokens + m.attn_flops * attended(tokens, m.window)


@dataclasses.dataclass
class Layout:
    """The GPUs of each pool as the config lays them out."""

    trainer_gpus: int
    inference_gpus: int
    colocated: bool
    unit: int
    """GPUs the trainer pool grows by (a node in the multi-node layout)."""
    memory_share: float
    """Share of an inference GPU's memory the server may use (vLLM's gpu_memory_utilization)."""


def layout(cfg: RLConfig) -> Layout:
    slurm, inf, nproc = cfg.slurm, cfg.inference, cfg.trainer.parallel.nproc
    backend = inf.engine_backend()
    share = backend.memory_share(inf)
    if slurm is not None and slurm.inference_nodes:
        if not slurm.gpus_per_node:
            raise ConfigError("rl plan: slurm.gpus_per_node is 0: set the GPUs of a node to plan a multi-node run")
        trainer = cfg.cost.trainer_gpus or nproc * slurm.trainer_nodes
        inference = cfg.cost.inference_gpus or slurm.inference_nodes * slurm.gpus_per_node
        return Layout(trainer, inference, False, slurm.gpus_per_node, share)
    if backend.colocated:  # one node: the server (vLLM's) shares the trainer's GPUs
        return Layout(nproc, nproc, True, 1, share)
    return Layout(cfg.cost.trainer_gpus or nproc, cfg.cost.inference_gpus or inf.replicas, False, 1, share)


def trainer_rate(cfg: RLConfig, m: ModelFigures, gpus: int, seq: float) -> tuple[float, float]:
    """(samples/s of compute alone, seconds of one step's weight broadcast)."""
    hw, plan = _hardware(cfg), cfg.plan
    compute = gpus * hw.peak_tflops * 1e12 * plan.train_mfu / (3 * forward_flops(m, seq))
    broadcast = m.total_params * plan.weight_bytes / (hw.interconnect_gb_s * 1e9)
    return compute, broadcast


class DoesNotFit(ValueError):
    """The inference GPUs cannot hold the model's weights (the message says by how much)."""


def instance_gpus(cfg: RLConfig, m: ModelFigures, share: float, gpus: int) -> int:
    hw = _hardware(cfg)
    weights = m.total_params * cfg.plan.weight_bytes
    size = cfg.inference.vllm.tensor_parallel_size
    while weights > WEIGHT_SHARE * size * hw.hbm_gb * 1e9 * share:
        size *= 2
    if size > gpus:
        raise DoesNotFit(
            f"the model's weights ({weights / 1e9:.0f} GB at plan.weight_bytes = "
            f"{cfg.plan.weight_bytes:g}) need {size} GPU(s) of {hw.hbm_gb:g} GB (at {share:g} of their "
            f"memory, from tensor_parallel_size {cfg.inference.vllm.tensor_parallel_size} up in powers "
            f"of two); the inference pool has {gpus}"
        )
    return size


def generator_rate(
    cfg: RLConfig, m: ModelFigures, gpus: int, share: float, tokens: tuple[float, float]
) -> dict[str, Any]:
    """Samples/s of `gpus` inference GPUs (`tokens`: mean prompt and completion), with what bounds it."""
    hw, plan, (prompt, completion) = _hardware(cfg), cfg.plan, tokens
    size = instance_gpus(cfg, m, share, gpus)
    instances = gpus // size
    kv_room = size * hw.hbm_gb * 1e9 * share - m.total_params * plan.weight_bytes
    held = prompt + completion / 2  # a rollout's mean KV footprint while it decodes
    by_memory = kv_room / (m.kv_elems * plan.kv_bytes * held)
    cap = plan.max_concurrency or cfg.inference.vllm.max_num_seqs or DEFAULT_CONCURRENCY
    in_flight = cfg.orchestrator.batch_size * (cfg.orchestrator.max_off_policy_steps + 1) / instances
    bounds = {"KV cache": by_memory, "server's max_num_seqs": cap, "rollouts in flight": in_flight}
    bound = min(bounds, key=bounds.__getitem__)
    slots = max(1.0, bounds[bound])
    touched = min(1.0, slots * m.top_k / m.experts)  # share of routed experts a decode step reads
    ctx = min(held, m.window or held)
    read = (m.total_params - m.routed_params * (1 - touched)) * plan.weight_bytes
    read += slots * ctx * m.kv_elems * plan.kv_bytes
    memory_s = read / (size * hw.hbm_tb_s * 1e12 * plan.decode_bandwidth)
    flops = size * hw.peak_tflops * 1e12 * plan.inference_mfu
    compute_s = slots * (2 * m.active_params + m.attn_flops * ctx) / flops
    step = max(memory_s, compute_s)
    prefill = forward_flops(m, prompt) / flops
    cycle = completion * step + plan.env_seconds + slots * prefill
    # A group is done when its longest rollout is (sampling.max_tokens): the rollouts in flight, spread over the
    # off-policy window, bound the rate by that latency however many slots are free.
    straggler = cfg.orchestrator.sampling.max_tokens * step + plan.env_seconds + slots * prefill
    by_slots, by_stragglers = instances * slots / cycle, instances * in_flight / straggler
    return {
        "rate": plan.acceptance * min(by_slots, by_stragglers),
        "rate_bound": "free slots" if by_slots <= by_stragglers else "longest rollouts (stragglers)",
        "instance_gpus": size,
        "instances": instances,
        "slots": slots,
        "slots_by_memory": by_memory,
        "slots_bound": bound,
        "decode_tok_s": instances * slots / step,
        "decode_bound": "memory" if memory_s >= compute_s else "compute",
    }


def lengths(cfg: RLConfig) -> tuple[float, float]:
    completion = cfg.plan.completion_tokens or cfg.orchestrator.sampling.max_tokens
    prompt = cfg.plan.prompt_tokens or max(1, cfg.seq_len - cfg.orchestrator.sampling.max_tokens)
    return float(prompt), float(completion)


def balance(
    cfg: RLConfig, m: ModelFigures, trainer_gpus: int, inference_gpus: int, share: float, colocated: bool
) -> dict[str, Any]:
    """The steady state of one split: each side's rate, the run's rate and each side's idle fraction."""
    prompt, completion = lengths(cfg)
    compute, broadcast = trainer_rate(cfg, m, trainer_gpus, prompt + completion)
    batch = cfg.orchestrator.batch_size
    trainer = batch / (batch / compute + broadcast)
    gen = generator_rate(cfg, m, inference_gpus, share, (prompt, completion))
    rate = 1 / (1 / trainer + 1 / gen["rate"]) if colocated else min(trainer, gen["rate"])
    return {
        "trainer": trainer,
        "generator": gen,
        "rate": rate,
        "trainer_wait": 1 - rate / trainer,
        "generator_idle": 1 - rate / gen["rate"],
        "step_s": batch / rate,
    }


def matched_split(cfg: RLConfig, m: ModelFigures, lay: Layout) -> tuple[int, int, dict[str, Any]] | None:
    """The trainer/inference split of the same GPUs (trainer in whole units, enough of them to hold the trainer's
    state) with the highest rate."""
    total = lay.trainer_gpus + (0 if lay.colocated else lay.inference_gpus)
    best = None
    for trainer in range(lay.unit, total, lay.unit):
        if m.total_params * TRAIN_BYTES / trainer > cfg.hardware.hbm_gb * 1e9:
            continue
        try:
            b = balance(cfg, m, trainer, total - trainer, 0.9 if lay.colocated else lay.memory_share, False)
        except DoesNotFit:  # the inference side of this split cannot hold the model
            continue
        if best is None or b["rate"] > best[2]["rate"]:
            best = (trainer, total - trainer, b)
    return best


def plan(cfg: RLConfig) -> dict[str, Any]:
    """Every figure `rl plan` prints, for the config as laid out and for the matched split."""
    _hardware(cfg)
    args = model_shape(cfg.model) or PUBLISHED_SHAPES.get(cfg.model.name)
    if args is None:
        raise ConfigError(
            f"rl plan: model.name {cfg.model.name}: its shape is unknown here (not a preset, no "
            "config.json in the Hugging Face cache or the directory)"
        )
    m = model_figures(args, vision_params(cfg.model.name, args))
    lay = layout(cfg)
    try:
        now, misfit = balance(cfg, m, lay.trainer_gpus, lay.inference_gpus, lay.memory_share, lay.colocated), None
    except DoesNotFit as e:
        now, misfit = None, str(e)
    gpus = lay.trainer_gpus + (0 if lay.colocated else lay.inference_gpus)
    prompt, completion = lengths(cfg)
    tokens_s = now["rate"] * (prompt + completion) if now else 0.0
    price = cfg.cost.gpu_hour_usd
    # sharded over the trainer's GPUs; taking turns, the step holds weights and gradients only (Adam on the host)
    per_param = TRAIN_PHASE_BYTES if lay.colocated and cfg.inference.colocate else TRAIN_BYTES
    train_gb = m.total_params * per_param / lay.trainer_gpus / 1e9
    return {
        "model": cfg.model.name,
        "colocate": cfg.inference.colocate,
        "figures": m,
        "layout": lay,
        "gpus": gpus,
        "now": now,
        "misfit": misfit,
        "prompt": prompt,
        "completion": completion,
        "tokens_s": tokens_s,
        "train_gb": train_gb,
        "train_bytes": per_param,
        "hbm_gb": cfg.hardware.hbm_gb,
        "matched": matched_split(cfg, m, lay),
        "shared": shared_gpu(cfg, m, lay),
        "usd_per_mtok": price * gpus / 3600 / tokens_s * 1e6 if price and now else None,
    }


def shared_gpu(cfg: RLConfig, m: ModelFigures, lay: Layout) -> dict[str, dict[str, Any]] | None:
    """Trainer and inference on the same GPUs, both ways: `split` (each holds its memory all along: vLLM the
    `gpu_memory_utilization` share, or with `inference.colocate` the most the trainer's resident state leaves
    under SPLIT_CEILING) and `colocated` (they take turns: the train phase holds TRAIN_PHASE_BYTES per parameter,
    the generate phase gives vLLM its share of the whole GPU, and each step moves the trainer's state and the
    engine's weights out and back at `plan.host_gb_s`). Per layout: whether it fits and why not, the KV cache
    it leaves per instance and the rollouts that holds, the step time. None unless the layout shares GPUs."""
    if not lay.colocated:
        return None
    hbm, plan, inf = cfg.hardware.hbm_gb * 1e9, cfg.plan, cfg.inference
    n = lay.trainer_gpus
    resident, turns = m.total_params * TRAIN_BYTES / n, m.total_params * TRAIN_PHASE_BYTES / n
    share = inf.vllm.gpu_memory_utilization
    weights = m.total_params * plan.weight_bytes / inf.vllm.tensor_parallel_size
    # the split beside a colocated config: vLLM gets what the resident trainer leaves under the ceiling
    split_room = SPLIT_CEILING * hbm - weights if inf.colocate else (1 - share) * hbm
    split_share = SPLIT_CEILING - resident / hbm if inf.colocate else share
    out: dict[str, dict[str, Any]] = {}
    for name, trainer_gb, room, gen_share in (
        ("colocated", turns, hbm, share if inf.colocate else SPLIT_CEILING),
        ("split", resident, split_room, split_share),
    ):
        row: dict[str, Any] = {"trainer_gb": trainer_gb / 1e9, "trainer_room_gb": room / 1e9, "share": gen_share}
        if trainer_gb > room:
            beside = ""
            if name == "split":
                beside = (
                    f" beside vLLM's {weights / 1e9:.1f} GB of weights" if inf.colocate else f" beside vLLM's {share:g}"
                )
            row["misfit"] = (
                f"the trainer needs {trainer_gb / 1e9:.1f} GB per GPU, {room / 1e9:.1f} GB are left it{beside}"
            )
        else:
            try:
                b = balance(cfg, m, n, n, gen_share, True)
            except DoesNotFit as e:
                row["misfit"] = str(e)
            else:
                gen = b["generator"]
                size = gen["instance_gpus"]
                row["kv_gb"] = (size * hbm * gen_share - m.total_params * plan.weight_bytes) / 1e9
                row["kv_rollouts"] = gen["slots_by_memory"]
                moved = 0.0
                if name == "colocated":  # weights out and in, the state per step in and out, vLLM's weights too
                    moved = 2 * (m.total_params * 12 / n + m.total_params * plan.weight_bytes / size)
                row["swap_s"] = moved / (plan.host_gb_s * 1e9)
                row["step_s"] = b["step_s"] + row["swap_s"]
        out[name] = row
    return out


def _shared_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    shared = p.get("shared")
    if shared is None:
        return []
    rows = []
    for name, what in (("colocated", "taking turns"), ("split", "memory split")):
        r = shared[name]
        head = f"trainer {r['trainer_gb']:.4g} of {r['trainer_room_gb']:.4g} GB"
        if "misfit" in r:
            rows.append((f"{name} ({what})", f"does not fit: {r['misfit']}"))
            continue
        rows.append(
            (
                f"{name} ({what})",
                f"fits: {head}; vLLM {r['share']:.2g} of the GPU leaves a {r['kv_gb']:.4g} GB KV cache "
                f"({r['kv_rollouts']:.0f} rollouts); step {r['step_s']:.4g} s"
                + (f" ({r['swap_s']:.2g} s moving state to and from the host)" if r["swap_s"] else ""),
            )
        )
    return rows


def _hardware(cfg: RLConfig):
    if cfg.hardware is None:
        raise ConfigError(
            "rl plan needs a [hardware] table (peak_tflops, hbm_gb, hbm_tb_s, interconnect_gb_s): "
            "add a layer such as configs/hardware/8xgpu-node.toml"
        )
    return cfg.hardware


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def table(p: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) rows, in the order `rl plan` prints them."""
    m, lay, now = p["figures"], p["layout"], p["now"]
    pools = (
        f"{lay.trainer_gpus} GPU(s) shared by trainer and inference"
        if lay.colocated
        else f"{lay.trainer_gpus} trainer + {lay.inference_gpus} inference"
    )
    fits = "fits" if p["train_gb"] <= p["hbm_gb"] else "exceeds the GPU's memory: offload the optimizer or add GPUs"
    tower = f" ({m.vision_params / 1e9:.3g}B of them the vision tower)" if m.vision_params else ""
    rows = [
        (
            "model",
            f"{p['model']}: {m.total_params / 1e9:.3g}B parameters{tower}, {m.active_params / 1e9:.3g}B per token",
        ),
        ("sequence", f"{p['prompt']:.0f} prompt + {p['completion']:.0f} completion tokens"),
        ("GPUs", pools),
        (
            "trainer state",
            f"{p['train_gb']:.4g} GB per GPU ({p['train_bytes']} bytes/parameter"
            + (", Adam moments in host memory" if p["train_bytes"] == TRAIN_PHASE_BYTES else "")
            + f"), {fits}",
        ),
    ]
    if now is None:
        return rows + [("inference", f"does not fit: {p['misfit']}"), _matched_row(p)]
    gen = now["generator"]
    rows += [
        (
            "inference instance",
            f"{gen['instance_gpus']} GPU(s) x {gen['instances']}, "
            f"{gen['slots']:.0f} rollouts each, bound by the {gen['slots_bound']} "
            f"(KV cache holds {gen['slots_by_memory']:.0f})",
        ),
        ("decode", f"{gen['decode_tok_s']:.4g} tokens/s, {gen['decode_bound']}-bound"),
        ("trainer samples/s", f"{now['trainer']:.4g}"),
        ("generator samples/s", f"{gen['rate']:.4g}, bound by the {gen['rate_bound']}"),
        ("run samples/s", f"{now['rate']:.4g} ({p['tokens_s']:.4g} tokens/s)"),
        ("step time", f"{now['step_s']:.4g} s"),
        ("trainer wait", _pct(now["trainer_wait"])),
        ("generator idle", _pct(now["generator_idle"])),
        ("$/Mtok", "n/a: set [cost] gpu_hour_usd" if p["usd_per_mtok"] is None else f"{p['usd_per_mtok']:.4g}"),
    ]
    return rows + [_matched_row(p)]


def _matched_row(p: dict[str, Any]) -> tuple[str, str]:
    if p["matched"] is None:
        why = (
            "one GPU cannot be split"
            if p["gpus"] < 2
            else "no split of these GPUs holds both the trainer's state and the inference weights"
        )
        return ("matched split", f"none: {why}")
    t, i, b = p["matched"]
    split = "disaggregated: " if p["layout"].colocated else ""
    return (
        "matched split",
        f"{split}{t} trainer + {i} inference: {b['rate']:.4g} samples/s, trainer wait "
        f"{_pct(b['trainer_wait'])}, generator idle {_pct(b['generator_idle'])}",
    )


def advice(p: dict[str, Any]) -> str:
    """One sentence: what to change for the next run, by the planner's figures."""
    now, matched, shared = p["now"], p["matched"], p.get("shared")
    if shared is not None:
        turns, split = shared["colocated"], shared["split"]
        colocate = p["colocate"]
        if not colocate and "misfit" not in turns and ("misfit" in split or turns["step_s"] < split["step_s"]):
            return "set inference.colocate = true: " + (
                "the split does not fit" if "misfit" in split else "the GPUs taking turns serve it faster"
            )
        if colocate and "misfit" in turns and "misfit" not in split:
            return "set inference.colocate = false: only the memory split fits"
    if now is None:
        return "the model does not fit this layout's inference GPUs" + (
            f": split them {matched[0]} trainer + {matched[1]} inference"
            if matched
            else ": use more GPUs (a multi-node layer) or FP8 weights (plan.weight_bytes = 1)"
        )
    if matched is not None and matched[2]["rate"] > 1.05 * now["rate"]:
        t, i, b = matched
        return (
            f"move to {t} trainer + {i} inference GPUs: {b['rate'] / now['rate']:.2f}x the samples/s "
            f"({b['rate']:.4g} vs {now['rate']:.4g})"
        )
    if p["layout"].colocated:
        return (
            f"colocated: the GPUs train {_pct(1 - now['trainer_wait'])} and generate "
            f"{_pct(1 - now['generator_idle'])} of the time; keep it"
        )
    gen = now["generator"]
    if now["trainer_wait"] > 0.1 and gen["rate_bound"].startswith("longest"):
        return (
            "generation-bound by the longest rollouts: raise orchestrator.max_off_policy_steps (more rollouts in "
            "flight) or lower sampling.max_tokens; more inference GPUs would not help"
        )
    if now["trainer_wait"] > 0.1 and gen["slots_bound"] == "rollouts in flight":
        return (
            "generation-bound by the rollouts in flight: raise orchestrator.max_off_policy_steps (or batch_size) "
            "so that the inference GPUs have more to decode"
        )
    if now["trainer_wait"] > 0.1:
        return "generation-bound: give inference more GPUs or shorter completions"
    if now["generator_idle"] > 0.1:
        return "trainer-bound: give the trainer more GPUs, or raise max_off_policy_steps to keep generating"
    return "balanced: keep the split"


def render(p: dict[str, Any]) -> str:
    rows = table(p) + _shared_rows(p) + [("advice", advice(p))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
