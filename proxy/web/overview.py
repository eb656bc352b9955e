"""Everything the ``/kvwarm/`` page shows, as one JSON-able value: what ``/kvwarm/api/overview`` returns.

Who sees what (the access decision is :func:`proxy.ops.admin.decide_access`'s):

* The operator (a loopback client, or the admin token) sees the whole process:
  ``totals`` (the Prometheus counters since start: the very numbers of ``/metrics``),
  ``recent`` (the last 5 minutes), ``today`` (since local midnight), ``history`` (the
  per-minute ring), breaks by reason from ``kvwarm_prefix_breaks_total``, and every
  tenant's sessions and break examples.
* A tenant (its own API key) sees its own sessions and break examples only, and
  ``mine``: the sum of its sessions' totals from the store. The process-wide numbers
  are ``null`` for a tenant: they add up every tenant's traffic and spend, which is
  not a tenant's to read. (``/metrics`` is a separate endpoint with its own rule.)

Process-wide numbers are this process's: with several workers or replicas each has its
own counters, ring and examples (``process.pid`` says which one answered). Sessions come
from the transcript store, shared when the store is. Pure: the caller reads the registry
and the store; times are Unix seconds.

A store that cannot answer (a shared one out of reach) leaves the overview whole: ``store``
says so (``available`` false, and a ``message`` for people), the sessions are empty and their
count (and a tenant's ``mine``) ``null`` -- unknown, not zero -- and every process-wide
number is there as usual.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import orjson
from yarl import URL

from ..ops.sessions import summary
from ..store.base import Node, SessionInfo
from .activity import Activity, BreakExample
from .counters import Reading, Totals
from .history import DAY_MINUTES, History

__all__ = [
    "RECENT_MINUTES",
    "TOP_SESSIONS",
    "WINDOWS",
    "Viewer",
    "build_overview",
    "display_url",
    "local_midnight",
    "preview_of",
    "top_sessions",
    "window_minutes",
]

RECENT_MINUTES = 5
"""The "now" of the hit %: the last 5 minutes (and the current one)."""
TOP_SESSIONS = 10
EXAMPLES = 12
WINDOWS = (60, 180, 360, 720, DAY_MINUTES)
"""Chart windows in minutes: the smallest that covers the process's uptime, in 60 buckets."""
BUCKETS = 60
PREVIEW_CHARS = 100
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True, slots=True, kw_only=True)
class Viewer:
    """Who is looking: the access decision, reduced to what the overview needs."""

    tenant: bytes | None
    """Only this tenant's sessions and examples; None: everything (the operator)."""
    why: str
    """The rule that granted access: ``loopback``, ``admin-token`` or ``tenant``."""


def window_minutes(uptime_seconds: float) -> int:
    """The chart window for a process that has run ``uptime_seconds``."""
    needed = int(uptime_seconds // 60) + 1
    return next((w for w in WINDOWS if w >= needed), WINDOWS[-1])


def local_midnight(now: float) -> float:
    """The last midnight, in the server's local time zone, as Unix time."""
    local = datetime.fromtimestamp(now).astimezone()
    return local.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


def _totals_json(t: Totals) -> dict[str, Any]:
    out: dict[str, Any] = {f.name: _number(getattr(t, f.name)) for f in fields(Totals)}
    pct = t.hit_pct
    out["hit_pct"] = None if pct is None else pct
    out["net_savings_usd"] = t.net_savings_usd
    return out


def _number(value: float) -> int | float:
    """Counts as integers, money as floats: counters hold floats, but tokens are whole."""
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else value


def preview_of(path: Sequence[Node]) -> str:
    """A session's latest user message (``path`` is its nodes), whitespace collapsed, cut to :data:`PREVIEW_CHARS`."""
    for node in reversed(path):
        if node.role != "user":
            continue
        try:
            message = orjson.loads(node.body)
        except orjson.JSONDecodeError:
            return ""
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = " ".join(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if not isinstance(content, str):
            return ""
        text = _SPACES.sub(" ", content).strip()
        return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"
    return ""


def top_sessions(infos: Sequence[SessionInfo]) -> list[SessionInfo]:
    """The :data:`TOP_SESSIONS` sessions with the most tokens (prompt + completion), most first."""
    return heapq.nlargest(TOP_SESSIONS, infos, key=lambda i: i.totals.prompt_tokens + i.totals.completion_tokens)


def display_url(url: str) -> str:
    """``url`` without user, password, query or fragment (they may hold credentials)."""
    try:
        parsed = URL(url)
        return str(parsed.with_user(None).with_query(None).with_fragment(None))
    except (ValueError, TypeError):
        return "(unparsable URL)"


def _upstream_json(upstream: Mapping[str, Any], operator: bool) -> dict[str, Any]:
    """A replica: where it is (credentials stripped), its health, and for the operator its load."""
    out: dict[str, Any] = {"url": display_url(str(upstream["url"])), "state": upstream.get("state", "")}
    for name in ("inflight", "requests", "ejections"):
        out[name] = upstream.get(name) if operator else None
    return out


def _session_json(info: SessionInfo, preview: str) -> dict[str, Any]:
    out = summary(info.leaf, info.tenant, info.depth, info.totals)
    out["tokens"] = info.totals.prompt_tokens + info.totals.completion_tokens
    out["updated_at"] = info.totals.updated
    out["href"] = f"/kvwarm/sessions/{out['id']}.md"
    out["preview"] = preview
    return out


def _mine(infos: Sequence[SessionInfo]) -> dict[str, Any]:
    prompt = sum(i.totals.prompt_tokens for i in infos)
    cached = sum(i.totals.cached_tokens for i in infos)
    known_turns = sum(i.totals.turns - i.totals.unknown_cache_turns for i in infos)
    return {
        "sessions": len(infos),
        "turns": sum(i.totals.turns for i in infos),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": sum(i.totals.completion_tokens for i in infos),
        "cost_usd": sum(i.totals.cost_usd for i in infos),
        "hit_pct": 100.0 * cached / prompt if prompt > 0 and known_turns > 0 else None,
        "repaired": sum(i.totals.repaired for i in infos),
    }


def _history_json(history: History, current: Totals, now: float, uptime: float) -> dict[str, Any]:
    window = window_minutes(uptime)
    size = window // BUCKETS
    per_minute = history.minutes(now, window, current)
    end_minute = int(now // 60) + 1
    buckets = []
    for i in range(0, window, size):
        chunk = per_minute[i : i + size]
        cached = sum(m.cached_tokens for m in chunk)
        known = sum(m.cache_known_tokens for m in chunk)
        buckets.append(
            {
                "start": float((end_minute - window + i) * 60),
                "requests": _number(sum(m.requests for m in chunk)),
                "cached_tokens": _number(cached),
                "cache_known_tokens": _number(known),
                "hit_pct": 100.0 * cached / known if known > 0 else None,
            }
        )
    return {"window_minutes": window, "bucket_minutes": size, "end": float(end_minute * 60), "buckets": buckets}


def build_overview(
    *,
    viewer: Viewer,
    reading: Reading,
    history: History,
    activity: Activity,
    sessions: Sequence[SessionInfo],
    previews: Mapping[bytes, str],
    upstreams: Sequence[Mapping[str, Any]],
    routing: str,
    now: float,
    pid: int,
    version: str,
    workers: int = 1,
    store_error: str | None = None,
    store_health: str = "ok",
) -> dict[str, Any]:
    """The overview for ``viewer``; ``reading`` is a live read of the registry taken at ``now``.

    ``sessions`` are the viewer's sessions (``store.sessions(viewer.tenant)``), ``previews``
    the :func:`preview_of` of (at least) their :func:`top_sessions`, by leaf. ``upstreams``
    are the pool's replicas (``Router.describe()``), ``routing`` its policy. ``workers``: how
    many worker processes serve the port (``server.workers``), ``pid`` the one answering.
    ``store_error``: why the sessions could not be read (then ``sessions`` is empty);
    ``store_health``: the store's :meth:`~proxy.store.base.AsyncStore.health`.
    """
    operator = viewer.tenant is None
    uptime = max(0.0, now - history.started)
    infos = sessions
    out: dict[str, Any] = {
        "object": "kvwarm.overview",
        "version": version,
        "generated_at": now,
        "scope": "all" if operator else "tenant",
        "access": viewer.why,
        "process": {"pid": pid, "workers": workers, "started_at": history.started, "uptime_seconds": uptime},
        "totals": None,
        "recent": None,
        "today": None,
        "history": None,
        "mine": None,
        "sessions": [_session_json(i, previews.get(i.leaf, "")) for i in top_sessions(infos)],
        "session_count": len(infos) if store_error is None else None,
        "store": _store_json(store_error, store_health, operator),
        # The upstream pool: one entry per replica. Its load is process-wide: the operator's.
        "upstreams": [_upstream_json(u, operator) for u in upstreams],
        "routing": routing if len(upstreams) > 1 else None,
    }
    out["examples"] = [_example_json(e) for e in activity.examples(viewer.tenant, EXAMPLES)]
    if operator:
        out.update(_process_numbers(reading, history, now, uptime))
        counts: Mapping[str, float] = reading.breaks_by_reason
    else:
        out["mine"] = _mine(infos) if store_error is None else None
        counts = activity.counts(viewer.tenant)
    out["breaks"] = _breaks_json(counts)
    return out


def _breaks_json(counts: Mapping[str, float]) -> list[dict[str, Any]]:
    """Breaks by reason, the most frequent first."""
    return [
        {"reason": reason, "count": _number(n)}
        for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if n > 0
    ]


def _store_json(error: str | None, health: str, operator: bool) -> dict[str, Any]:
    """Whether the sessions could be read, and a line for people when not (or when the store is
    degraded). Why, and the store's health, are the operator's to read."""
    message = None
    if error is not None:
        why = f" ({error})" if operator else ""
        message = (
            f"The session store is unavailable{why}: sessions cannot be listed right now. Requests are "
            "still served, unrepaired; the figures shown are this process's own."
        )
    elif health != "ok" and operator:
        message = f"The session store is {health}."
    return {"available": error is None, "health": health if operator else None, "message": message}


def _process_numbers(reading: Reading, history: History, now: float, uptime: float) -> dict[str, Any]:
    """The operator's process-wide numbers: ``totals`` since start, ``recent``, ``today``, ``history``."""
    current = reading.totals
    midnight = local_midnight(now)
    recent = _totals_json(history.since(now - (RECENT_MINUTES - 1) * 60, current))
    recent["minutes"] = RECENT_MINUTES
    today = _totals_json(history.since(midnight, current))
    today["since"] = midnight
    return {
        "totals": _totals_json(current),
        "recent": recent,
        "today": today,
        "history": _history_json(history, current, now, uptime),
    }


def _example_json(e: BreakExample) -> dict[str, Any]:
    return {
        "reason": e.reason,
        "where": e.where,
        "role": e.role,
        "shape": e.shape,
        "hint": e.hint,
        "pin_line": e.pin_line,
        "count": e.count,
        "first_seen": e.first_seen,
        "last_seen": e.last_seen,
        "tenant": e.tenant.hex(),
    }
