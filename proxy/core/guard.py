"""The guard protocol the pure core runs its stages under, and :data:`STRICT`.

The core never decides how errors are handled: callers pass a guard. The proxy
passes a fail-open one (``proxy.failopen.FailOpen``: log, count, go on); tests and
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
    """``with guard(stage):`` around one stage."""

    def __call__(self, stage: str) -> StageContext: ...


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


STRICT: Guard = _Strict()
"""Re-raises: for tests and offline tools that call the core directly."""
