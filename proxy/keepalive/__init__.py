"""Keep-alive: keep a paused session's cached prefix warm at the provider, when that pays.

A provider that caches at breakpoints keeps a prefix for a TTL after its last read (5 minutes
for Anthropic-style ``cache_control``, reset by each read; 30 minutes for OpenAI's breakpoints);
a session that pauses longer writes its whole prefix again. kvwarm knows each session's exact
prefix, when it was last read and for how long, and each tenant's pauses; opt-in
(``[keepalive]``), it re-reads a paused session's prefix shortly before it would expire, when
the expected saving exceeds the cost. One concept per module:

``watch``      one watched session: its last turn, its prefix, its pings (pure)
``gaps``       each tenant's pauses between turns, and sessions that never came back (pure)
``bet``        whether a run of pings pays: expected saving against cost (pure)
``budget``     USD per rolling day, never exceeded (pure)
``ping``       a ping's bytes: the last request cut at its last breakpoint, least output (pure)
``schedule``   the watched sessions, by key and by due time
``exchange``   one ping on the wire: made once, sent to the session's replica, its answer read
``keeper``     :class:`KeepAlive`: the request path's bookkeeping and the pings themselves
``lifecycle``  its app key, its clock and its task (``cleanup_ctx``)
"""

from __future__ import annotations

from .keeper import KeepAlive
from .lifecycle import KEEPALIVE, KEEPALIVE_CLOCK, keepalive_ctx

__all__ = ["KEEPALIVE", "KEEPALIVE_CLOCK", "KeepAlive", "keepalive_ctx"]
