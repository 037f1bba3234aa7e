"""Layered configuration: defaults < `@ file.toml` (left to right) < `ARBOR_` environment < `--key value` flags.

Every key from every source is resolved against the typed classes before validation, so a misspelt key fails
with a "did you mean" hint naming the source it came from, and validation errors are reported as one line per
field (`orchestrator.batch_size: Input should be greater than 0 (got -3)`).
"""

from __future__ import annotations

import difflib
import os
import sys
import tomllib
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Mapping, TypeVar

from pydantic import BaseModel, ValidationError

from arbor.config.base import Config

C = TypeVar("C", bound=Config)
ENV_PREFIX = "ARBOR_"


class ConfigError(ValueError):
    """A configuration problem, worded as one line for the user."""


def load_config(cls: type[C], argv: list[str] | None = None, env: Mapping[str, str] | None = None, prog: str = "arbor") -> C:
    """Parses `argv` (without the program name) into `cls`; prints help and exits on `--help`."""
    argv = sys.argv[1:] if argv is None else argv
    env = os.environ if env is None else env
    if "--help" in argv or "-h" in argv:
        print(render_help(cls, prog))
        raise SystemExit(0)
    files, cli = parse_argv(cls, argv)
    merged: dict[str, Any] = {}
    for f in files:
        deep_merge(merged, normalize_keys(cls, read_toml(f), f"{f}"))
    deep_merge(merged, env_overrides(cls, env))
    deep_merge(merged, cli)
    return validate(cls, merged)


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None


def validate(cls: type[C], data: dict[str, Any]) -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(cls, e)) from None


def parse_argv(cls: type[Config], argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    files: list[str] = []
    cli: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "@":
            if i + 1 >= len(argv):
                raise ConfigError("'@' must be followed by a TOML file")
            files.append(argv[i + 1])
            i += 2
            continue
        if tok.startswith("@"):
            files.append(tok[1:])
            i += 1
            continue
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}: use '@ file.toml' or '--key value'")
        key, eq, value = tok[2:].partition("=")
        path = resolve_path(cls, key.replace("-", "_").split("."), "", dashed=True)
        annotation = field_annotation(cls, path)
        is_bool = _is_bool(annotation)
        if eq:
            raw = value
            i += 1
        elif is_bool and (i + 1 >= len(argv) or argv[i + 1].lower() not in ("true", "false")):
            raw = "true"
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            raw = argv[i + 1]
            i += 2
        set_path(cli, path, coerce(raw, annotation))
    return files, cli


def env_overrides(cls: type[Config], env: Mapping[str, str]) -> dict[str, Any]:
    """`ARBOR_ORCHESTRATOR__BATCH_SIZE=8` sets `orchestrator.batch_size` (sections joined by a double underscore)."""
    out: dict[str, Any] = {}
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        keys = name[len(ENV_PREFIX):].lower().split("__")
        path = resolve_path(cls, keys, f"environment variable {name}: ", dashed=False)
        set_path(out, path, coerce(raw, field_annotation(cls, path)))
    return out


def normalize_keys(cls: type[Config], data: dict[str, Any], source: str, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """Checks every key of a TOML document against `cls` (with hints), applying deprecated aliases."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = resolve_path(cls, [*prefix, key], f"{source}: ", dashed=False)
        sub = model_at(cls, path)
        if isinstance(value, dict) and sub is not None:
            value = normalize_keys(cls, value, source, tuple(path))
        out[path[-1]] = value
    return out


def resolve_path(cls: type[Config], keys: list[str], what: str, dashed: bool) -> list[str]:
    """Walks `keys` through nested config classes; unknown keys raise with the closest known names."""
    model: type[BaseModel] | None = cls
    out: list[str] = []
    for depth, key in enumerate(keys):
        if model is None:  # inside a free-form dict field (e.g. environment args): anything goes
            out.append(key)
            continue
        aliases = getattr(model, "deprecated_aliases", {})
        if key in aliases:
            new = aliases[key]
            warnings.warn(f"{'.'.join([*out, key])} is deprecated; use {'.'.join([*out, new])}", DeprecationWarning, stacklevel=2)
            key = new
        if key not in model.model_fields:
            shown = ".".join(out)
            full = (shown + "." if shown else "") + key
            if dashed:
                full = "--" + full.replace("_", "-")
            hint = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
            suggestion = ""
            if hint:
                s = ".".join([*out, hint[0]])
                suggestion = f" (did you mean {'--' + s.replace('_', '-') if dashed else s}?)"
            raise ConfigError(f"{what}unknown option {full!r}{suggestion}")
        out.append(key)
        model = _sub_model(model.model_fields[key].annotation)
        if model is None and depth < len(keys) - 1 and not _is_dict(cls, out):
            raise ConfigError(f"{what}{'.'.join(keys)!r}: {'.'.join(out)} is a value, not a table")
    return out


def model_at(cls: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = cls
    for key in path:
        if model is None or key not in model.model_fields:
            return None
        model = _sub_model(model.model_fields[key].annotation)
    return model


def field_annotation(cls: type[BaseModel], path: list[str]) -> Any:
    model: type[BaseModel] | None = cls
    ann: Any = None
    for key in path:
        if model is None:
            return None
        ann = model.model_fields[key].annotation
        model = _sub_model(ann)
    return ann


def _is_dict(cls: type[BaseModel], path: list[str]) -> bool:
    ann = field_annotation(cls, path)
    return typing.get_origin(ann) is dict or ann is dict


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    for t in _union_members(annotation):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_bool(annotation: Any) -> bool:
    return bool in _union_members(annotation)


def _is_text(annotation: Any) -> bool:
    members = _union_members(annotation)
    return any(t in (str, Path) for t in members) and not any(t in (int, float, bool) for t in members)


def coerce(raw: str, annotation: Any) -> Any:
    """A flag's text as a TOML value (numbers, booleans, lists, inline tables); text fields stay text."""
    if _is_text(annotation):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def set_path(d: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        d = d.setdefault(key, {})
    d[path[-1]] = value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_merge(base[k], v)
        else:
            base[k] = v
    return base


def format_validation_error(cls: type[BaseModel], e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            parent = model_at(cls, [str(p) for p in err["loc"][:-1]])
            hint = difflib.get_close_matches(str(err["loc"][-1]), list(parent.model_fields), n=1) if parent else []
            msg = "is not a known option" + (f" (did you mean {'.'.join([*map(str, err['loc'][:-1]), hint[0]])}?)" if hint else "")
            lines.append(f"{loc} {msg}")
            continue
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{loc}: {msg}{got}" if loc else f"{msg}")
    return "; ".join(lines)


def render_help(cls: type[BaseModel], prog: str) -> str:
    lines = [f"usage: {prog} [@ config.toml ...] [--key value ...]", ""]
    if cls.__doc__:
        lines += [cls.__doc__.strip(), ""]
    lines.append("Options (TOML key = flag without '--'; environment: ARBOR_SECTION__KEY):")
    _help_lines(cls, [], lines)
    return "\n".join(lines)


def _help_lines(model: type[BaseModel], prefix: list[str], lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        path = [*prefix, name]
        sub = _sub_model(field.annotation)
        if sub is not None:
            lines.append(f"\n[{'.'.join(path)}]" + (f"  {field.description}" if field.description else ""))
            _help_lines(sub, path, lines)
            continue
        flag = "--" + ".".join(path).replace("_", "-")
        default = field.get_default(call_default_factory=True)
        lines.append(f"  {flag}  (default: {default!r})")
        if field.description:
            lines.append(f"      {field.description.strip()}")


def main_guard(fn):
    """Runs a process's main so that a ConfigError prints one line and exits 2, before anything heavy starts."""

    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return fn(argv) or 0
        except ConfigError as e:
            prog = Path(sys.argv[0]).name or "arbor"
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2

    return wrapped
