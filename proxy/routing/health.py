"""Passive health of one replica: ejected after failures, back after a pause, probed by one request.

Nothing is polled: the requests themselves are the probes (Envoy's and nginx's *passive*
health checking). A replica is

``healthy``
    it takes requests. ``errors`` failures (a 5xx response, a request that broke off)
    within ``window`` seconds eject it; a connection that could not be opened (refused,
    unreachable, connect timeout) ejects it at once: the server is not there.
``ejected``
    for ``eject_seconds`` it takes no requests (unless no replica is left: a request never
    fails for want of a healthy replica, it goes to the one that returns soonest).
``half-open``
    the pause is over: the next request is a probe, and only one at a time. A probe that
    succeeds makes the replica healthy; one that fails ejects it for another pause.

Pure: times are passed in (monotonic seconds); no clock, no I/O.
"""

from __future__ import annotations

from collections import deque

__all__ = ["EJECTED", "HALF_OPEN", "HEALTHY", "Health"]

HEALTHY = "healthy"
EJECTED = "ejected"
HALF_OPEN = "half-open"


class Health:
    """The health of one replica, from the outcomes of the requests it served."""

    __slots__ = ("_failures", "_probing", "_until", "eject_seconds", "errors", "window")

    def __init__(self, errors: int = 3, window: float = 10.0, eject_seconds: float = 30.0) -> None:
        self.errors = max(1, errors)
        self.window = window
        self.eject_seconds = eject_seconds
        self._failures: deque[float] = deque()
        """Times of the recent failures (within ``window``), oldest first."""
        self._until: float | None = None
        """Ejected until then; None: healthy."""
        self._probing = False
        """A half-open replica's one probe request is in flight."""

    def state(self, now: float) -> str:
        if self._until is None:
            return HEALTHY
        return EJECTED if now < self._until else HALF_OPEN

    def available(self, now: float) -> bool:
        """May take a request now: healthy, or half-open with no probe in flight."""
        if self._until is None:
            return True
        return now >= self._until and not self._probing

    def returns_at(self) -> float:
        """When an ejected replica may be probed (0 when healthy): the order of last resorts."""
        return self._until if self._until is not None else 0.0

    def begin(self) -> bool:
        """A request is placed here; True when it is a *trial*: the replica is not healthy (the
        half-open replica's probe, or a last resort while ejected). Its outcome decides."""
        if self._until is None:
            return False
        self._probing = True
        return True

    def cancel(self, trial: bool) -> None:
        """A request ended without saying anything about the replica (the client left)."""
        if trial:
            self._probing = False

    def success(self, trial: bool) -> None:
        """A request was answered without a server error; a trial's success makes the replica healthy."""
        if trial:
            self._until = None
            self._probing = False
            self._failures.clear()

    def failure(self, now: float, trial: bool = False, *, refused: bool = False) -> bool:
        """A request failed here (``refused``: no connection could be opened). True when this
        failure ejected the replica (a failed trial ejects it for another pause)."""
        if trial:
            self._probing = False
            if self._until is not None and now < self._until:
                return False  # a last resort while ejected: the pause stands
            self._until = now + self.eject_seconds
            return True
        if self._until is not None:
            return False  # placed before the ejection: already counted
        failures = self._failures
        failures.append(now)
        while failures and now - failures[0] > self.window:
            failures.popleft()
        if refused or len(failures) >= self.errors:
            failures.clear()
            self._until = now + self.eject_seconds
            return True
        return False
