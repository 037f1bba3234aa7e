"""The base class of every config table: typed, bounded, documented in place, unknown keys rejected."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Config(BaseModel):
    """One TOML table. Each field's attribute docstring is its `--help` text."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    deprecated_aliases: ClassVar[dict[str, str]] = {}
    """Renamed keys of this table, old name -> new name; the loader accepts the old name with a warning."""

    def to_toml_dict(self) -> dict[str, Any]:
        """The fields as TOML can hold them (paths as strings, None values dropped)."""
        return _drop_none(self.model_dump(mode="json"))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value
