"""The base class of every config table: typed, bounded, documented in place, unknown keys rejected."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, worded as one line for the user."""


class ConfigDeprecationWarning(DeprecationWarning):
    """A renamed or retired config key was used; the message names the key to use instead."""


def warn_deprecated(message: str) -> None:
    """Tells the user that a key of their config is deprecated: one line, not a location in arbor's source."""
    warnings.warn_explicit(message, ConfigDeprecationWarning, filename="arbor.config", lineno=0)


class Config(BaseModel):
    """One TOML table. Each field's attribute docstring is its `--help` text."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    deprecated_aliases: ClassVar[dict[str, str]] = {}
    """Renamed keys of this table, old name -> new name; the loader accepts the old name with a warning."""
    retired_keys: ClassVar[frozenset[str]] = frozenset()
    """Keys that are no longer fields; `retire` says what replaces each. The loader translates them within the
    source that set them (so they keep its precedence); a `mode="before"` validator may do the same for configs
    built in Python."""

    @classmethod
    def retire(cls, key: str, value: Any) -> dict[str, Any]:
        """The keys (a nested dict, relative to this table) that replace the retired `key` set to `value`, after
        warning the user with the new spelling."""
        raise KeyError(f"{cls.__name__} has no retired key {key!r}")

    def to_toml_dict(self) -> dict[str, Any]:
        """The fields as TOML can hold them (paths as strings, None values dropped)."""
        return _drop_none(self.model_dump(mode="json"))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
