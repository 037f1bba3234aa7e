"""The sampling fields of a generation request as arbor's servers read them: the inference server, and the agents'
gateway, which forwards them to it. Each is typed, finite and bounded; anything else is a 400 naming the field.
Shared so that whatever the gateway accepts, the inference server accepts too.
"""

from __future__ import annotations

from typing import Any

from arbor.config.base import MAX_TEMPERATURE, MIN_TEMPERATURE  # one bound for configs and requests
from arbor.transport.http import BadRequest, get_field, get_float, get_int

MAX_SEED = 2**63 - 1
"""Largest request seed: torch's generators take seeds below 2**64, and sample i of a request is seeded with
seed + i."""
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024


def read_temperature(body: dict[str, Any], default: float) -> float:
    """`temperature`: 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]."""
    t = get_float(body, "temperature", float(default), 0.0, MAX_TEMPERATURE)
    if 0 < t < MIN_TEMPERATURE:
        raise BadRequest(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {t}", "temperature")
    return t


def read_top_p(body: dict[str, Any], default: float) -> float:
    """`top_p` in (0, 1]."""
    top_p = get_float(body, "top_p", float(default), 0.0, 1.0)
    if top_p <= 0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    return top_p


def read_seed(body: dict[str, Any]) -> int | None:
    """`seed` in [0, MAX_SEED], or None."""
    return get_int(body, "seed", None, 0, MAX_SEED)


def read_stop(body: dict[str, Any]) -> tuple[str, ...]:
    """`stop`: one non-empty string or a list of at most MAX_STOP_STRINGS, each at most MAX_STOP_CHARS long."""
    stop = get_field(body, "stop", (str, list), ())
    if isinstance(stop, str):
        stop = [stop]
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(
            f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
            f"of at most {MAX_STOP_CHARS} characters",
            "stop",
        )
    return tuple(stop)
