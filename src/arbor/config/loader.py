"""Layered configuration on pydantic-settings: defaults < `@ file.toml` layers (left to right) < `ARBOR_` variables
(`ARBOR_ORCHESTRATOR__BATCH_SIZE`: tables joined by `__`) < `--key value` flags, each layer a settings source.

A file's `layers = [...]` are read just before it (arbor.config.layers); every other path in a file is
relative to the working directory, as on the command line.

Every layer's keys are checked as it is read (arbor.config.keys), so a misspelt key fails with a "did you mean"
hint naming its source (the TOML file, the variable, the flag) before anything is validated; a validation error
is one line, a clause per field (`orchestrator.batch_size: Input should be greater than or equal to 1 (got -3)`).
"""

from __future__ import annotations

import os
import sys
import tomllib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from arbor.config.base import Config, ConfigDeprecationWarning, ConfigError
from arbor.config.keys import ENV_PREFIX, coerce, members, render_help, replacements, resolve, spell, sub_model
from arbor.config.layers import LAYERS_KEY, expand_layers

__all__ = ["ConfigError", "load_config", "main_guard", "render_help"]
C = TypeVar("C", bound=Config)


def load_config(
    cls: type[C],
    argv: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str = "arbor",
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Parses `argv` (without the program name) into `cls`; prints help and exits on `--help`. `overrides` (a
    nested dict of field values, None removing a table) sit above every layer: `rl --twin`'s changes
    (arbor.launch.twin)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(render_help(cls, prog))
        raise SystemExit(0)
    files, flags = parse_argv(cls, argv)
    files = expand_layers(files)
    variables: dict[str, Any] = {}
    for name, raw in sorted((os.environ if env is None else env).items()):
        if name.startswith(ENV_PREFIX):
            where = f"environment variable {name}: "
            path, ann = resolve(cls, name[len(ENV_PREFIX) :].lower().split("__"), where, False)
            put(cls, variables, path, ann, coerce(raw, ann), where, False)

    class Settings(BaseSettings, cls):  # type: ignore[misc,valid-type]  # cls's fields and validators
        model_config = SettingsConfigDict(validate_default=False)

        @classmethod
        def settings_customise_sources(root, settings_cls: type[BaseSettings], **_: Any) -> tuple[Any, ...]:
            layers = (InitSettingsSource(settings_cls, flags), InitSettingsSource(settings_cls, variables))
            top = (InitSettingsSource(settings_cls, dict(overrides)),) if overrides else ()
            return *top, *layers, TomlLayers(settings_cls, files)  # highest precedence first

    try:
        settings = Settings()
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    # Callers get `cls` itself (equality, pickling), not this call's subclass; the values are already validated.
    return cls.model_construct(settings.model_fields_set, **dict(settings))


class TomlLayers(TomlConfigSettingsSource):
    """The `@` files, deep-merged left to right; each file's keys are checked as it is read, naming the file."""

    def __init__(self, settings_cls: type[BaseSettings], files: list[str]) -> None:
        for f in files:
            if not Path(f).is_file():
                raise ConfigError(f"config file {f} does not exist")
        self.root = settings_cls  # the base class reads the files before it sets settings_cls
        super().__init__(settings_cls, toml_file=files, deep_merge=True)

    def _read_file(self, path: Path) -> dict[str, Any]:  # type: ignore[override]
        try:
            data = super()._read_file(path)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        data.pop(LAYERS_KEY, None)  # already expanded into the file list (expand_layers)
        out: dict[str, Any] = {}
        for keys, value in _leaves(data):
            put(self.root, out, *resolve(self.root, keys, f"{path}: ", False), value, f"{path}: ", False)
        return out


def _leaves(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[list[str], Any]]:
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, key))
        else:
            yield [*prefix, key], value


def parse_argv(cls: type[Config], argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Splits `argv` into `@` files and the flags' values (a nested dict; keys checked, values coerced)."""
    files: list[str] = []
    flags: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        tok, following = argv[i], (argv[i + 1] if i + 1 < len(argv) else None)
        if tok.startswith("@"):
            if not (tok[1:] or following):
                raise ConfigError("'@' must be followed by a TOML file")
            files.append(tok[1:] or str(following))
            i += 1 if tok[1:] else 2
            continue
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r}: use '@ file.toml' or '--key value'")
        key, eq, raw = tok[2:].partition("=")
        path, ann = resolve(cls, key.replace("-", "_").split("."), "", True)
        if not eq and bool in members(ann) and (following or "--").startswith(("--", "@")):
            raw = "true"  # a bare boolean flag
        elif not eq:
            if following is None:
                raise ConfigError(f"--{key} needs a value")
            raw, i = following, i + 1
        put(cls, flags, path, ann, coerce(raw, ann), "", True)
        i += 1
    return files, flags


def put(
    cls: type[Config], out: dict[str, Any], path: list[str], ann: Any, value: Any, where: str, dashed: bool
) -> None:
    """Sets the field at `path` (of type `ann`) in the nested dict `out`; a table takes only a table. A retired
    key is set as the keys that replace it (arbor.config.keys.replacements)."""
    if sub_model(ann) is not None and not isinstance(value, dict):
        raise ConfigError(f"{where}{spell(path, dashed)} is a table, not a value")
    for full, v in replacements(cls, path, value):
        node = out
        for key in full[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[full[-1]] = v


def format_validation_error(e: ValidationError) -> str:
    lines, seen = [], set()
    for err in e.errors():
        loc = tuple(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        msg = err["msg"].removeprefix("Value error, ")
        if (loc[1:], msg) in seen:
            continue  # a shared field pushed down into a section: said once, where it was set
        seen.add((loc, msg))
        got = f" (got {err['input']!r})" if not isinstance(err.get("input"), (dict, type(None))) else ""
        where = ".".join(loc)
        # The message names its key already: relative to where it failed, or by its full path in the run's config
        # (a registry's check names `orchestrator.scheduler.mode`, whichever process's config it fails in).
        said = (
            not loc
            or msg.startswith((f"{where}.", f"{where}:", f"{where} "))
            or msg.split(":")[0].endswith(f".{where}")
        )
        lines.append(msg if said else f"{where}: {msg}{got}")
    return "; ".join(lines)


def main_guard(fn):
    """Runs a process's main so that a ConfigError prints one line and exits 2, before anything heavy starts."""

    def wrapped(argv: list[str] | None = None) -> int:
        if not sys.warnoptions:  # Python hides DeprecationWarnings outside __main__; a user's old key should show
            warnings.filterwarnings("default", category=ConfigDeprecationWarning)
        try:
            return fn(argv) or 0
        except ConfigError as e:
            print(f"{Path(sys.argv[0]).name or 'arbor'}: error: {e}", file=sys.stderr)
            return 2

    return wrapped
