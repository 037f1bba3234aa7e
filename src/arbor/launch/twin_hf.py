"""The twin of a checkpoint on the transformers path (arbor.models.families.transformers: Gemma, Phi-3, OLMo,
gpt-oss, Qwen3.5, any `*ForCausalLM` arbor has no native family for): its own `config.json` with every size
shrunk and everything else kept (layer kinds and their order, sliding windows, soft-caps, RoPE scaling, biases,
norms, routing and top-k), written as a tiny random checkpoint by transformers itself, so the twin runs the same
class through the same path. Planning stays torch-free (`tiny_hf_config`); `write_tiny_hf` loads transformers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from arbor.config.loader import ConfigError
from arbor.models.hf_args import HFArgs

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM, EXPERT_INTERMEDIATE = 64, 128, 2, 32, 32
"""The tiny decoder: width 64, two heads of 32 (a head size vLLM's CPU build serves), MLPs of 128, experts of 32."""
SIZES: dict[str, int] = {
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "ffn_dim": INTERMEDIATE,
    "n_inner": INTERMEDIATE,
    "moe_intermediate_size": EXPERT_INTERMEDIATE,
    "expert_intermediate_size": EXPERT_INTERMEDIATE,
    "shared_expert_intermediate_size": EXPERT_INTERMEDIATE,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "head_dim": HEAD_DIM,
    "linear_num_key_heads": HEADS,  # gated-delta-net layers (Qwen3.5, Qwen3-Next)
    "linear_num_value_heads": HEADS,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
    "kv_lora_rank": 32,  # multi-head latent attention (DeepSeek-V3 and its kin)
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "qk_head_dim": 32,
    "v_head_dim": HEAD_DIM,
    "mamba_d_head": HEAD_DIM,  # state-space mixers (Falcon-H1, Granite 4 hybrids)
    "mamba_d_state": 16,
}
"""Size fields set wherever a config has them (under whichever name its family uses)."""
EXPERT_COUNTS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k")
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")


def tiny_hf_config(real: HFArgs, positions: int, vocab: int, special_ids: dict[str, int]) -> dict[str, Any]:
    """`real`'s config.json at a tiny size: the first layers up to the first of each layer kind (Gemma 3's five
    sliding layers and a global one, Qwen3.5's linear and full attention), per-layer lists cut to them; the
    vocabulary `vocab` with `special_ids` (pad / bos / eos) in it; experts twice the top-k, their top-k kept;
    sliding windows at most a quarter of `positions`; no quantisation (the tiny weights are written as they are)."""
    config = copy.deepcopy(real.config)
    config.pop("quantization_config", None)
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    real_layers, kinds = real.num_hidden_layers, real.layer_types
    layers = max(2, max(kinds.index(k) for k in set(kinds)) + 1)
    for key, value in list(text.items()):
        if isinstance(value, list) and len(value) == real_layers and real_layers != layers:
            text[key] = value[:layers]  # layer_types, layers_block_type, per-layer windows or RoPE flags
        elif key in LAYER_COUNTS:
            text[key] = layers
        elif key in SIZES and isinstance(value, int):
            text[key] = SIZES[key]
    if text.get("q_lora_rank"):
        text["q_lora_rank"] = 32
    kv = text.get("num_key_value_heads")
    if isinstance(kv, int):
        text["num_key_value_heads"] = 1 if kv < real.num_attention_heads else HEADS
    if "kv_lora_rank" in text and "head_dim" in text:
        text["head_dim"] = text["qk_rope_head_dim"]  # MLA configs name the rotary part head_dim
    if isinstance(text.get("mamba_n_heads"), int):  # heads x head size = the mixer's width, expand x hidden
        text["mamba_n_heads"] = int(text.get("mamba_expand", 2)) * HIDDEN // HEAD_DIM
        if isinstance(text.get("mamba_d_ssm"), int):
            text["mamba_d_ssm"] = text["mamba_n_heads"] * HEAD_DIM
    if isinstance(text.get("sliding_window"), int):
        text["sliding_window"] = min(text["sliding_window"], max(positions // 4, 8))
    n_experts = next((text[k] for k in EXPERT_COUNTS if isinstance(text.get(k), int) and text[k] > 0), 0)
    if n_experts:
        top_k = next((text[k] for k in TOP_K if isinstance(text.get(k), int)), 2)
        tiny = min(n_experts, max(2 * top_k, 4))
        tiny += tiny % 2  # ep = 2 splits them
        for key in EXPERT_COUNTS:
            if isinstance(text.get(key), int):
                text[key] = tiny
        for key in ("n_group", "topk_group"):
            if isinstance(text.get(key), int):
                text[key] = 1
        if isinstance(text.get("first_k_dense_replace"), int):
            text["first_k_dense_replace"] = min(text["first_k_dense_replace"], 1)
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    scaled = isinstance(rope, dict) and "original_max_position_embeddings" in rope  # YaRN's factor reads both
    if isinstance(text.get("max_position_embeddings"), int) and not scaled:
        text["max_position_embeddings"] = positions  # learned position tables (GPT-2, OPT) shrink with it
    text["vocab_size"] = vocab
    text.update(special_ids)
    return config


def describe_hf(config: dict[str, Any], architecture: str) -> str:
    """One phrase: the class, its layers (by kind where they differ), width, experts."""
    args = HFArgs(config, architecture)
    kinds = args.layer_types
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    mix = f" ({', '.join(f'{n} {k}' for k, n in counts.items())})" if len(counts) > 1 else ""
    parts = [architecture, f"{len(kinds)} layers{mix}"]
    parts.append(f"hidden {args.hidden_size}")
    if args.experts[0]:
        parts.append(f"{args.experts[0]} experts")
    parts.append("tied head" if args.tie_word_embeddings else "untied head")
    return ", ".join(parts)


def write_tiny_hf(config: dict[str, Any], out: Path, seed: int) -> None:
    """The tiny random checkpoint of `config` (transformers' own initialisation from `seed`), saved by
    transformers at `out` without a tokenizer (the caller adds its own)."""
    # transformers and torch only here, when a twin actually runs: planning stays light.
    import torch  # see above
    import transformers  # see above

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    arch = config["architectures"][0]
    try:
        hf_config = transformers.AutoConfig.from_pretrained(out)
        torch.manual_seed(seed)
        model = getattr(transformers, arch)(hf_config)
    except Exception as e:  # any of transformers' own checks on a config shrunk by rules it does not know
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise ConfigError(
            f"rl --twin: transformers cannot build a tiny {arch} from this checkpoint's config.json with its sizes "
            f"shrunk ({type(e).__name__}: {reason}); twin the config with --model.name qwen3-test instead"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # the twin's plan is what the user reads here
    model.save_pretrained(out)
