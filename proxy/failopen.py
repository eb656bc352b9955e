"""The fail-open boundary: one helper every enrichment stage runs under.

kvwarm must never turn a request the upstream would have served into a failure.
Each stage that only *enriches* a request (parse, match, repair, diagnose, record,
usage, store, ...) runs as ``with guard("match"): ...``. An exception inside is
logged once (with its traceback), counted in ``kvwarm_errors_total{stage}``, added
to the request's ``failed_open=`` log field, and swallowed: the caller goes on with
what it had (in the end, the client's own bytes).

In the style of httpcore's ``map_exceptions``: errors are mapped once, at the
boundary, never by hand-written try/except blocks in each stage. The pure core
takes a guard as an argument; :data:`STRICT` re-raises (tests, tools), so a bug
in the core is never hidden outside the proxy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType

from .core.guard import STRICT, Guard

log = logging.getLogger(__name__)

__all__ = ["STRICT", "FailOpen", "Guard"]


class FailOpen:
    """One request's boundary. ``failed`` lists the stages that failed, in order.

    ``guard(stage)`` returns a fresh context per stage, so guards nest: the planner's
    ``match`` inside the request path's ``store`` is counted as what failed.
    """

    __slots__ = ("_count", "failed")

    def __init__(self, count: Callable[[str], None] | None = None) -> None:
        self._count = count
        """Counts one error of a stage (``ProxyMetrics.error``)."""
        self.failed: list[str] = []

    def __call__(self, stage: str) -> _Stage:
        return _Stage(self, stage)

    def fail(self, stage: str, exc: BaseException) -> None:
        log.error("%s failed; going on without it (fail open)", stage, exc_info=exc)
        if self._count is not None:
            self._count(stage)
        self.failed.append(stage)


class _Stage:
    __slots__ = ("_boundary", "_stage")

    def __init__(self, boundary: FailOpen, stage: str) -> None:
        self._boundary = boundary
        self._stage = stage

    def __enter__(self) -> _Stage:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False  # success, or cancellation / exit: never swallowed
        self._boundary.fail(self._stage, exc)
        return True
