"""The ``/kvwarm/`` HTML document, rendered from a view (:mod:`proxy.web.view`).

Every value sits in a *slot* the script re-binds on each poll (see :mod:`proxy.web.view`
for the slot kinds). Each list row is written by one function used twice: with the
row's values for the first render, and with empty values for the row's
``<template>``, which the script clones; so the server's rows and the script's rows
have the same markup by construction.

Everything shown is escaped with :func:`html.escape` (quotes included); the script
only ever sets ``textContent`` and attributes. The page carries no inline script or
style, so its Content-Security-Policy (:data:`CSP`) allows the page's own files only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from html import escape
from typing import Any

from .view import CHART_HEIGHT, CHART_WIDTH

__all__ = ["CSP", "LISTS", "render_page"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""Content-Security-Policy of the page: its own script, stylesheet and API; nothing inline."""


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _hidden(value: str) -> str:
    return " hidden" if value == "" else ""


# -- list rows: one function per list, used for the rows and for the <template> ---------------


def _break_row(r: Mapping[str, str]) -> str:
    return (
        "<tr>"
        f'<td data-label="Reason" class="wide"><code data-f="reason">{_e(r["reason"])}</code>'
        f'<span class="sub" data-f="explain">{_e(r["explain"])}</span></td>'
        f'<td data-label="Count" class="num" data-f="count">{_e(r["count"])}</td>'
        f'<td data-label="Latest change" class="span3"><code data-f="latest">{_e(r["latest"])}</code></td>'
        "</tr>"
    )


def _example_row(r: Mapping[str, str]) -> str:
    return (
        '<li class="example">'
        '<p class="example-head">'
        f'<code data-f="reason">{_e(r["reason"])}</code> at <code data-f="where">{_e(r["where"])}</code> '
        f'<span class="sub" data-f="seen">{_e(r["seen"])}</span> '
        f'<span class="sub" data-f="tenant" data-hide-empty="tenant"{_hidden(r["tenant"])}>{_e(r["tenant"])}</span></p>'
        f'<p>changed span: <code class="shape" data-f="shape">{_e(r["shape"])}</code></p>'
        f'<pre class="pin" data-hide-empty="pin"{_hidden(r["pin"])}><code data-f="pin">{_e(r["pin"])}</code></pre>'
        f'<p class="sub" data-hide-empty="pin_note"{_hidden(r["pin_note"])}><span data-f="pin_note">{_e(r["pin_note"])}</span> '
        f'<code data-f="regex" data-hide-empty="regex"{_hidden(r["regex"])}>{_e(r["regex"])}</code></p>'
        "</li>"
    )


def _session_row(r: Mapping[str, str]) -> str:
    return (
        "<tr>"
        f'<td data-label="Session" class="wide head"><a class="sid" data-href="href" href="{_e(r["href"])}" data-f="id">{_e(r["id"])}</a>'
        f'<span class="sub" data-f="tenant" data-hide-empty="tenant"{_hidden(r["tenant"])}>{_e(r["tenant"])}</span></td>'
        f'<td data-label="Model / latest prompt" class="wide"><span class="model" data-f="model">{_e(r["model"])}</span>'
        f'<span class="sub preview" data-f="preview">{_e(r["preview"])}</span></td>'
        f'<td data-label="Turns" class="num" data-f="turns">{_e(r["turns"])}</td>'
        f'<td data-label="Tokens" class="num" data-f="tokens">{_e(r["tokens"])}</td>'
        f'<td data-label="Hit" class="num"><span class="pill" data-tone-f="hit_tone" data-tone="{_e(r["hit_tone"])}" data-f="hit">{_e(r["hit"])}</span></td>'
        f'<td data-label="Cost" class="num" data-f="cost">{_e(r["cost"])}</td>'
        f'<td data-label="Updated" class="wide inline-label" data-f="updated">{_e(r["updated"])}'
        "</td>"
        "</tr>"
    )


def _upstream_row(r: Mapping[str, str]) -> str:
    return (
        "<tr>"
        f'<td data-label="Replica" class="wide"><code data-f="url">{_e(r["url"])}</code></td>'
        f'<td data-label="State"><span class="pill" data-tone-f="state_tone" data-tone="{_e(r["state_tone"])}" data-f="state">{_e(r["state"])}</span></td>'
        f'<td data-label="In flight" class="num" data-f="inflight">{_e(r["inflight"])}</td>'
        f'<td data-label="Requests" class="num" data-f="requests">{_e(r["requests"])}</td>'
        f'<td data-label="Ejections" class="num" data-f="ejections">{_e(r["ejections"])}</td>'
        "</tr>"
    )


_Row = Callable[[Mapping[str, str]], str]
LISTS: Mapping[str, tuple[_Row, tuple[str, ...]]] = {
    "breaks": (_break_row, ("reason", "explain", "count", "latest")),
    "examples": (_example_row, ("reason", "where", "seen", "tenant", "shape", "pin", "pin_note", "regex")),
    "sessions": (
        _session_row,
        ("id", "href", "tenant", "model", "preview", "turns", "tokens", "hit", "hit_tone", "cost", "updated"),
    ),
    "upstreams": (_upstream_row, ("url", "state", "state_tone", "inflight", "requests", "ejections")),
}
"""List name -> (row renderer, the row's fields)."""


def _hidden_list(rows: list[dict[str, str]]) -> str:
    return "" if rows else " hidden"


def _list(name: str, rows: list[dict[str, str]], tag: str, cls: str = "") -> str:
    render, row_fields = LISTS[name]
    body = "".join(render(r) for r in rows)
    template = render(dict.fromkeys(row_fields, ""))
    attr = f' class="{cls}"' if cls else ""
    return f'<{tag}{attr} data-list="{name}">{body}</{tag}><template data-for="{name}">{template}</template>'


# -- the document -----------------------------------------------------------------------------


class _Slots:
    """The ``data-k`` slots of one view: each element written with its value from the view."""

    __slots__ = ("attrs", "lists", "text")

    def __init__(self, view: Mapping[str, Any]) -> None:
        self.text: Mapping[str, str] = view["text"]
        self.attrs: Mapping[str, str] = view["attrs"]
        self.lists: Mapping[str, list[dict[str, str]]] = view["lists"]

    def k(self, key: str, tag: str = "span", cls: str = "") -> str:
        value = self.text.get(key, "")
        attr = f' class="{cls}"' if cls else ""
        return f'<{tag}{attr} data-k="{key}">{_e(value)}</{tag}>'

    def card(self, title: str, big: str, *subs: str | tuple[str, str, str], extra: str = "") -> str:
        """A card: its title, the ``big`` figure and the ``subs`` lines below it (``sub warn``:
        a ``(key, class)`` pair), ``extra`` markup last."""
        lines = "".join(self.k(*sub) if isinstance(sub, tuple) else self.k(sub, "p", "sub") for sub in subs)
        return f'<article class="card"><h2>{title}</h2>{self.k(big, "p", "big")}{lines}{extra}</article>'

    def empty(self, name: str, message: str) -> str:
        hidden = " hidden" if self.lists[name] else ""
        return f'<p class="empty" data-empty="{name}"{hidden}>{_e(message)}</p>'


def render_page(view: Mapping[str, Any], *, operator: bool, assets: Mapping[str, str], api: str, interval_ms: int) -> str:
    """The whole HTML document. ``assets`` maps ``dashboard.css``, ``dashboard.js`` and ``favicon.svg`` to their URLs."""
    slots = _Slots(view)
    if operator:
        top = _operator_cards(slots) + _chart(slots)
        breaks_title = "Prefix breaks by reason (since start)"
    else:
        top = _tenant_cards(slots)
        breaks_title = "Your prefix breaks by reason (located changes)"
    return (
        _head(slots, operator=operator, assets=assets, api=api, interval_ms=interval_ms)
        + "<main>"
        # The store's state, when it is not fine (empty, and so hidden by the stylesheet, else).
        + slots.k("store_note", "p", "banner")
        + top
        + _panels(slots, breaks_title)
        + "</main>"
        + _footer()
    )


def _head(slots: _Slots, *, operator: bool, assets: Mapping[str, str], api: str, interval_ms: int) -> str:
    """From the doctype to the page's title bar."""
    k = slots.k
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="color-scheme" content="light dark">'
        '<meta name="referrer" content="no-referrer">'
        "<title>kvwarm · cache</title>"
        f'<link rel="icon" href="{_e(assets["favicon.svg"])}" type="image/svg+xml">'
        f'<link rel="stylesheet" href="{_e(assets["dashboard.css"])}">'
        f'<script src="{_e(assets["dashboard.js"])}" defer></script>'
        "</head>"
        f'<body data-api="{_e(api)}" data-interval="{int(interval_ms)}" data-scope="{"all" if operator else "tenant"}">'
        '<header class="top"><h1>kvwarm</h1>'
        f'<p class="meta">{k("scope")} · {k("process")} · updated {k("generated")} '
        '<span class="status" id="status" role="status"></span></p></header>'
    )


def _operator_cards(slots: _Slots) -> str:
    """The operator's cards: this process's totals."""
    k = slots.k
    text = slots.text
    return (
        '<section class="cards" aria-label="Totals of this process">'
        f'<article class="card hit" data-tone-k="hit_tone" data-tone="{_e(text["hit_tone"])}">'
        f'<h2>Cache hit</h2>{k("hit_total", "p", "big")}'
        f'{k("hit_tokens", "p", "sub")}{k("cache_rw", "p", "sub")}{k("hit_recent", "p", "sub")}</article>'
        + slots.card("Rescued by repair", "rescued", "rescued_note")
        + f'<article class="card saved" data-tone-k="saved_tone" data-tone="{_e(text["saved_tone"])}">'
        f'<h2>Saved by the cache today</h2>{k("saved_today", "p", "big")}'
        f'{k("saved_split", "p", "sub")}{k("saved_repair", "p", "sub")}</article>'
        + slots.card("Cost today", "cost_today", "cost_split", "today_since", ("cost_note", "p", "sub warn"))
        + slots.card("Keep-alive today", "keepalive_net", "keepalive_pings", "keepalive_split")
        + slots.card("Requests", "requests", "requests_note", "tokens_note")
        + slots.card("Prefix breaks", "breaks_total", extra='<p class="sub">since start, by reason below</p>')
        + slots.card("Misses the provider diagnosed", "provider_lost", "provider_split", "provider_note")
        + "</section>"
    )


def _chart(slots: _Slots) -> str:
    """The cache hit % over time (the operator's): SVG paths the script re-binds."""
    k = slots.k
    attrs = slots.attrs
    return (
        '<section class="panel" aria-labelledby="chart-title">'
        f'<h2 id="chart-title">Cache hit over time</h2>{k("chart_caption", "p", "sub")}'
        '<div class="plot"><div class="yaxis" aria-hidden="true"><span>100 %</span><span>50 %</span><span>0 %</span></div>'
        f'<svg class="chart" viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" preserveAspectRatio="none" role="img" '
        'aria-label="Cache hit percentage over time, with requests as bars">'
        f'<path class="grid" d="M0 0H{CHART_WIDTH}M0 25H{CHART_WIDTH}M0 50H{CHART_WIDTH}M0 75H{CHART_WIDTH}M0 {CHART_HEIGHT}H{CHART_WIDTH}"/>'
        f'<path class="bars" data-d="chart_bars" d="{_e(attrs.get("chart_bars", ""))}"/>'
        f'<path class="line" data-d="chart_line" d="{_e(attrs.get("chart_line", ""))}"/>'
        f'<path class="dots" data-d="chart_dots" d="{_e(attrs.get("chart_dots", ""))}"/>'
        "</svg></div>"
        f'<div class="xaxis" aria-hidden="true">{k("chart_start")}{k("chart_mid")}{k("chart_end")}</div>'
        "</section>"
    )


def _tenant_cards(slots: _Slots) -> str:
    """A tenant's cards: its own sessions."""
    return (
        '<section class="cards" aria-label="Your sessions">'
        + slots.card("Your sessions", "mine_sessions", "mine_turns")
        + slots.card("Cache hit", "mine_hit", "mine_tokens")
        + slots.card("Cost", "mine_cost", "mine_repaired")
        + "</section>"
    )


def _panels(slots: _Slots, breaks_title: str) -> str:
    """The breaks, the latest examples, the top sessions and the upstream pool."""
    k, empty, lists = slots.k, slots.empty, slots.lists
    return (
        '<section class="panel" aria-labelledby="breaks-title">'
        f'<h2 id="breaks-title">{_e(breaks_title)}</h2>'
        '<table class="rows"><thead><tr><th>Reason</th><th class="num">Count</th><th>Latest change</th></tr></thead>'
        f'{_list("breaks", lists["breaks"], "tbody")}</table>'
        f"{empty('breaks', 'No prefix breaks yet.')}"
        "</section>"
        '<section class="panel" aria-labelledby="examples-title">'
        '<h2 id="examples-title">Latest breaks, and how to pin them</h2>'
        '<p class="sub">The changed span is shown by shape only (<code>d</code> a digit, <code>a</code> a letter). '
        "If it is volatile text such as a timestamp, paste the line under <code>[repair.pin_patterns]</code> "
        "in your kvwarm config (append the regex to the role's list if it has one): kvwarm then keeps the "
        "value first seen in each session, which changes what the model sees.</p>"
        f'{_list("examples", lists["examples"], "ol", "examples")}'
        f"{empty('examples', 'No located changes yet.')}"
        "</section>"
        '<section class="panel" aria-labelledby="sessions-title">'
        f'<h2 id="sessions-title">Sessions with the most tokens</h2>{k("session_count", "p", "sub")}'
        '<table class="rows sessions"><thead><tr><th>Session</th><th>Model / latest prompt</th><th class="num">Turns</th>'
        '<th class="num">Tokens</th><th class="num">Hit</th><th class="num">Cost</th><th>Updated</th></tr></thead>'
        f'{_list("sessions", lists["sessions"], "tbody")}</table>'
        f"{empty('sessions', 'No sessions yet: point an agent at this proxy.')}"
        "</section>"
        # The upstream pool: one upstream is one line; several replicas are listed, each with
        # its health (passive ejection), and for the operator its load.
        '<section class="panel" aria-labelledby="upstreams-title" id="upstreams">'
        f'<h2 id="upstreams-title">Upstream</h2>{k("upstream", "p")}'
        f'<table class="rows replicas"{_hidden_list(lists["upstreams"])}><thead><tr><th>Replica</th><th>State</th>'
        '<th class="num">In flight</th><th class="num">Requests</th><th class="num">Ejections</th></tr></thead>'
        f'{_list("upstreams", lists["upstreams"], "tbody")}</table>'
        "</section>"
    )


def _footer() -> str:
    return (
        '<footer><p>Numbers are this process\'s since it started (the same counters as '
        "<code>/metrics</code>). With several workers or replicas, each keeps its own counters, "
        "history and break examples, and this page shows the process that answered it (its pid is "
        "at the top); <code>/metrics</code> adds up the workers of one <code>kvwarm serve</code>. "
        "Sessions come from the transcript store, shared when the store is.</p></footer>"
        "</body></html>\n"
    )
