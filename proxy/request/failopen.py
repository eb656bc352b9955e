"""The fail-open boundary: one helper every enrichment stage runs under.

kvwarm must never turn a request the upstream would have served into a failure.
Each stage that only *enriches* a request (parse, match, repair, diagnose, record,
usage, store, ...) runs as ``with guard("match"): ...``. An exception inside is
logged once (with its traceback; a store that is down, one line), counted in ``kvwarm_errors_total{stage}``, added
to the request's ``failed_open=`` log field, and swallowed: the caller goes on with
what it had (in the end, the client's own bytes). The request path's own stages, run
on every request (and the observers', run on every event of a stream), are written
``try: ... except Exception as exc: guard.fail("match", exc)``: the same boundary, at no
cost until something fails (the context manager costs three Python calls every time).

In the style of httpcore's ``map_exceptions``: errors are mapped once, at the
boundary (``fail``), never by hand-written handling in each stage. The pure core
takes a guard as an argument; :data:`STRICT` re-raises (tests, tools), so a bug
in the core is never hidden outside the proxy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType

from ..core.guard import STRICT, Guard
from ..errors import StoreError

log = logging.getLogger(__name__)

__all__ = ["STRICT", "FailOpen", "Guard"]


class FailOpen:
    """One request's boundary. ``failed`` lists the stages that failed, in order.

    ``with guard(stage):`` names the stage on a stack and returns the guard itself (no object per
    stage: the request path enters a dozen), so guards nest: the planner's ``match`` inside the
    request path's ``store`` is counted as what failed.
    """

    __slots__ = ("_count", "_stages", "failed")

    def __init__(self, count: Callable[[str], None] | None = None) -> None:
        self._count = count
        """Counts one error of a stage (``ProxyMetrics.error``)."""
        self.failed: list[str] = []
        self._stages: list[str] = []
        """The stages entered and not left, innermost last."""

    def __call__(self, stage: str) -> FailOpen:
        self._stages.append(stage)
        return self

    def __enter__(self) -> FailOpen:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        stage = self._stages.pop()
        if exc is None or not isinstance(exc, Exception):
            return False  # success, or cancellation / exit: never swallowed
        self.fail(stage, exc)
        return True

    def fail(self, stage: str, exc: BaseException) -> None:
        """``stage`` raised ``exc``: logged, counted, listed, and the request goes on.

        A store that is down or slow (:class:`~proxy.errors.StoreError`, a timeout) is an
        operational state, not a bug: one WARNING line without a traceback, which would be
        the same for every request until the store is back."""
        if isinstance(exc, StoreError | TimeoutError):
            log.warning("%s failed: %s; going on without it (fail open)", stage, str(exc) or type(exc).__name__)
        else:
            log.error("%s failed; going on without it (fail open)", stage, exc_info=exc)
        if self._count is not None:
            self._count(stage)
        self.failed.append(stage)
