"""Layer composition for `@` TOML files: a file may start with `layers = ["a.toml", ...]`, naming the files it is
built on (paths relative to the file that names them). `expand_layers` turns the command line's files into the
full left-to-right list the loader reads, so an example is a thin file on top of reusable `configs/` layers and
`rl @ examples/x/rl.toml` alone still runs it; a missing layer, a cycle or a malformed list is one line naming the
file at fault.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from arbor.config.base import ConfigError

__all__ = ["LAYERS_KEY", "expand_layers"]

LAYERS_KEY = "layers"
"""The top-level key of a TOML file naming the files it is layered on."""


def expand_layers(files: list[str], seen: tuple[Path, ...] = ()) -> list[str]:
    """`files` with each one's `layers` (relative to it, recursively) put before it, left to right."""
    out: list[str] = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"config file {f} does not exist")
        if path.resolve() in seen:
            raise ConfigError(f"{f}: layers include the file itself ({' -> '.join(str(p) for p in seen)})")
        try:
            layers = tomllib.loads(path.read_text()).get(LAYERS_KEY, [])
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{f}: invalid TOML: {e}") from None
        if not (isinstance(layers, list) and all(isinstance(x, str) for x in layers)):
            raise ConfigError(f"{f}: {LAYERS_KEY} must be a list of TOML file paths (relative to {f})")
        nested = [str(path.parent / x) for x in layers]
        for layer, given in zip(nested, layers):
            if not Path(layer).is_file():
                raise ConfigError(f"{f}: {LAYERS_KEY} names {given}, which does not exist (at {layer})")
        out += expand_layers(nested, (*seen, path.resolve())) + [f]
    return out
