"""The error hierarchy of kvwarm, in one place.

::

    KvwarmError
     ├── ConfigError (ValueError)       a setting is missing or invalid; names the key
     ├── StoreError                     the transcript store failed (I/O, schema)
     │    └── CorruptEntry              a stored node or blob failed to decode or verify
     ├── ImportRefused                  a transcript file this store will not import
     └── ProxyError                     a request cannot be served; becomes an OpenAI-style body
          ├── BadPath                   400  (a path that could leave upstream.base_url)
          ├── BodyMalformed             400  (chunked or compressed framing of the body broken)
          ├── AdminBadRequest           400  (admin API parameters)
          ├── AdminUnauthorized         401  (admin API without a valid credential)
          ├── MetricsUnauthorized       401  (/metrics without metrics.token)
          ├── SessionNotFound           404  (admin API)
          ├── BodyTimeout               408  (the body did not arrive within server.body_timeout)
          ├── BodyTooLarge              413
          ├── UpstreamUnreachable       502
          ├── TooManyConnections        503  (server.max_connections reached; written raw)
          ├── StoreUnavailable          503  (admin API: the transcript store cannot answer now)
          └── UpstreamTimeout           504

The pure core raises plain ``ValueError`` subclasses of its own (:mod:`proxy.core.errors`,
re-exported here): ``InvalidSetting`` (turned into a ConfigError by
:meth:`ConfigError.of`) and ``TranscriptFormatError`` (a malformed Markdown transcript,
naming the line; a refused import).

Library errors (aiohttp, sqlite3, orjson) are converted once, at the boundary
that called the library (``raise UpstreamTimeout(...) from exc``). A
:class:`ProxyError` becomes a JSON error body in exactly one place,
:func:`proxy.app.error_response` (its bytes: :func:`error_body`, which the connection
cap also writes, before any request exists). A ``close_connection`` error closes the
client's connection once its response is sent.
"""

from __future__ import annotations

import orjson

from .core.errors import InvalidSetting as InvalidSetting
from .core.errors import TranscriptFormatError as TranscriptFormatError


class KvwarmError(Exception):
    """Base of every error kvwarm raises on purpose."""


class ConfigError(KvwarmError, ValueError):
    """A configuration value is invalid. ``key`` is the dotted setting name."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem

    @classmethod
    def of(cls, exc: InvalidSetting) -> ConfigError:
        """The core's complaint about a setting, as kvwarm's configuration error."""
        return cls(exc.key, exc.problem)


class StoreError(KvwarmError):
    """The transcript store could not do its job."""


class CorruptEntry(StoreError):
    """A node or blob failed to decode or verify: treated as a miss, never a partial transcript."""


class ImportRefused(KvwarmError):
    """A transcript file this store will not import: not a regular file, over
    ``store.import_max_bytes``, or exported under another server secret."""


class ProxyError(KvwarmError):
    """A request cannot be served by kvwarm itself."""

    status = 500
    error_type = "kvwarm_error"
    code = "internal_error"
    close_connection = False
    """True: the connection is closed once the error response is sent (the client cannot be
    trusted with a next request on it, e.g. it stalled in the middle of a body)."""


def error_body(message: str, error_type: str, code: str) -> bytes:
    """An OpenAI-shaped error body: ``{"error": {"message", "type", "code", "param"}}``."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "code": code, "param": None}})


class BadPath(ProxyError):
    """A path with dot segments, encoded or double-encoded separators, control characters,
    backslashes or other bytes that would not reach the upstream as sent."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_path"


class BodyMalformed(ProxyError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_body"


class BodyTimeout(ProxyError):
    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"
    close_connection = True


class TooManyConnections(ProxyError):
    status = 503
    error_type = "server_error"
    code = "too_many_connections"


class MetricsUnauthorized(ProxyError):
    status = 401
    error_type = "invalid_request_error"
    code = "unauthorized"


class BodyTooLarge(ProxyError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class UpstreamUnreachable(ProxyError):
    status = 502
    error_type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamTimeout(ProxyError):
    status = 504
    error_type = "upstream_error"
    code = "upstream_timeout"


class AdminBadRequest(ProxyError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_parameter"


class AdminUnauthorized(ProxyError):
    status = 401
    error_type = "invalid_request_error"
    code = "unauthorized"


class SessionNotFound(ProxyError):
    status = 404
    error_type = "invalid_request_error"
    code = "session_not_found"


class StoreUnavailable(ProxyError):
    """The admin API cannot read the transcript store right now (a shared store out of reach);
    requests are still served, unrepaired."""

    status = 503
    error_type = "server_error"
    code = "store_unavailable"
