"""The errors a server answers client input with: `HTTPError` (a status, a message and the field at fault) and
`BadRequest` (its 400). Plain Python, apart from arbor.transport.http's aiohttp plumbing, so that the request schema
(arbor.transport.fields) and what imports it stay importable by `rl` without the web stack."""

from __future__ import annotations


class HTTPError(Exception):
    """A request the server refuses: answered with `status` and a message naming `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class BadRequest(HTTPError):
    """Invalid client input: a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param)
