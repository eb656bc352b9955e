"""The reference upstream's clock: monotonic time that tests and the bench can move forward.

Every TTL of the emulator runs on one :class:`SimClock` per app: the block
cache's (``openai`` and ``vllm`` modes) and the breakpoint cache's. A clock
reads its source (``time.monotonic`` unless told otherwise) plus an offset that
only :meth:`SimClock.advance` changes, so an untouched clock *is* the source,
and advancing it makes every TTL elapse at once without waiting. It never goes
back: resetting the emulator (``POST /sim/reset``) leaves the clock alone.

In-process tests hand one in (``SimConfig(clock=SimClock())``) and advance it;
out-of-process tests and the bench use ``POST /sim/clock {"advance": seconds}``
(:mod:`.server`). A clock whose source is a constant (``SimClock(lambda: 0.0)``)
moves only when advanced: what a test that counts seconds wants.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class SimClock:
    """Seconds from ``source``, plus however far the clock has been advanced."""

    __slots__ = ("_offset", "_source")

    def __init__(self, source: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._offset = 0.0

    def __call__(self) -> float:
        return self._source() + self._offset

    @property
    def offset(self) -> float:
        """Seconds the clock has been advanced in all."""
        return self._offset

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` forward; returns the new time. ``ValueError`` when
        ``seconds`` is negative or not finite (the clock is monotonic)."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"the clock moves forward by a finite number of seconds, not {seconds!r}")
        self._offset += seconds
        return self()
