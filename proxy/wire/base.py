"""The contract of a wire API: its front-end (:class:`Wire`) and its response :class:`Observer`.

A stream event reaches the client according to the observer's verdict, one of
three named types (mitmproxy-style: each says when it applies):

- :data:`KEEP` -- relay the event's bytes as received (almost every event);
- :data:`HIDE` -- kvwarm itself caused this event (the usage-only chunk of an
  ``include_usage`` it injected): the client never sees it;
- :class:`Replace` -- relay other bytes instead (the event minus a member kvwarm
  caused, such as ``"usage": null``);

and, orthogonally, an event is *terminal* (:meth:`Observer.is_terminal`): the
relay holds it back until the turn is recorded, so a client cannot send its next
turn before this one is in the store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

import orjson

from ..core.breakpoints import Marks
from ..core.guard import Guard
from ..core.identity import IdentityMemo
from ..core.model import NodeReader
from ..core.plan import PlannedView, TurnPlan, plan_turn
from ..core.policy import Policy
from ..core.prefix import Recalled
from ..core.record import Reply
from ..core.splice import Edit, Refusal, try_splice
from ..core.sse import SSEEvent
from ..core.usage import Usage
from ..transport.traits import UpstreamTraits

__all__ = [
    "BODY_LIMIT",
    "HIDE",
    "KEEP",
    "BodyBuffer",
    "Hide",
    "Keep",
    "Observer",
    "Outgoing",
    "Replace",
    "Untouched",
    "Verdict",
    "Wire",
    "body_json",
    "json_post",
    "json_turn",
    "plan_on_view",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Keep:
    """Relay the event as received."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hide:
    """Withhold the event: kvwarm caused it, the client did not ask for it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Replace:
    """Relay ``raw`` instead of the event's own bytes."""

    raw: bytes


KEEP: Final = Keep()
HIDE: Final = Hide()
Verdict = Keep | Hide | Replace


class Observer(Protocol):
    """Watches one response of one wire API on its way to the client.

    The relay calls :meth:`on_event` for each SSE event, or :meth:`on_body` for each chunk
    of a plain body, then :meth:`end` once. The observer assembles the reply as generated
    (as delivered, when the client left) and reads the usage; it never raises into the relay
    (its own failures are counted through the request's fail-open guard).
    """

    usage: Usage | None
    """The usage block(s) seen so far, merged."""

    def on_event(self, event: SSEEvent) -> Verdict: ...

    def is_terminal(self, event: SSEEvent) -> bool:
        """The stream's closing event (held until the turn is recorded)."""
        ...

    def on_body(self, chunk: bytes) -> None:
        """A chunk of a non-streamed body (bounded buffering: past the bound, usage is unknown)."""
        ...

    def end(self, *, client_gone: bool) -> Reply | None:
        """The response is over: the reply to record (``partial`` when the stream was cut)."""
        ...



@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class Outgoing:
    """What goes upstream."""

    body: Final[bytes]
    """The bytes sent: the client's, unless repaired or ``include_usage`` was added."""
    usage_injected: Final[bool]
    """kvwarm added ``stream_options.include_usage``; the observer hides what it caused."""
    marks: Final[Marks | None]
    """The cache markers kvwarm placed (:mod:`proxy.wire.cache_marks`); None: this upstream and
    model take none."""

    def __init__(
        self,
        *,
        body: bytes,
        usage_injected: bool,
        marks: Marks | None = None,
    ) -> None:
        self.body = body
        self.usage_injected = usage_injected
        self.marks = marks

class Wire(Protocol):
    """One wire API: recognises its requests, plans them, and observes their responses."""

    name: str
    """``chat``, ``responses``, ``messages``: the log line's first word."""
    resends: str | None
    """The top-level array a client re-sends every turn (its bodies are remembered for the next
    turn, :mod:`proxy.core.prefix`); None: none."""

    def parse(self, method: str, path: str, raw: bytes) -> dict[str, Any] | None:
        """The parsed body when this is a request of this API kvwarm understands; else None."""
        ...

    def plan(
        self,
        raw: bytes,
        body: Mapping[str, Any],
        root: bytes,
        reader: NodeReader,
        policy: Policy,
        memo: IdentityMemo | None,
        guard: Guard,
        recalled: Recalled | None = None,
    ) -> TurnPlan:
        """Plan a request; ``recalled``: how its body was rebuilt from the tenant's previous one
        (given only where the store keeps a node's parents while it keeps the node)."""
        ...

    def outgoing(self, raw: bytes, body: Mapping[str, Any], plan: TurnPlan, traits: UpstreamTraits) -> Outgoing: ...

    def observer(self, outgoing: Outgoing, traits: UpstreamTraits, guard: Guard, *, success: bool) -> Observer: ...


BODY_LIMIT = 32 * 1024 * 1024
"""Bytes of a non-streamed response kept for reading its usage and reply; beyond, both are unknown."""


class BodyBuffer:
    """A non-streamed response body kept for observing, at most ``limit`` bytes: past it, nothing
    is kept (the usage is then unknown, never guessed), so memory stays bounded."""

    __slots__ = ("_chunks", "_limit", "_size")

    def __init__(self, limit: int = BODY_LIMIT) -> None:
        self._chunks: list[bytes] | None = []
        self._size = 0
        self._limit = limit

    def add(self, chunk: bytes) -> None:
        if self._chunks is None:
            return
        self._size += len(chunk)
        if self._size > self._limit:
            self._chunks = None
        else:
            self._chunks.append(chunk)

    def take(self) -> bytes | None:
        """The whole body (None when there was none, or it overflowed); the buffer is emptied."""
        chunks, self._chunks = self._chunks, None
        return b"".join(chunks) if chunks else None


def body_json(data: bytes) -> Any:
    """A plain response body, parsed; None when it is not JSON: a body the upstream cut short
    (the relay counts that as the upstream's failure) or never JSON. Its usage and reply are then
    unknown, as past :data:`BODY_LIMIT`: no error of kvwarm's own."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def json_post(method: str, path: str, suffix: str, raw: bytes) -> dict[str, Any] | None:
    """The body of a ``POST`` to a path ending in ``suffix`` when it is a JSON object; else None."""
    if method != "POST" or not path.endswith(suffix) or not raw:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if type(body) is dict else None


def json_turn(method: str, path: str, suffix: str, raw: bytes, array: str) -> dict[str, Any] | None:
    """:func:`json_post`'s body when its ``array`` member is a list (a turn of a messages-shaped
    API: chat, Anthropic's Messages); else None (forwarded untouched)."""
    body = json_post(method, path, suffix, raw)
    return body if body is not None and type(body.get(array)) is list else None


def plan_on_view(
    raw: bytes,
    chat: Mapping[str, Any],
    view: PlannedView,
    root: bytes,
    reader: NodeReader,
    policy: Policy,
    memo: IdentityMemo | None,
    guard: Guard,
    recalled: Recalled | None,
    client_edits: Callable[[Sequence[Edit]], list[Edit] | None],
) -> TurnPlan:
    """A turn planned on ``chat``, the chat-shaped body of the client's ``view``; a repair is
    mapped onto the client's own elements (``client_edits``: the view's edits as edits of the
    client's body, None when one has no place there) and spliced into the client's bytes;
    ``recalled``: how the body was rebuilt from the tenant's previous one.

    Where the repair cannot be spliced (or mapping it fails) the request is planned again without
    repair, forwarded as sent and recorded as sent, ``refused`` saying why."""
    known = recalled.known_view(view.reused) if recalled is not None and view.reused else None
    plan = plan_turn(chat, root, reader, policy, memo, guard, known=known)
    if not plan.repair.repairs:
        return plan.with_view(view)
    spliced: bytes | Refusal = Refusal(reason="invalid_edit", path=())
    with guard("repair"):
        edits = client_edits(plan.repair.edits)
        if edits:
            spliced = try_splice(raw, edits)
    if isinstance(spliced, Refusal):
        unrepaired = plan_turn(chat, root, reader, replace(policy, repair=False), memo, guard)
        return replace(unrepaired, refused=spliced.reason, view=view)
    return replace(plan, spliced=spliced, view=view)


class Untouched:
    """The observer of a response kvwarm does not read: every event kept, nothing assembled."""

    usage: Usage | None = None

    def on_event(self, event: SSEEvent) -> Verdict:
        return KEEP

    def is_terminal(self, event: SSEEvent) -> bool:
        return False

    def on_body(self, chunk: bytes) -> None:
        return None

    def end(self, *, client_gone: bool) -> Reply | None:
        return None
