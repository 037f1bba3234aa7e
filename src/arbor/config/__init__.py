"""Typed configuration: one class per TOML table, loaded from `@` files, `ARBOR_` variables and `--flags`."""

from arbor.config.loader import ConfigError, load_config

__all__ = ["ConfigError", "load_config"]
