"""The errors the pure core raises: plain :class:`ValueError` subclasses.

The core imports nothing from the rest of the package, so it cannot raise kvwarm's own
errors (:mod:`proxy.errors`); the edges that call it convert these once, where the user's
context is known (a setting into :class:`~proxy.errors.ConfigError`, a transcript into a
refused import). :mod:`proxy.errors` re-exports them, so callers import every error from
one place.
"""

from __future__ import annotations

__all__ = ["InvalidSetting", "TranscriptFormatError"]


class InvalidSetting(ValueError):
    """A value given to the core is invalid. ``key`` is the dotted setting it came from."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class TranscriptFormatError(ValueError):
    """A Markdown transcript is malformed. ``line`` is 1-based."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(f"line {line}: {problem}")
        self.line = line
        self.problem = problem
