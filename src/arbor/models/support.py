"""The support table (docs/models.md): which path builds an architecture and which of arbor's features it gets,
derived from the families' own declarations, so the page cannot drift from the code (tests/models checks it).
No torch here."""

from __future__ import annotations

from typing import Any

from arbor.models.family import ModelFamily

COLUMNS = (
    "architecture",
    "path",
    "FSDP2 + AC",
    "packed rows",
    "prefix-tree merge",
    "local engine",
    "EP + router replay",
    "CP",
    "FP8",
    "MTP",
    "LoRA",
)


def _mark(ok: bool) -> str:
    return "yes" if ok else "refused"


def support_row(arch: str, family: ModelFamily, args: Any = None) -> list[str]:
    """One architecture's row: `family` serves it; `args` (a transformers checkpoint's HFArgs) says whether
    it has recurrent layers and routed experts (transformers holds those as 3-D parameters, not linear layers,
    so LoRA, which adapts `nn.Linear` modules on that path, leaves them out)."""
    if getattr(family.args_class, "impl", None) == "transformers":
        recurrent = bool(getattr(args, "recurrent", False))
        moe = args is not None and args.experts[0] > 0
        return [
            f"`{arch}`",
            "transformers",
            "yes",
            "one sample per forward" if recurrent else "yes",
            _mark(not recurrent),
            "recomputes each step" if recurrent else "KV cache",
            "refused",
            "refused",
            "refused",
            "refused",
            "linear layers, not the experts" if moe else "yes",
        ]
    moe = "yes" if family.supports_moe else "dense"
    mtp = _mark(family.supports_mtp)
    return [f"`{arch}`", "native", "yes", "yes", "yes", "KV cache", moe, "yes", "yes", mtp, "yes"]


def support_table(rows: list[list[str]]) -> str:
    """A Markdown table of `support_row`s."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
