"""The admin token: the bearer secret that guards the admin routes of the inference servers and the router
(weight updates, pause, resume, aborts; see arbor.transport.admin).

A token is a secret: its fields are `SecretStr` (shown as `**********`) and excluded from every dump, so it never
reaches the resolved configs `rl` writes to `<output_dir>/configs/` nor a log line. Processes read it from their
TOML or, as `rl` hands it to its children, from the environment (`ARBOR_ADMIN_TOKEN` for `rl`, `inference` and
`router`; `ARBOR_CLIENT__ADMIN_TOKEN` for the orchestrator): never from argv, which `ps` shows to every user.
A server that binds beyond loopback refuses to start without one.
"""

from __future__ import annotations

import ipaddress
import secrets
from typing import Annotated

from pydantic import Field, SecretStr

from arbor.config.base import ConfigError

AdminToken = Annotated[SecretStr, Field(min_length=1, max_length=4096)]
"""A bearer token (not empty; at most 4096 characters, which any HTTP header holds)."""
ADMIN_TOKEN_ENV = "ARBOR_ADMIN_TOKEN"
"""The variable that sets `admin_token` of `rl`, `inference` and `router`."""
CLIENT_TOKEN_ENV = "ARBOR_CLIENT__ADMIN_TOKEN"
"""The variable that sets `client.admin_token` of the orchestrator."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to any interface
        return False


def require_admin_token(host: str, token: SecretStr | None, key: str) -> None:
    """Refuses (one line naming `key`) a server that would bind beyond loopback with its admin routes open."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"{key} is required when the server binds {host!r} (beyond loopback): set it in the "
            f"config or through {ADMIN_TOKEN_ENV}"
        )


def new_admin_token() -> SecretStr:
    """A fresh token for one run (256 bits)."""
    return SecretStr(secrets.token_urlsafe(32))


def token_value(token: SecretStr | None) -> str | None:
    return None if token is None else token.get_secret_value()


def bearer_headers(token: SecretStr | str | None) -> dict[str, str]:
    """The header an admin call carries (none without a token). Here rather than in arbor.transport.admin (which
    re-exports it) so that `rl`, which calls the fleet's router, does not import aiohttp's server for it."""
    if token is None:
        return {}
    value = token.get_secret_value() if isinstance(token, SecretStr) else token
    return {"Authorization": f"Bearer {value}"}
