"""The base class of every config table (typed, bounded, documented in place, unknown keys rejected) and the
field types the tables use: strict numbers (a boolean is not a number, a string not an integer), every float
finite, every size bounded by what a machine could hold, seeds in the range every consumer accepts."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict

INT_MAX = 2**31 - 1
"""Largest count or step number (a 32-bit signed integer, which every consumer holds)."""
MAX_TOKENS = 2**24
"""Largest sequence length or token budget: 16M tokens, beyond any model's context."""
MAX_COUNT = 2**20
"""Largest number of rollouts, groups, sequences or sessions in one step or one server."""
MAX_RANKS = 2**16
"""Largest number of processes, GPUs, nodes, threads or degree of parallelism."""
SEED_MAX = 2**32 - 1
"""Largest seed: numpy's legacy seeding (which vLLM applies to `--seed`) takes 32 bits; torch and `random`
take more."""
MAX_FLOAT = 1e6
"""Largest magnitude of a float without a bound of its own (rates, weights, coefficients, prices)."""
MAX_SECONDS = 1e7
"""Longest timeout or interval (about 116 days): far beyond any real wait, well inside what `time.sleep`,
asyncio and thread waits accept."""
NAME_MAX, PATH_MAX = 255, 4095
"""Longest file name and path (bytes) the usual filesystems accept."""


def _at_most(limit: float) -> AfterValidator:
    """A cap on a value's magnitude, checked after the field's own bounds (a `Field(le=...)` here would replace
    the bound a field sets with the same keyword)."""

    shown = f"{limit:g}" if isinstance(limit, float) else str(limit)

    def check(value: float) -> float:
        if value > limit:
            raise ValueError(f"Input should be less than or equal to {shown}")
        if value < -limit:
            raise ValueError(f"Input should be greater than or equal to -{shown}")
        return value

    return AfterValidator(check)


Int = Annotated[int, Strict(), _at_most(INT_MAX)]
"""An integer count, step number or interval; each field sets its own lower bound."""
Tokens = Annotated[int, Strict(), _at_most(MAX_TOKENS)]
"""A length in tokens."""
Count = Annotated[int, Strict(), _at_most(MAX_COUNT)]
"""A number of rollouts, groups, tasks, sequences or sessions."""
Ranks = Annotated[int, Strict(), _at_most(MAX_RANKS)]
"""A number of processes, GPUs, nodes or threads, or a degree of parallelism."""
Seed = Annotated[int, Strict(), Field(ge=0, le=SEED_MAX)]
"""A random seed."""
Port = Annotated[int, Strict(), Field(ge=0, le=65535)]
"""A TCP port (0: any free one)."""
FixedPort = Annotated[Port, Field(ge=1)]
"""A TCP port that must be given (not 0)."""
Float = Annotated[float, Strict(), _at_most(MAX_FLOAT)]
"""A finite float (an integer is accepted, a boolean or a string is not)."""
Seconds = Annotated[float, Strict(), _at_most(MAX_SECONDS)]
"""A duration in seconds; each field sets its own lower bound."""

MIN_TEMPERATURE = 1e-5
"""Smallest positive temperature: below it fp32 logits divided by the temperature overflow (0 means greedy)."""
MAX_TEMPERATURE = 100.0
"""Largest temperature: far past any useful one (the distribution is already uniform to fp32 precision)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for per token: the local engine's limit, and vLLM's default
`--max-logprobs` (shared by the server's validation and the checks of a teacher's `top_k`)."""


def _sampling_temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"Input should be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return value


Temperature = Annotated[float, Strict(), Field(ge=0, le=MAX_TEMPERATURE), AfterValidator(_sampling_temperature)]
"""A sampling temperature: 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE], what the servers accept."""


def _fits_filesystem(path: Path | None) -> Path | None:
    if path is None:
        return None
    text = str(path)
    if "\x00" in text:
        raise ValueError("a path cannot contain a NUL character")
    if len(text.encode()) > PATH_MAX:
        raise ValueError(f"the path is {len(text.encode())} bytes long; the filesystem takes at most {PATH_MAX}")
    long = next((p for p in path.parts if len(p.encode()) > NAME_MAX), None)
    if long is not None:
        raise ValueError(
            f"the path component {long[:32]!r}... is {len(long.encode())} bytes long; the filesystem "
            f"takes at most {NAME_MAX}"
        )
    return path


def _not_empty(value: object) -> object:
    # pathlib reads "" as ".": an empty value (a shell variable that was never set) would put a run in the working
    # directory, beside whatever files it holds.
    if isinstance(value, str) and not value.strip():
        raise ValueError("the path is empty ('.' is the working directory)")
    return value


FilePath = Annotated[Path, BeforeValidator(_not_empty), AfterValidator(_fits_filesystem)]
"""A file or directory path that the filesystem could hold (whether it exists is preflight's question)."""


class ConfigError(ValueError):
    """A configuration problem, worded as one line for the user."""


class ConfigDeprecationWarning(DeprecationWarning):
    """A renamed or retired config key was used; the message names the key to use instead."""


def warn_deprecated(message: str) -> None:
    """Tells the user that a key of their config is deprecated: one line, not a location in arbor's source."""
    warnings.warn_explicit(message, ConfigDeprecationWarning, filename="arbor.config", lineno=0)


class ConfigWarning(UserWarning):
    """A valid configuration with a known pitfall; the message names the keys and what goes wrong."""


def warn_config(message: str) -> None:
    """Warns the user about their config: one line, not a location in arbor's source."""
    warnings.warn_explicit(message, ConfigWarning, filename="arbor.config", lineno=0)


class Config(BaseModel):
    """One TOML table. Each field's attribute docstring is its `--help` text."""

    # allow_inf_nan: no float of any table (nested ones included: tuples, dict values) may be inf or NaN.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

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
