"""The repair policy: what kvwarm may rewrite, and the opt-in rules that change what the model sees.

Built once from :class:`~proxy.config.RepairSettings` and passed to identity, matching and
repair. Defaults are the safe ones: repair on, duplicates kept, nothing pinned.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import InvalidSetting

PIN_MASK = "\x00pinned\x00"
"""What a pinned span becomes before hashing. NUL never occurs in text a client means to send."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    repair: bool = True
    """False: observe only. Match and diagnose, never rewrite (no reorder, no collapse)."""
    collapse_duplicates: bool = False
    """Opt-in: drop an exact replayed duplicate of the previous message from the forwarded body."""
    pin_patterns: Mapping[str, tuple[re.Pattern[str], ...]] = field(default_factory=dict)
    """Opt-in: role -> regexes of volatile spans; identity masks them, repair restores the stored span."""

    @classmethod
    def build(
        cls, repair: bool, collapse_duplicates: bool, pin_patterns: Mapping[str, Sequence[str]]
    ) -> Policy:
        """Compile the pin patterns; a pattern that does not compile, or matches the empty string, is an InvalidSetting naming the key."""
        compiled: dict[str, tuple[re.Pattern[str], ...]] = {}
        for role, patterns in pin_patterns.items():
            if isinstance(patterns, str):
                patterns = (patterns,)
            out: list[re.Pattern[str]] = []
            for pattern in patterns:
                key = f"repair.pin_patterns.{role}"
                try:
                    rx = re.compile(pattern)
                except re.error as exc:
                    raise InvalidSetting(key, f"invalid regex {pattern!r}: {exc}") from exc
                if rx.fullmatch(""):
                    # It would mask the empty string between every two characters.
                    raise InvalidSetting(key, f"regex {pattern!r} matches the empty string")
                out.append(rx)
            if out:
                compiled[role] = tuple(out)
        return cls(
            repair=bool(repair),
            collapse_duplicates=bool(collapse_duplicates),
            pin_patterns=compiled,
        )

    def pins(self, role: object) -> tuple[re.Pattern[str], ...]:
        """The pin patterns of ``role`` (empty when none)."""
        if not self.pin_patterns or not isinstance(role, str):
            return ()
        return self.pin_patterns.get(role, ())


DEFAULT_POLICY = Policy()
