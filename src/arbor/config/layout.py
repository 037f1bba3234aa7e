"""The trainer's parallel layout checked against its ranks and its model's shape, without torch.

The mesh (`world = dp_replicate x dp_shard x cp`, ep folded into `dp_shard x cp`) must use exactly the ranks
`rl` starts; the model must split the way the layout asks (experts over ep, attention heads over cp for
Ulysses). The shape comes from a preset (arbor.models.presets) or the checkpoint's `config.json`
(arbor.models.args; a hub id's from the Hugging Face cache, never downloaded here); a checkpoint that is not on
this machine (a cluster path checked on a laptop) is checked by the trainer when it builds the model. The trainer
applies the same rules again at start-up
(arbor.trainer.parallel), so a standalone trainer gets them too.
"""

from __future__ import annotations

from arbor.config.model import ModelConfig
from arbor.config.parallel import ParallelConfig
from arbor.models.args import DSAArgs, ModelArgs, check_cp_style
from arbor.models.families.transformers import REFUSED_SETTINGS
from arbor.models.family import UnsupportedArchitecture, family_of
from arbor.models.hub import cached_config
from arbor.models.presets import PRESETS


def model_shape(model: ModelConfig) -> ModelArgs | DSAArgs | None:
    """The architecture of `model.name`: a preset's, or its checkpoint's `config.json`; None when the
    checkpoint directory has no config.json here."""
    if model.name in PRESETS:
        return PRESETS[model.name]
    config = cached_config(model.name)
    if config is None:
        return None
    try:
        return ModelArgs.from_dir(config.parent, model.impl)
    except UnsupportedArchitecture:
        raise  # already one line naming model.name
    except (ValueError, KeyError, TypeError) as e:  # JSON errors are ValueErrors; a missing field a KeyError
        raise ValueError(f"model.name {model.name}: its config.json cannot be read ({type(e).__name__}: {e})") from None


def check_transformers_path(model: ModelConfig, parallel: ParallelConfig, prefix_merge: bool = False) -> None:
    """Refuses, in one line naming the architecture and the setting, what a checkpoint on the transformers path
    (arbor.models.families.transformers) cannot honour. Reads the checkpoint's config only when such a setting
    is on."""
    asked = {
        "trainer.parallel.ep > 1": parallel.ep > 1,
        "trainer.parallel.cp > 1": parallel.cp > 1,
        "model.router_replay = true": model.router_replay,
        'model.fp8 = "block"': model.fp8 == "block",
        "model.mtp_depth > 0": bool(model.mtp_depth),
    }
    on = [k for k, v in asked.items() if v]
    if not (on or prefix_merge) or model.name in PRESETS or model.impl == "native":
        return
    args = model_shape(model)
    if args is None or getattr(args, "impl", None) != "transformers":
        return
    if on:
        raise ValueError(
            f"{on[0]}: {args.architecture} runs on the transformers path (model.impl = {model.impl!r}), which has "
            f"no {REFUSED_SETTINGS[on[0]]}; unset it"
        )
    if args.recurrent:
        raise ValueError(
            f"orchestrator.batching.prefix_merge = true: {args.architecture} has recurrent layers "
            f"({', '.join(sorted(set(args.layer_types)))}), which cannot take a prefix tree's mask; set it to false"
        )


def check_indexer(model: ModelConfig) -> None:
    """`trainer.indexer.train = true` needs a DeepSeek sparse attention model (its lightning indexer), and one
    whose full weights train (a LoRA run freezes the indexer). A checkpoint not on this machine is checked by the
    trainer when it builds the model."""
    if model.lora is not None:
        raise ValueError("trainer.indexer.train = true: a LoRA run ([model.lora]) freezes the indexer; unset one")
    args = model_shape(model)
    if args is not None and not family_of(args).dsa:
        raise ValueError(
            f"trainer.indexer.train = true needs a DeepSeek sparse attention model; {model.name} has no lightning "
            "indexer (unset it, or use e.g. dsa-tiny)"
        )


def check_model_split(parallel: ParallelConfig, args: ModelArgs | DSAArgs, name: str) -> None:
    """Raises ValueError unless the model divides as `parallel` asks (keys named relative to the trainer)."""
    dsa = family_of(args).dsa
    if parallel.cp > 1:
        check_cp_style(parallel.cp_style, dsa)
        ulysses = parallel.cp_style == "ulysses" or (parallel.cp_style == "auto" and not dsa)
        if ulysses and args.num_attention_heads % parallel.cp:
            raise ValueError(
                f"parallel.cp ({parallel.cp}) must divide the model's num_attention_heads ({args.num_attention_heads}) "
                f"for Ulysses context parallelism (cp_style = {parallel.cp_style!r}); use cp_style = 'ring'"
            )
    if parallel.ep > 1:
        if not args.is_moe:
            raise ValueError(
                f"parallel.ep = {parallel.ep} needs a mixture-of-experts model; {name} is dense (set ep = 1)"
            )
        if args.num_experts % parallel.ep:
            raise ValueError(f"parallel.ep ({parallel.ep}) must divide the model's num_experts ({args.num_experts})")


def check_mesh(parallel: ParallelConfig, world: int, ranks: str) -> None:
    """Raises ValueError unless the mesh uses exactly `world` ranks (`ranks` says where that number comes
    from, e.g. "trainer.parallel.nproc (4)")."""
    r, c = parallel.dp_replicate, parallel.cp
    if parallel.dp_shard == -1:
        if world % (r * c):
            raise ValueError(
                f"trainer.parallel: dp_replicate ({r}) x cp ({c}) = {r * c} must divide the trainer's ranks, {ranks}"
            )
        shard = world // (r * c)
    else:
        shard = parallel.dp_shard
        if r * shard * c != world:
            raise ValueError(
                f"trainer.parallel: dp_replicate ({r}) x dp_shard ({shard}) x cp ({c}) = {r * shard * c} "
                f"must equal the trainer's ranks, {ranks}"
            )
    if (shard * c) % parallel.ep:
        raise ValueError(f"trainer.parallel.ep ({parallel.ep}) must divide dp_shard x cp ({shard} x {c} = {shard * c})")
