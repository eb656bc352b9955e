"""The latest prefix breaks, per tenant and reason, and the ``pin_patterns`` line that would pin each.

The request path calls :meth:`Activity.note_break` for every diagnosed break that located
a changed span (``kvwarm_prefix_breaks_total`` counts every break; this keeps a few
*examples*). An example is the span's position and *shape* (digits as ``d``, letters as
``a``: never the client's text) and the regex the diagnosis suggested. The page shows
them with the exact line to paste under ``[repair.pin_patterns]``.

Bounded whatever the traffic: at most ``max_tenants`` tenants (the least recently noted
is forgotten first), ``max_reasons`` reasons per tenant, and ``per_reason`` distinct
examples per reason (a repeat of the same position, shape and hint only counts up; the
oldest distinct example goes first). Strings are cut to fixed lengths.

In memory, per process: each worker or replica keeps the breaks it diagnosed itself.
Not thread-safe: called from the event loop only.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["Activity", "BreakExample", "pin_line", "toml_string"]

_MAX_REASON = 64
_MAX_WHERE = 32
_MAX_ROLE = 32
_MAX_SHAPE = 96
_MAX_HINT = 512
"""A longer hint is dropped (a cut regex is no regex); the example keeps its shape."""
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ROLE_OF_REASON = {"system_changed": "system"}
"""The role a reason implies when the caller did not name one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakExample:
    """One distinct break example of a tenant (a snapshot: later repeats do not change it)."""

    tenant: bytes
    """The tenant root (a keyed hash, never the credential)."""
    reason: str
    where: str
    """``messages[i]`` or ``tools``."""
    role: str
    """Role of the changed message when known (``system``, ``user``, ...); empty otherwise."""
    shape: str
    hint: str
    """The suggested ``pin_patterns`` regex; empty when the span was too long to pin."""
    count: int
    """How many breaks had this position, shape and hint."""
    first_seen: float
    last_seen: float

    @property
    def pin_line(self) -> str:
        """The TOML line for ``[repair.pin_patterns]``; empty when this break cannot be pinned."""
        return pin_line(self.role, self.hint) if self.where != "tools" else ""


def toml_string(text: str) -> str:
    """``text`` as a TOML string: a literal string when it can be one (regexes read best so)."""
    if "'" not in text and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return f"'{text}'"
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def pin_line(role: str, hint: str) -> str:
    """``system = ['\\d{4}...']``: the line under ``[repair.pin_patterns]`` that pins ``hint`` for ``role``.

    Empty when there is no role or no hint, or the hint is not a regex kvwarm would accept
    (it must compile and must not match the empty string).
    """
    if not role or not hint:
        return ""
    try:
        if re.compile(hint).fullmatch(""):
            return ""
    except re.error:
        return ""
    key = role if _BARE_KEY.fullmatch(role) else toml_string(role)
    return f"{key} = [{toml_string(hint)}]"


@dataclass(slots=True, kw_only=True)
class _Seen:
    count: int
    first: float
    last: float


@dataclass(slots=True, kw_only=True)
class _TenantLog:
    examples: dict[str, OrderedDict[tuple[str, str, str, str], _Seen]] = field(default_factory=dict)
    """reason -> (where, role, shape, hint) -> seen; least recently seen first."""
    counts: dict[str, int] = field(default_factory=dict)
    """reason -> breaks noted (examples forgotten since included)."""


class Activity:
    """Bounded memory of the latest break examples, per tenant and reason."""

    def __init__(self, per_reason: int = 4, max_tenants: int = 256, max_reasons: int = 16) -> None:
        self.per_reason = max(1, per_reason)
        self.max_tenants = max(1, max_tenants)
        self.max_reasons = max(1, max_reasons)
        self._tenants: OrderedDict[bytes, _TenantLog] = OrderedDict()

    def note_break(
        self, tenant: bytes, reason: str, where: str, shape: str, hint: str, now: float, *, role: str = ""
    ) -> None:
        """Remember one diagnosed break of ``tenant`` (its root) whose changed span was located.

        ``where`` names the element (``messages[3]`` or ``tools``), ``shape`` and ``hint`` are
        the span's (``proxy.core.breaks.Span``), ``now`` is Unix time. ``role``, the changed
        message's role, picks the ``pin_patterns`` key; without it only ``system_changed``
        gets a pin line (role ``system``). An empty ``shape`` is counted without an example.
        """
        reason = str(reason)[:_MAX_REASON]
        role = (str(role) or _ROLE_OF_REASON.get(reason, ""))[:_MAX_ROLE]
        hint = str(hint)
        if len(hint) > _MAX_HINT:
            hint = ""
        log = self._tenants.get(tenant)
        if log is None:
            log = self._tenants[tenant] = _TenantLog()
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        if reason not in log.counts and len(log.counts) >= self.max_reasons:
            return
        log.counts[reason] = log.counts.get(reason, 0) + 1
        if not shape:
            return
        seen = log.examples.setdefault(reason, OrderedDict())
        key = (str(where)[:_MAX_WHERE], role, str(shape)[:_MAX_SHAPE], hint)
        entry = seen.get(key)
        if entry is None:
            seen[key] = _Seen(count=1, first=now, last=now)
            while len(seen) > self.per_reason:
                seen.popitem(last=False)
        else:
            entry.count += 1
            entry.last = max(entry.last, now)
            seen.move_to_end(key)

    def examples(self, tenant: bytes | None = None, limit: int = 20) -> list[BreakExample]:
        """The examples of ``tenant`` (of every tenant when None), most recently seen first."""
        out: list[BreakExample] = []
        for root, log in self._logs(tenant):
            for reason, seen in log.examples.items():
                for (where, role, shape, hint), s in seen.items():
                    out.append(BreakExample(tenant=root, reason=reason, where=where, role=role, shape=shape, hint=hint, count=s.count, first_seen=s.first, last_seen=s.last))
        out.sort(key=lambda e: e.last_seen, reverse=True)
        return out[: max(0, limit)]

    def counts(self, tenant: bytes | None = None) -> dict[str, int]:
        """Breaks noted by reason, for ``tenant`` (every tenant when None) since it was last forgotten."""
        out: dict[str, int] = {}
        for _root, log in self._logs(tenant):
            for reason, n in log.counts.items():
                out[reason] = out.get(reason, 0) + n
        return out

    def _logs(self, tenant: bytes | None) -> list[tuple[bytes, _TenantLog]]:
        if tenant is None:
            return list(self._tenants.items())
        log = self._tenants.get(tenant)
        return [(tenant, log)] if log is not None else []
