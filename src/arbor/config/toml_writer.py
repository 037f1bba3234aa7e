"""A small TOML writer for resolved configs (the standard library reads TOML but does not write it)."""

from __future__ import annotations

import json
import math
from typing import Any


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_scalar(x)}" for k, x in v.items() if x is not None) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def dumps(data: dict[str, Any], _prefix: str = "") -> str:
    lines: list[str] = []
    tables = []
    for k, v in data.items():
        if v is None:
            continue
        if isinstance(v, dict) and v:
            tables.append((k, v))
        else:
            lines.append(f"{_key(k)} = {_scalar(v)}")
    out = "\n".join(lines)
    for k, v in tables:
        name = f"{_prefix}{_key(k)}"
        body = dumps(v, name + ".")
        out += ("\n\n" if out else "") + f"[{name}]" + ("\n" + body if body and not body.startswith("[") else ("\n\n" + body if body else ""))
    return out.strip("\n") + "\n" if _prefix == "" else out
