"""The faults a request asks the reference upstream for (``x-sim-fault: k=v,...``), and the one that drops a connection.

- ``status=503``: answer with that status and an OpenAI-style error body;
- ``retry_after=2``: with a ``Retry-After`` header;
- ``delay=1.5``: seconds before the response headers;
- ``reset_after=N``: stream N events, then drop the TCP connection
  (non-streaming: drop it before answering);
- ``stall=S``: seconds between streamed events after the first.

Every model endpoint honours them the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

FAULT_HEADER = "x-sim-fault"


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    """The faults one request asked for with ``x-sim-fault``."""

    status: int | None = None
    retry_after: str | None = None
    delay: float = 0.0
    reset_after: int | None = None
    stall: float = 0.0

    @classmethod
    def parse(cls, header: str | None) -> Faults:
        """``"status=503,retry_after=2"`` -> :class:`Faults`; ``ValueError`` names a bad item."""
        values: dict[str, Any] = {}
        for item in (header or "").split(","):
            if not item.strip():
                continue
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or not raw:
                raise ValueError(f"fault {item.strip()!r} is not key=value")
            if key not in _FAULT_PARSERS:
                raise ValueError(f"unknown fault {key!r} (known: {', '.join(_FAULT_PARSERS)})")
            try:
                values[key] = _FAULT_PARSERS[key](raw)
            except ValueError:
                raise ValueError(f"invalid value for fault {key!r}: {raw!r}") from None
        return cls(**values)


def drop_connection(request: web.Request) -> None:
    """Close the client's TCP connection now.

    Closing the transport flushes what was written and sends FIN without the
    chunked terminator: the client sees a truncated body. aiohttp then fails
    to write the end of the response and treats it as a client disconnect.
    """
    transport = request.transport
    if transport is not None:
        transport.close()


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if not low <= value <= high:
            raise ValueError(raw)
        return value

    return parse


def _seconds(raw: str) -> float:
    value = float(raw)
    if not 0 <= value < float("inf"):
        raise ValueError(raw)
    return value


_FAULT_PARSERS: Mapping[str, Callable[[str], Any]] = {
    "status": _bounded_int(400, 599),
    "retry_after": str,
    "delay": _seconds,
    "reset_after": _bounded_int(0, 1_000_000),
    "stall": _seconds,
}
