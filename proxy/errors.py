"""The error hierarchy of kvwarm, in one place.

::

    KvwarmError
     ├── ConfigError (ValueError)       a setting is missing or invalid; names the key
     ├── StoreError                     the transcript store failed (I/O, schema)
     │    └── CorruptEntry              a stored node or blob failed to decode or verify
     ├── TranscriptFormatError (ValueError)
     │                                  a Markdown transcript is malformed; names the line
     ├── ImportRefused                  a well-formed transcript this store cannot use
     └── ProxyError                     a request cannot be served; becomes an OpenAI-style body
          ├── AdminBadRequest           400  (admin API parameters)
          ├── AdminUnauthorized         401  (admin API without a valid credential)
          ├── SessionNotFound           404  (admin API)
          ├── BodyTooLarge              413
          ├── UpstreamUnreachable       502
          └── UpstreamTimeout           504

Library errors (aiohttp, sqlite3, orjson) are converted once, at the boundary
that called the library (``raise UpstreamTimeout(...) from exc``). A
:class:`ProxyError` becomes a JSON error body in exactly one place,
:func:`proxy.app.error_response`.
"""

from __future__ import annotations


class KvwarmError(Exception):
    """Base of every error kvwarm raises on purpose."""


class ConfigError(KvwarmError, ValueError):
    """A configuration value is invalid. ``key`` is the dotted setting name."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class StoreError(KvwarmError):
    """The transcript store could not do its job."""


class CorruptEntry(StoreError):
    """A node or blob failed to decode or verify: treated as a miss, never a partial transcript."""


class TranscriptFormatError(KvwarmError, ValueError):
    """A Markdown transcript is malformed. ``line`` is 1-based."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(f"line {line}: {problem}")
        self.line = line
        self.problem = problem


class ImportRefused(KvwarmError):
    """A well-formed transcript that this store cannot use (exported under another server secret)."""


class ProxyError(KvwarmError):
    """A request cannot be served by kvwarm itself."""

    status = 500
    error_type = "kvwarm_error"
    code = "internal_error"


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
