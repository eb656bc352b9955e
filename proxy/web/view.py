"""The overview formatted for people: the strings and chart geometry the page binds.

A view has three parts, each keyed by the slot names of :mod:`proxy.web.page`:

``text``   slot -> string (``data-k`` elements: cards, captions, chart labels)
``attrs``  slot -> SVG path data (``data-d`` elements: the hit % line, its dots, request bars)
``lists``  list -> rows, each row field -> string (``data-list`` containers, one
           ``<template data-for>`` row each: ``data-f`` text, ``data-href`` links,
           ``data-tone-f`` colour tones, ``data-hide-empty`` optional parts)

(``data-tone-k`` elements take their ``data-tone`` from a ``text`` slot.)

The server renders the first page from a view and the script re-binds each polled view
into the same slots with ``textContent`` / ``setAttribute``: all formatting lives here,
once, and nothing the page shows is ever parsed as HTML. Pure: values in, strings out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CHART_HEIGHT",
    "CHART_WIDTH",
    "REASON_TEXT",
    "build_view",
    "chart_paths",
    "fmt_age",
    "fmt_count",
    "fmt_duration",
    "fmt_pct",
    "fmt_usd",
]

CHART_WIDTH = 600
CHART_HEIGHT = 100
BARS_HEIGHT = 28.0
"""The request bars use the bottom 28 % of the chart."""
DASH = "—"

REASON_TEXT: Mapping[str, str] = {
    "content_changed": "a message's text changed",
    "system_changed": "the system prompt changed",
    "tools_changed": "the tool definitions changed",
    "message_inserted": "a message was added to the history",
    "message_removed": "a message was dropped from the history",
    "truncated_head": "the history's head was cut (a sliding window)",
    "duplicate_replay": "a message was sent twice in a row",
    "reasoning_changed": "reasoning was added, dropped or changed",
    "assistant_modified": "the client changed a generated reply",
}
"""One line per prefix-break reason (``proxy.core.breaks.REASONS``), for the breaks table."""


def fmt_count(value: float | None) -> str:
    """``12,345``: whole tokens / requests, exact."""
    if value is None:
        return DASH
    return f"{round(value):,}"


def fmt_pct(value: float | None) -> str:
    """``83.2 %`` (one decimal, as ``%.1f``); a dash when unknown."""
    return DASH if value is None else f"{value:.1f} %"


def fmt_usd(value: float | None) -> str:
    """``$0.0123`` below a dollar (four decimals: agent turns cost fractions of a cent), else
    ``$12.34``; a loss ``-$0.0123``."""
    if value is None:
        return DASH
    if value < 0 and fmt_usd(-value) != fmt_usd(0.0):
        return "-" + fmt_usd(-value)
    if abs(value) < 1:
        return f"${abs(value):.4f}"
    return f"${value:,.2f}"


def fmt_duration(seconds: float) -> str:
    """``42 s``, ``5 min``, ``3 h 12 min``, ``2 d 3 h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def fmt_age(then: float, now: float) -> str:
    """``just now``, ``12 s ago``, ``5 min ago``..."""
    delta = now - then
    if delta < 5:
        return "just now"
    return f"{fmt_duration(delta)} ago"


def _tone(pct: float | None) -> str:
    if pct is None:
        return "none"
    return "good" if pct >= 80 else "mid" if pct >= 40 else "bad"


def _num(value: float) -> str:
    """A coordinate: short, no exponent."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def chart_paths(buckets: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """SVG path data in a ``0 0 600 100`` box: the hit % line (gaps where nothing was known),
    dots for points with no neighbour, and one bar per bucket for its requests."""
    n = len(buckets)
    if n == 0:
        return {"chart_line": "", "chart_dots": "", "chart_bars": ""}
    step = CHART_WIDTH / n
    line: list[str] = []
    dots: list[str] = []
    bars: list[str] = []
    peak = max((float(b.get("requests") or 0) for b in buckets), default=0.0)
    previous = False
    for i, bucket in enumerate(buckets):
        x = (i + 0.5) * step
        pct = bucket.get("hit_pct")
        if pct is None:
            previous = False
        else:
            y = CHART_HEIGHT - max(0.0, min(100.0, float(pct))) * CHART_HEIGHT / 100
            line.append(f"{'L' if previous else 'M'}{_num(x)} {_num(y)}")
            following = i + 1 < n and buckets[i + 1].get("hit_pct") is not None
            if not previous and not following:
                dots.append(f"M{_num(x)} {_num(y)}h0")
            previous = True
        requests = float(bucket.get("requests") or 0)
        if requests > 0 and peak > 0:
            height = max(1.5, BARS_HEIGHT * requests / peak)
            left = i * step + step * 0.15
            bars.append(f"M{_num(left)} {CHART_HEIGHT}v-{_num(height)}h{_num(step * 0.7)}v{_num(height)}z")
    return {"chart_line": "".join(line), "chart_dots": "".join(dots), "chart_bars": "".join(bars)}


def _window(minutes: int) -> str:
    return f"{minutes // 60} h" if minutes >= 120 else f"{minutes} min"


def _chart_text(history: Mapping[str, Any] | None) -> dict[str, str]:
    if history is None:
        return {}
    window = int(history["window_minutes"])
    size = int(history["bucket_minutes"])
    peak = max((float(b["requests"]) for b in history["buckets"]), default=0.0)
    rate = f"peak {fmt_count(peak)} per {size} min" if peak else "no requests yet"
    return {
        "chart_caption": f"Cache hit % per {size} min over the last {_window(window)} · bars: requests ({rate})",
        "chart_start": f"{_window(window)} ago",
        "chart_mid": f"{_window(window // 2)} ago",
        "chart_end": "now",
    }


def _session_rows(sessions: Sequence[Mapping[str, Any]], now: float, operator: bool) -> list[dict[str, str]]:
    rows = []
    for s in sessions:
        updated = s.get("updated_at")
        rows.append(
            {
                "id": str(s["id"])[:12] + "…",
                "href": str(s["href"]),
                "model": str(s.get("model") or DASH),
                "preview": str(s.get("preview") or ""),
                "turns": fmt_count(s.get("turns")),
                "tokens": fmt_count(s.get("tokens")),
                "hit": fmt_pct(s.get("cache_hit_pct")),
                "hit_tone": _tone(s.get("cache_hit_pct")),
                "cost": fmt_usd(s.get("cost_usd")) + ("" if s.get("cost_billed") else " est."),
                "last_break": str(s.get("last_break") or ""),
                "updated": fmt_age(float(updated), now) if isinstance(updated, int | float) else str(s.get("updated") or ""),
                "tenant": f"tenant {str(s.get('tenant', ''))[:8]}" if operator else "",
            }
        )
    return rows


_POLICY_TEXT = {
    "prefix": "each session goes to the replica holding its prefix (bounded load)",
    "round_robin": "round robin",
    "least_inflight": "fewest requests in flight",
}
_STATE_TONE = {"healthy": "good", "half-open": "mid", "ejected": "bad"}


def _upstream_rows(upstreams: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    return [
        {
            "url": str(u["url"]),
            "state": str(u["state"]),
            "state_tone": _STATE_TONE.get(str(u["state"]), "none"),
            "inflight": fmt_count(u.get("inflight")),
            "requests": fmt_count(u.get("requests")),
            "ejections": fmt_count(u.get("ejections")),
        }
        for u in upstreams
    ]


def _example_rows(examples: Sequence[Mapping[str, Any]], now: float, operator: bool) -> list[dict[str, str]]:
    rows = []
    for e in examples:
        pin = str(e.get("pin_line") or "")
        regex = ""
        if pin:
            note = ""
        elif e.get("where") == "tools":
            note = "Tool definitions cannot be pinned: make the client send the same tools every turn."
        elif not e.get("hint"):
            note = "The change is too long to pin with a pattern."
        else:
            note = f"Pin patterns are per role: add this regex to the list of the role of {e.get('where')}:"
            regex = str(e.get("hint"))
        count = int(e.get("count") or 0)
        rows.append(
            {
                "reason": str(e.get("reason", "")),
                "where": str(e.get("where", "")),
                "shape": str(e.get("shape", "")),
                "pin": pin,
                "pin_note": note,
                "regex": regex,
                "seen": f"{count}× · last {fmt_age(float(e.get('last_seen') or 0), now)}",
                "tenant": f"tenant {str(e.get('tenant', ''))[:8]}" if operator else "",
            }
        )
    return rows


def _break_rows(breaks: Sequence[Mapping[str, Any]], examples: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    latest: dict[str, str] = {}
    for e in examples:  # newest first
        latest.setdefault(str(e.get("reason")), f"{e.get('where')}: {e.get('shape')}")
    return [
        {
            "reason": str(b["reason"]),
            "explain": REASON_TEXT.get(str(b["reason"]), ""),
            "count": fmt_count(b.get("count")),
            "latest": latest.get(str(b["reason"]), ""),
        }
        for b in breaks
    ]


def _process_name(process: Mapping[str, Any]) -> str:
    """``pid 123``, or with several workers ``worker 123 of 4``: the page shows the one that answered."""
    workers = int(process.get("workers") or 1)
    return f"worker {process['pid']} of {workers}" if workers > 1 else f"pid {process['pid']}"


def build_view(overview: Mapping[str, Any]) -> dict[str, Any]:
    """The view of an overview (:func:`proxy.web.overview.build_overview`)."""
    now = float(overview["generated_at"])
    operator = overview["scope"] == "all"
    upstreams = overview["upstreams"]
    text = _header_text(overview, operator, now)
    text["upstream"] = _upstream_text(upstreams, overview.get("routing"))
    text["store_note"] = str(overview["store"]["message"] or "")
    attrs: dict[str, str] = {}
    if overview.get("totals") is not None:
        text.update(_process_text(overview))
        text.update(_chart_text(overview["history"]))
        attrs = chart_paths(overview["history"]["buckets"])
    else:
        text.update(_mine_text(overview["mine"]))
    examples = overview["examples"]
    lists = {
        "breaks": _break_rows(overview["breaks"], examples),
        "examples": _example_rows(examples, now, operator),
        "sessions": _session_rows(overview["sessions"], now, operator),
        "upstreams": _upstream_rows(upstreams) if len(upstreams) > 1 else [],
    }
    return {"text": text, "attrs": attrs, "lists": lists}


def _header_text(overview: Mapping[str, Any], operator: bool, now: float) -> dict[str, str]:
    """Who is looking, which process answered, when; the store's session count."""
    process = overview["process"]
    who = {"loopback": "operator on this host", "admin-token": "admin token", "tenant": "your API key"}
    return {
        "scope": ("all tenants" if operator else "your sessions only") + f" · {who.get(overview['access'], overview['access'])}",
        "process": f"{_process_name(process)} · up {fmt_duration(process['uptime_seconds'])}",
        "generated": time.strftime("%H:%M:%S UTC", time.gmtime(now)),
        "session_count": (
            "the store is unavailable"
            if overview["session_count"] is None
            else f"{fmt_count(overview['session_count'])} in the store"
        ),
    }


def _upstream_text(upstreams: Sequence[Mapping[str, Any]], routing: object) -> str:
    """One upstream, or the pool: its size, how many are healthy, and its routing policy."""
    if len(upstreams) == 1:
        return f"one upstream: {upstreams[0]['url']}"
    healthy = sum(1 for u in upstreams if u["state"] == "healthy")
    return f"{len(upstreams)} replicas, {healthy} healthy · {_POLICY_TEXT.get(str(routing), str(routing))}"


def _process_text(overview: Mapping[str, Any]) -> dict[str, str]:
    """The operator's cards: this process's totals, the last minutes, today."""
    totals, recent, today = overview["totals"], overview["recent"], overview["today"]
    unpriced = int(today["unpriced_requests"])
    failed = int(totals["requests_failed"])
    return {
        "hit_total": fmt_pct(totals["hit_pct"]),
        "hit_tone": _tone(totals["hit_pct"]),
        "hit_tokens": f"{fmt_count(totals['cached_tokens'])} of {fmt_count(totals['cache_known_tokens'])} prompt tokens cached",
        "hit_recent": (
            f"{fmt_pct(recent['hit_pct'])} in the last {recent['minutes']} min"
            if recent["hit_pct"] is not None
            else f"no cache data in the last {recent['minutes']} min"
        ),
        "tokens_note": f"{fmt_count(totals['prompt_tokens'])} prompt · {fmt_count(totals['completion_tokens'])} completion tokens",
        "cache_rw": (
            f"{fmt_count(totals['cached_tokens'])} read · {fmt_count(totals['cache_write_tokens'])} written to the cache"
        ),
        "rescued": fmt_count(totals["rescued_tokens"]),
        "rescued_note": f"prompt tokens kept cacheable by {fmt_count(totals['repairs'])} repairs",
        **_savings_text(today),
        **_provider_text(totals),
        "cost_today": fmt_usd(today["cost_billed_usd"] + today["cost_estimated_usd"] + today["cost_keepalive_usd"]),
        "cost_split": f"billed {fmt_usd(today['cost_billed_usd'])} · estimated {fmt_usd(today['cost_estimated_usd'])}"
        + (f" · keep-alive {fmt_usd(today['cost_keepalive_usd'])}" if today["cost_keepalive_usd"] else ""),
        **_keepalive_text(today),
        "cost_note": f"{unpriced} unpriced request{'s' if unpriced != 1 else ''} not included" if unpriced else "",
        "requests": fmt_count(totals["requests"]),
        "requests_note": f"{fmt_count(today['requests'])} today · {failed} not 2xx",
        "breaks_total": fmt_count(totals["breaks"]),
        "today_since": time.strftime("since %H:%M %Z", time.localtime(float(today["since"]))),
    }


def _savings_text(today: Mapping[str, Any]) -> dict[str, str]:
    """The "saved by the cache" card: today's net saving (negative while the writes are not
    repaid), how it splits into reads and writes, and the repairs' share."""
    net = float(today["net_savings_usd"])
    return {
        "saved_today": fmt_usd(net),
        "saved_tone": "good" if net > 0 else "bad" if net < 0 else "none",
        "saved_split": f"reads saved {fmt_usd(today['savings_usd'])} · writes cost {fmt_usd(today['write_premium_usd'])} extra",
        "saved_repair": f"{fmt_usd(today['repair_savings_usd'])} of it by repairs",
    }


def _provider_text(totals: Mapping[str, Any]) -> dict[str, str]:
    """The "misses the provider diagnosed" card: the prefixes the provider lost (its TTL, an
    eviction, routing), beside the misses it put down to a changed request (kvwarm's own breaks
    say where the client drifted)."""
    verdicts = float(totals["provider_verdicts"])
    return {
        "provider_lost": fmt_count(totals["provider_side_misses"]),
        "provider_split": f"provider-side: it lost the prefix · {fmt_count(totals['client_side_misses'])} client-side: the request changed",
        "provider_note": (
            f"of {fmt_count(verdicts)} responses the provider diagnosed"
            if verdicts
            else "none diagnosed: set upstream.provider_diagnostics where the provider can say"
        ),
    }


def _keepalive_text(today: Mapping[str, Any]) -> dict[str, str]:
    """The keep-alive card: today's pings, the writes they avoided less what they cost, and what
    they lost on sessions that never came back (proxy/keepalive/)."""
    pings, cost = float(today["keepalive_pings"]), float(today["cost_keepalive_usd"])
    saved, lost = float(today["keepalive_saved_usd"]), float(today["keepalive_lost_usd"])
    if not (pings or cost or saved or lost):
        return {
            "keepalive_net": DASH,
            "keepalive_pings": "no keep-alive pings today",
            "keepalive_split": "opt-in: [keepalive] enabled = true",
        }
    return {
        "keepalive_net": fmt_usd(saved - cost),
        "keepalive_pings": f"{fmt_count(pings)} ping{'s' if round(pings) != 1 else ''} cost {fmt_usd(cost)}",
        "keepalive_split": f"writes avoided {fmt_usd(saved)} · lost on sessions not back {fmt_usd(lost)}",
    }


def _mine_text(mine: Mapping[str, Any] | None) -> dict[str, str]:
    """A tenant's cards: the sum of its own sessions (dashes while the store cannot say)."""
    if mine is None:
        return {
            "mine_sessions": DASH,
            "mine_turns": "the store is unavailable",
            "mine_hit": DASH,
            "mine_tokens": "",
            "mine_cost": DASH,
            "mine_repaired": "",
        }
    return {
        "mine_sessions": fmt_count(mine["sessions"]),
        "mine_turns": f"{fmt_count(mine['turns'])} turns",
        "mine_hit": fmt_pct(mine["hit_pct"]),
        "mine_tokens": f"{fmt_count(mine['cached_tokens'])} of {fmt_count(mine['prompt_tokens'])} prompt tokens cached",
        "mine_cost": fmt_usd(mine["cost_usd"]),
        "mine_repaired": f"{fmt_count(mine['repaired'])} messages repaired",
    }
