"""The key space of the config classes: dotted keys resolved to fields (deprecated aliases renamed, unknown keys
answered with the closest known one), a flag's text read as its field's type, and the `--help` listing."""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from arbor.config.base import ConfigError, warn_deprecated

ENV_PREFIX = "ARBOR_"


def resolve(cls: type[BaseModel], keys: list[str], where: str, dashed: bool) -> tuple[list[str], Any]:
    """Walks `keys` down the config classes to one field: its path (deprecated aliases renamed) and type. Errors
    start with `where` and spell keys as flags when `dashed`; keys below a free-form dict (environment args) pass."""
    model: type[BaseModel] | None = cls
    path: list[str] = []
    ann: Any = None
    for depth, key in enumerate(keys):
        if model is None:
            if dict not in (*members(ann), *map(typing.get_origin, members(ann))):
                raise ConfigError(f"{where}{spell(keys, dashed)!r}: {spell(path, dashed)} is a value, not a table")
            return path + keys[depth:], Any
        if key in model.deprecated_aliases:  # type: ignore[attr-defined]
            new = model.deprecated_aliases[key]  # type: ignore[attr-defined]
            warn_deprecated(f"{'.'.join([*path, key])} is deprecated; use {'.'.join([*path, new])}")
            key = new
        if key not in model.model_fields and key not in model.retired_keys:  # type: ignore[attr-defined]
            hint = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
            near = [*path, hint[0]] if hint else nearest_home(cls, key, path)
            suggestion = f" (did you mean {spell(near, dashed)}?)" if near else ""
            raise ConfigError(f"{where}unknown option {spell([*path, key], dashed)!r}{suggestion}")
        path.append(key)
        ann = model.model_fields[key].annotation if key in model.model_fields else None
        model = sub_model(ann)
    return path, ann


def nearest_home(cls: type[BaseModel], key: str, path: list[str]) -> list[str] | None:
    """The path of a field named `key` in another table (`orchestrator.sampling.top_p` for a misplaced
    `orchestrator.top_p`), the one sharing the longest prefix with `path`; None if there is none."""
    homes: list[list[str]] = []

    def walk(model: type[BaseModel], prefix: list[str]) -> None:
        for name, info in model.model_fields.items():
            if name == key:
                homes.append([*prefix, name])
            if (sub := sub_model(info.annotation)) is not None and len(prefix) < 6:
                walk(sub, [*prefix, name])

    walk(cls, [])

    def shared(home: list[str]) -> int:
        return next((i for i, (a, b) in enumerate(zip(home, path)) if a != b), min(len(home) - 1, len(path)))

    return max(homes, key=lambda h: (shared(h), -len(h)), default=None)


def replacements(cls: type[BaseModel], path: list[str], value: Any) -> list[tuple[list[str], Any]]:
    """A retired key's value as the keys that replace it (`Config.retire`), in place within the same source, so
    the replacement keeps that source's precedence (a flag's retired key beats a TOML file's new key); any other
    key as itself."""
    model: type[BaseModel] | None = cls
    for key in path[:-1]:
        model = (
            sub_model(model.model_fields[key].annotation) if model is not None and key in model.model_fields else None
        )
    if model is None or path[-1] not in getattr(model, "retired_keys", ()):
        return [(path, value)]
    out: list[tuple[list[str], Any]] = []

    def leaves(d: dict[str, Any], prefix: list[str]) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                leaves(v, [*prefix, k])
            else:
                out.append(([*prefix, k], v))

    leaves(model.retire(path[-1], value), path[:-1])  # type: ignore[attr-defined]
    return out


def coerce(raw: str, ann: Any) -> Any:
    """A flag's or variable's text as a TOML value (numbers, booleans, lists, inline tables); text fields keep it."""
    kinds = members(ann)
    if any(t in (str, Path, SecretStr) for t in kinds) and not {int, float, bool} & {*kinds}:
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def spell(path: list[str], dashed: bool) -> str:
    return "--" + ".".join(path).replace("_", "-") if dashed else ".".join(path)


def members(ann: Any) -> tuple[Any, ...]:
    """The types a field accepts: a union's members, each without its Annotated constraints."""
    kinds = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
    return tuple(typing.get_args(k)[0] if typing.get_origin(k) is typing.Annotated else k for k in kinds)


def sub_model(ann: Any) -> type[BaseModel] | None:
    return next((t for t in members(ann) if isinstance(t, type) and issubclass(t, BaseModel)), None)


def render_help(cls: type[BaseModel], prog: str) -> str:
    """`--help`: every field as a flag with its default and its attribute docstring, a heading per table."""
    lines = [f"usage: {prog} [@ config.toml ...] [--key value ...]", ""]
    lines += [cls.__doc__.strip(), ""] if cls.__doc__ else []
    lines.append(f"Options (TOML key = flag without '--'; environment: {ENV_PREFIX}SECTION__KEY):")

    def table(model: type[BaseModel], prefix: list[str]) -> None:
        for name, info in model.model_fields.items():
            doc = info.description.strip() if info.description else ""
            if (sub := sub_model(info.annotation)) is not None:
                lines.append(f"\n[{'.'.join([*prefix, name])}]  {doc}".rstrip())
                table(sub, [*prefix, name])
                continue
            default = "required" if info.is_required() else f"default: {info.get_default(call_default_factory=True)!r}"
            lines.append(f"  {spell([*prefix, name], True)}  ({default})")
            lines.extend(f"      {line}" for line in doc.splitlines())

    table(cls, [])
    return "\n".join(lines)
