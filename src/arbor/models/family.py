"""Model families: what arbor needs to know about one kind of checkpoint, found by its `config.json` architecture.

A family (`ModelFamily`) names the architectures it serves, reads and writes their Hugging Face `config.json`
into its args class, builds the model, and maps parameter names between arbor's model and the checkpoint.
`arbor.registry.MODEL_FAMILIES` lists the built-ins by architecture name; `build_model`, `model_args`,
`ModelArgs.from_dir` and arbor.models.hf dispatch through `family_for`. Adding a family is one new file (an
object satisfying `ModelFamily`) and one line in arbor/registry.py. No torch here (nor in a family's module):
the launcher's preflight and the config validation read checkpoint configs through it; a family imports its
model class and tensors when it builds or maps one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from arbor.models.quantization import quantization_refusal
from arbor.registry import MODEL_FAMILIES, TRANSFORMERS_FAMILY, load_object

if TYPE_CHECKING:  # annotations only: importing them would load torch
    import torch
    from torch import nn

IMPLS = ("auto", "native", "transformers")
"""`model.impl`: "native" builds arbor's own model (a MODEL_FAMILIES member), "transformers" transformers' own
modules (arbor.models.families.transformers), "auto" the native family where arbor has one."""

DEFAULT_ARCHITECTURE = "Qwen3ForCausalLM"
"""What a `config.json` without `architectures` (and without a known `model_type`) is read as."""


class UnsupportedArchitecture(ValueError):
    """A checkpoint no registered family serves (its architecture, or weights quantised in a format arbor does not
    dequantise); the message is one line naming `model.name`."""


@runtime_checkable
class ModelFamily(Protocol):
    """One kind of model arbor builds, trains and serves."""

    architectures: tuple[str, ...]
    """The `config.json` `architectures[0]` names it serves (its keys in MODEL_FAMILIES)."""
    model_types: tuple[str, ...]
    """The `config.json` `model_type`s it serves, for a config without `architectures` (one per architecture, in
    the same order, where it serves several)."""
    args_class: type
    """Its hyper-parameters (Hugging Face field names; an `architecture` field; `num_params()`; no torch)."""
    supports_mtp: bool
    """Whether `model.mtp_depth` can add multi-token-prediction draft modules (arbor.models.mtp)."""
    supports_moe: bool
    """Whether its checkpoints may hold routed experts (expert parallelism, router replay)."""
    dsa: bool
    """DeepSeek sparse attention (its own context-parallel style, arbor.trainer.dsa_cp)."""

    def from_hf_config(self, config: dict[str, Any]) -> Any:
        """`config.json`'s contents -> an `args_class` instance (a ValueError in one line when unsupported)."""
        ...

    def to_hf_config(self, args: Any) -> dict[str, Any]:
        """The `config.json` transformers and vLLM read for `args`."""
        ...

    def build(self, args: Any) -> "nn.Module":
        """The model (CPU, default dtype, weights uninitialised); `model.args` is `args`, and
        `model.init_weights(seed)` draws a preset's deterministic initial weights."""
        ...

    def to_hf_state(self, state: dict[str, "torch.Tensor"], args: Any) -> dict[str, "torch.Tensor"]:
        """arbor's parameter names and layouts -> the checkpoint's (identity where they agree); any subset of
        the model's tensors (a published bucket) maps on its own."""
        ...

    def from_hf_state(self, state: dict[str, "torch.Tensor"], args: Any) -> dict[str, "torch.Tensor"]:
        """A checkpoint's tensors (dequantised) -> arbor's names and layouts; tensors arbor does not hold are
        dropped here."""
        ...


def _refusal(arch: str, source: str, why: str = "") -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"model.name: {source} is a {arch!r} checkpoint; arbor builds {', '.join(MODEL_FAMILIES.names())} "
        f"natively and any *ForCausalLM class of the installed transformers{why}"
    )


def family_for(arch: str, source: str = "the model") -> ModelFamily:
    """The native family serving architecture `arch`; `source` (the checkpoint) names it in the one-line refusal."""
    if arch not in MODEL_FAMILIES.members:
        raise _refusal(arch, source)
    return MODEL_FAMILIES.load(arch)


def choose_family(
    arch: str, impl: str = "auto", source: str = "the model", config: dict[str, Any] | None = None
) -> tuple[ModelFamily, str]:
    """The one place that decides which path builds a checkpoint of architecture `arch` under `model.impl`:
    (family, one line saying which path and why). With the checkpoint's `config`, "auto" also falls back to
    transformers where the native family refuses a setting of it (a sliding window, say) and transformers builds
    the class; "native" keeps the native family's one-line refusal. An architecture neither path builds is an
    `UnsupportedArchitecture` in one line naming `model.name`, and so is a checkpoint quantised in a format arbor
    does not dequantise (arbor.models.quantization)."""
    if impl not in IMPLS:
        raise ValueError(f"model.impl: {impl!r} is not one of {', '.join(IMPLS)}")
    if config is not None and (refusal := quantization_refusal(config, source)):
        raise UnsupportedArchitecture(refusal)
    native = arch in MODEL_FAMILIES.members
    if impl != "transformers" and native:
        family = MODEL_FAMILIES.load(arch)
        refusal = _native_refusal(family, arch, config) if impl == "auto" else None
        if refusal is None or not transformers_builds(arch):
            return family, f"{arch}: arbor's native implementation (model.impl = {impl!r})"
        why = f"arbor's native family refuses this checkpoint: {refusal}; model.impl = 'auto'"
        return load_object(TRANSFORMERS_FAMILY), f"{arch}: transformers' own modules ({why})"
    if impl == "native":
        raise UnsupportedArchitecture(
            f"model.impl = 'native': {source} is a {arch!r} checkpoint and arbor's native families are "
            f"{', '.join(MODEL_FAMILIES.names())}; set model.impl = 'auto' or 'transformers'"
        )
    if not transformers_builds(arch):
        raise _refusal(arch, source, f" ({transformers_version()} has no class {arch!r})")
    why = "model.impl = 'transformers'" if impl == "transformers" else "no native family (model.impl = 'auto')"
    return load_object(TRANSFORMERS_FAMILY), f"{arch}: transformers' own modules ({why})"


def _native_refusal(family: ModelFamily, arch: str, config: dict[str, Any] | None) -> str | None:
    """Why `family` cannot read `config` (its one-line ValueError), or None when it can or no config is given."""
    if config is None:
        return None
    try:
        family.from_hf_config({**config, "architectures": [arch]})
    except ValueError as e:
        return str(e)
    return None


def transformers_builds(arch: str) -> bool:
    """Whether the installed transformers has a causal-LM class named `arch`."""
    # transformers loads torch: imported only for an architecture without a native family
    import transformers

    decoder = "CausalLM" in arch or "LMHead" in arch or arch.endswith("VLForConditionalGeneration")
    return arch.isidentifier() and decoder and hasattr(transformers, arch)


def transformers_version() -> str:
    import transformers  # see transformers_builds

    return f"transformers {transformers.__version__}"


def family_of(args: Any) -> ModelFamily:
    """The family of built args (a preset's or a checkpoint's): the transformers path's own args say so."""
    if getattr(args, "impl", None) == "transformers":
        return load_object(TRANSFORMERS_FAMILY)
    return family_for(args.architecture, f"a {type(args).__name__}")


def architecture_of(config: dict[str, Any]) -> str:
    """`config.json`'s architecture: `architectures[0]`, else the family serving its `model_type`, else
    DEFAULT_ARCHITECTURE."""
    names = config.get("architectures") or []
    if names:
        return names[0]
    model_type = config.get("model_type")
    for arch in MODEL_FAMILIES.names():
        family = MODEL_FAMILIES.load(arch)
        if model_type in family.model_types and (
            len(family.model_types) == 1 or family.model_types.index(model_type) == family.architectures.index(arch)
        ):
            return arch
    return DEFAULT_ARCHITECTURE


def args_from_config(config: dict[str, Any], source: str = "the model", impl: str = "auto") -> Any:
    """A `config.json`'s contents read by the family `choose_family` picks for it."""
    arch = architecture_of(config)
    return choose_family(arch, impl, source, config)[0].from_hf_config({**config, "architectures": [arch]})


def args_from_dir(path: str | Path, impl: str = "auto") -> Any:
    """A checkpoint directory's architecture (its `config.json`), read by the family serving it."""
    return args_from_config(read_config(path), str(path), impl)


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())
