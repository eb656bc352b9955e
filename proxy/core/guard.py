"""The guard protocol the pure core runs its stages under, and :data:`STRICT`.

The core never decides how errors are handled: callers pass a guard. The proxy
passes a fail-open one (``proxy.request.failopen.FailOpen``: log, count, go on); tests and
offline tools use :data:`STRICT`, which lets every error through.
"""

from __future__ import annotations

from types import TracebackType
from typing import Literal, Protocol

__all__ = ["STRICT", "Guard", "StageContext"]


class StageContext(Protocol):
    def __enter__(self) -> object: ...

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool: ...


class Guard(Protocol):
    """``with guard(stage):`` around one stage; on a hot path (every event of a stream), the
    same as ``try: ... except Exception as exc: guard.fail(stage, exc)``, which costs nothing
    until something fails (a context manager is three calls)."""

    def __call__(self, stage: str) -> StageContext: ...

    def fail(self, stage: str, exc: Exception) -> None:
        """``stage`` raised ``exc``: handled (a fail-open guard), or raised again."""
        ...


class _Strict:
    """A guard that lets every error through."""

    __slots__ = ()

    def __call__(self, stage: str) -> _Strict:
        return self

    def __enter__(self) -> _Strict:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        return False

    def fail(self, stage: str, exc: Exception) -> None:
        raise exc


STRICT: Guard = _Strict()
"""Re-raises: for tests and offline tools that call the core directly."""
