"""Re-sent conversations: the byte-identical start of a tenant's recent request bodies. Pure.

An agent re-sends its whole conversation every turn: the bytes it sent the turn before, then
a few new messages (or the same conversation with its last turn changed). :class:`PrefixMemo`
keeps, per scope (the caller's: tenant root, method and path), the last few bodies with a
top-level array the client re-sends (chat's ``messages``, the Responses API's ``input``; called
"the messages" below): their bytes, where each message ends in them, and their parsed values.
A new body whose bytes begin with one of them up to the end of its message ``k - 1`` holds the
same messages ``0 .. k-1`` -- the same bytes at the same place of the same JSON document -- so
they are taken as parsed before, and only the new messages are parsed, provided
the bytes after the array are, byte for byte, those that followed it before (then the whole
body is that one with other messages at its end). Anything else is a miss: the caller parses
the whole body, then remembers it.

The messages (and the ``tools`` value) of a remembered body are held by the identity memo
(:meth:`~proxy.core.identity.IdentityMemo.hold`) with their identities and chain steps, so
identifying and matching a re-sent body costs a lookup per shared message, and the full work
only for its new ones. A wire API that plans a *view* of the array (the Responses API's items
mapped onto chat-shaped messages) remembers that view with it: the view messages are what is
held, and ``spans`` says which array elements each was made of, so the next turn's view can
take over the ones its shared elements make.

Where the messages are in the bytes: each message's ``orjson.dumps`` is looked for at its
place (what clients that serialize compactly send: the OpenAI SDKs, ``JSON.stringify``); where
it is not there, the element is delimited by the scanner of :mod:`proxy.core.splice`. That the
array is the top-level ``messages`` member (the last one, which is the one a parser keeps) is
proven once, when a body is first remembered, by parsing the bytes before it and after it.
Any doubt is a miss, never a different body.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

import orjson

from .identity import IdentityMemo
from .match import KnownPrefix, Match, in_order
from .splice import Refused, skip_value

if TYPE_CHECKING:
    from .plan import PlannedView, TurnPlan

__all__ = ["PrefixMemo", "Recalled"]

_WS = re.compile(rb"[ \t\n\r]*+")
_NEXT = re.compile(rb"[ \t\n\r]*+(?:(,)[ \t\n\r]*+|(\]))")
_COMMA = re.compile(rb"[ \t\n\r]*+,[ \t\n\r]*+")
MESSAGES = "messages"
"""The array a chat client re-sends."""
_CLOSE = ord("]")
_TRIES = 4
"""Places tried for the array when a body is first remembered."""
_WINDOW = 64
"""Bytes compared first, just before a message's end."""


class _Body:
    """One remembered body."""

    __slots__ = (
        "array", "before", "byte_all", "byte_prev", "clean", "close", "cost", "elements", "end_all", "end_prev", "ends",
        "first_key", "head", "last", "match", "messages", "raw", "spans", "start", "tag", "tools", "tools_clean", "top", "view",
    )

    def __init__(
        self, raw: bytes, start: int, ends: list[int], close: int, top: dict[str, Any], tag: Any,
        source: _Body | None = None, *, array: str = MESSAGES, planned: PlannedView | None = None,
    ) -> None:
        self.raw = raw
        self.view = memoryview(raw)
        self.array = array
        """The top-level key of the re-sent array."""
        self.start = start
        """Offset just after the ``[`` that opens the array."""
        self.ends = ends
        """Offset just past each message."""
        self.close = close
        """Offset of the ``]`` that closes the array."""
        self.top = top
        # The members before the array, in order: the same in every body rebuilt from this one
        # (``source``, whose bytes up to the array these are). None: unknown.
        self.before: list[tuple[str, Any]] | None = (
            source.before if source is not None else _members_before(raw[:start], top, array)
        )
        self.elements: list[Any] = top[array]
        """The array's parsed elements."""
        self.messages: list[Any] = self.elements if planned is None else planned.messages
        """The messages its match was planned on (the elements, or the caller's view of them):
        held in the identity memo, as long as this body is kept."""
        self.spans = None if planned is None else planned.spans
        """Per planned message, the elements it was made of (None: one each, the elements themselves)."""
        self.tools: Any = None
        """The ``tools`` value, when held in the identity memo."""
        self.first_key = b""
        """The chain key of element 0 (the tools) when it was remembered."""
        self.tag = tag
        self.match: Match | None = None
        """How this body was matched (the next body's :class:`~proxy.core.match.KnownPrefix`)."""
        self.clean = 0
        """Its leading messages that needed no repair."""
        self.tools_clean = False
        """Its plan found its ``tools`` value needing no repair."""
        # The bytes, the parsed values and the match's serialized messages: about its size each.
        self.cost = 3 * len(raw) + IdentityMemo.HELD_OVERHEAD * (len(self.messages) + 1) + 512
        # The windows :meth:`continued` compares first, for the last message and the one before:
        # a tenant's parallel sessions are told apart by a slice and a compare each (a slice of
        # 64 bytes and ``==`` cost a fifth of ``bytes.startswith(window, cut)``'s argument parsing).
        self.last = [self._window(k) for k in (len(ends), len(ends) - 1) if k > 0]
        # Where those two messages end (0: no message before the last) and their last bytes. A body
        # that ``raw`` continues has that byte there in ``raw`` too, then a comma, the array's end
        # or whitespace: read before any window, these rule out most of a tenant's other parallel
        # sessions with four bytes of ``raw`` and fields of this object, not their windows' bytes
        # elsewhere in memory.
        self.end_all, self.byte_all = _message_end(raw, ends, 1)
        self.end_prev, self.byte_prev = _message_end(raw, ends, 2)
        # And the first message's window, compared before the whole start: sessions run in parallel
        # from one template (another system prompt or task, then the same tool results at the same
        # places) agree at their ends, and are told apart at their first message.
        self.head = self._window(1) if ends else (0, 0, b"", 0)

    def same(self, raw: bytes, k: int) -> bool:
        """``raw`` has this body's first ``k`` messages, byte for byte. The bytes just before the
        k-th message's end are compared first (where two conversations differ): a body that
        differs is told in a few bytes, one that is the same in a ``memcmp``."""
        cut, end, window, _ = self._window(k)
        return raw[cut:end] == window and raw.startswith(self.view[:cut])

    def _window(self, k: int) -> tuple[int, int, bytes, int]:
        end = self.ends[k - 1]
        cut = max(0, end - _WINDOW)
        return cut, end, self.raw[cut:end], k

    def continued(self, raw: bytes) -> int:
        """This body's messages when ``raw`` continues it (all of them) or changes its last turn
        (all but the last); else 0. For a body it does not continue, mostly four byte reads."""
        if not (_ends_message(raw, self.end_all, self.byte_all) or _ends_message(raw, self.end_prev, self.byte_prev)):
            return 0
        for cut, end, window, k in self.last:
            if raw[cut:end] == window and raw[self.head[0] : self.head[1]] == self.head[2] and raw.startswith(self.view[:cut]):
                return k
        return 0

    def shared(self, raw: bytes) -> int:
        """How many leading messages ``raw`` has byte for byte as this body has them."""
        n = len(self.ends)
        if self.same(raw, n):
            return n
        if n == 1 or not self.same(raw, 1):
            return 0
        lo, hi = 1, n  # lo messages are shared, hi are not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.same(raw, mid):
                lo = mid
            else:
                hi = mid
        return lo

    def extend(self, raw: bytes, k: int) -> Recalled | None:
        """``raw`` as this body's first ``k`` messages and its own others, or None (parse it whole)."""
        cut = self.ends[k - 1]
        view = memoryview(raw)
        after = self.view[self.close :]
        close = len(raw) - len(after)
        if close >= cut and raw.endswith(after):
            # What follows the array is this body's: so is everything but the new messages.
            try:
                # "[0" stands for the shared messages: what follows them must be ",message"s and
                # whitespace up to the array's end, or this is no JSON array.
                tail = orjson.loads(b"".join((b"[0", view[cut:close], b"]")))
            except orjson.JSONDecodeError:
                return None
            body = dict(self.top)
            ends = None
        else:
            # Something after the array changed too (another tools array, a flag): delimit the new
            # messages, then read the members after the array, which must not name "messages".
            located = _delimit(raw, cut) if self.before is not None else None
            if located is None or self.before is None:
                return None
            ends, close = located
            array = self.array
            rest_bytes = view[close:]
            if not _names_no_key(rest_bytes, array):
                return None
            try:
                tail = orjson.loads(b"".join((b"[0", view[cut:close], b"]")))
                rest = orjson.loads(b"".join((b"{", _quoted(array), b":[", rest_bytes)))
            except orjson.JSONDecodeError:
                return None
            if type(rest) is not dict:
                return None
            body = dict(self.before)
            del rest[array]
            body[array] = None
            body.update(rest)
        elements = self.elements[:k]
        elements.extend(tail[1:])
        body[self.array] = elements
        return Recalled(body=body, shared=k, tag=self.tag, source=self, cut=cut, close=close, ends=ends)


# Below _Body, which it names: compiled (proxy/native.py), a class annotation naming a class
# defined later crashes the module's import.
@dataclass(init=False, unsafe_hash=True)  # built per request (proxy/core/values.py)
class Recalled:
    """A body rebuilt from a remembered one and its own new bytes."""

    body: Final[dict[str, Any]]
    """The parsed body (a new dict and ``messages`` list; the shared messages are the remembered objects)."""
    shared: Final[int]
    """Leading messages taken from the remembered body."""
    tag: Final[Any]
    """What the caller attached when it remembered that body (the wire API that parsed it)."""
    source: Final[_Body]
    cut: Final[int]
    """Where the shared messages end in the new bytes."""
    close: Final[int]
    """Where the new body's ``messages`` array closes (its ``]``)."""
    ends: Final[list[int] | None]
    """Where each new message ends, when they were delimited to rebuild the body."""

    def __init__(
        self,
        *,
        body: dict[str, Any],
        shared: int,
        tag: Any,
        source: _Body,
        cut: int,
        close: int,
        ends: list[int] | None = None,
    ) -> None:
        self.body = body
        self.shared = shared
        self.tag = tag
        self.source = source
        self.cut = cut
        self.close = close
        self.ends = ends

    @property
    def known(self) -> KnownPrefix | None:
        """How the shared messages were matched the turn before (None: not known, or the body
        was planned on a view: see :meth:`known_view`)."""
        return self.known_view(self.shared) if self.source.spans is None else None

    def known_view(self, messages: int) -> KnownPrefix | None:
        """How the first ``messages`` messages planned the turn before were matched: the caller's
        view of this body must begin with those very objects (``source.messages``)."""
        source = self.source
        if source.match is None:
            return None
        return KnownPrefix(
            messages=messages,
            match=source.match,
            clean=source.clean,
            tools=source.top.get("tools"),
            held=source.messages,
            tools_clean=source.tools_clean,
        )


class PrefixMemo:
    """Recent bodies per scope, bounded by ``max_bytes`` (what they hold, counted twice their bytes).

    Owned by its caller (one per identity memo, so per policy); not thread-safe."""

    MAX_BODIES: ClassVar[int] = 64
    """Bodies kept per scope: a tenant's sessions in parallel, each continuing its own."""
    SEARCHED: ClassVar[int] = 4
    """Bodies searched for the longest shared start when none is continued."""

    def __init__(self, memo: IdentityMemo, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.memo = memo
        self.max_bytes = max_bytes
        self._scopes: OrderedDict[Hashable, list[_Body]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return sum(len(bodies) for bodies in self._scopes.values())

    @property
    def size(self) -> int:
        """Accounted bytes held."""
        return self._size

    def recall(self, scope: Hashable, raw: bytes) -> Recalled | None:
        """The body of ``raw`` when it continues a body remembered in ``scope``; None: parse it whole."""
        bodies = self._scopes.get(scope)
        if not bodies:
            return None
        self._scopes.move_to_end(scope)
        # The body it continues (or whose last turn it changes): the most recent first, two
        # window compares each for the others (a tenant's parallel sessions).
        for body in bodies:
            k = body.continued(raw)
            if k:
                return body.extend(raw, k)
        # Else the most recent few, for the longest shared start (a new session of a system prompt).
        best, best_k = None, 0
        for body in bodies[: self.SEARCHED]:
            k = body.shared(raw)
            if k > best_k:
                best, best_k = body, k
        return best.extend(raw, best_k) if best is not None else None

    def remember(
        self,
        scope: Hashable,
        raw: bytes,
        body: Mapping[str, Any],
        match: Match,
        recalled: Recalled | None = None,
        tag: Any = None,
        clean: int = 0,
        tools_clean: bool = False,
        *,
        array: str = MESSAGES,
        view: PlannedView | None = None,
    ) -> bool:
        """Keep ``body`` (parsed from ``raw``, planned into ``match`` with this memo's identity
        memo) for the next bodies of ``scope``. ``recalled``: how it was rebuilt, if it was;
        ``clean``: its leading messages the plan found needing no repair (``tools_clean``: its
        ``tools`` value). False when it cannot be kept (not located, too large, no messages).

        ``array``: the re-sent array's key. ``view``: the messages the match was planned on, when
        they are a view of the array's elements, not the elements (its ``spans``: the elements each
        was made of; its ``reused``: the leading ones that are the very objects of the body
        ``recalled`` was rebuilt from, which are else its shared elements)."""
        elements = body.get(array)
        messages = elements if view is None else view.messages
        if (
            type(elements) is not list
            or not elements
            or not messages
            or len(match.message_ids) != len(messages)
            or 2 * len(raw) > self.max_bytes // 16
        ):
            return False
        # The serialized messages locate the elements only when they are the elements.
        dumped = match.message_dumped if view is None else ()
        bodies = self._scopes.get(scope)
        entry: _Body | None
        if recalled is not None and recalled.body is body and recalled.source.array == array:
            entry = self._rebuilt(raw, elements, match, recalled, dumped, bodies, view)
        else:
            found = _layout(raw, elements, dumped, array)
            entry = None
            if found is not None:
                entry = _Body(raw, found[0], found[1], found[2], dict(body), tag, array=array, planned=view)
                self._hold(entry, match, 0, None)
        if entry is None:
            return False
        entry.match = match
        # The last message is compared as the final one when it is: not once it is followed.
        entry.clean = min(clean, len(messages) - 1)
        entry.tools_clean = tools_clean
        self._keep(scope, bodies, entry)
        return True

    def _rebuilt(
        self, raw: bytes, elements: list[Any], match: Match, recalled: Recalled, dumped: Sequence[bytes | None],
        bodies: list[_Body] | None, view: PlannedView | None,
    ) -> _Body | None:
        """The entry, its messages held, for the body ``recalled`` rebuilt (``elements``, parsed
        from ``raw``); None when its new elements are not where the rebuild found them. When it
        continues one of ``bodies``, that one leaves ``bodies`` and the accounted size, and the
        messages they share pass over to the entry as held."""
        source = recalled.source
        k = recalled.shared
        if recalled.ends is not None:
            located: tuple[list[int], int] | None = (recalled.ends, recalled.close)
        else:
            # Its tail was parsed whole (what follows the array is the remembered body's), so
            # its last element ends where the whitespace before the array's known end starts.
            located = _locate(raw, recalled.cut, elements, k, dumped, first=False, close=recalled.close)
        if located is None or located[1] != recalled.close or len(located[0]) != len(elements) - k:
            return None
        entry = _Body(
            raw, source.start, source.ends[:k] + located[0], recalled.close, recalled.body, recalled.tag, source,
            array=source.array, planned=view,
        )
        replaced = _replaced(bodies, source, entry, k) if bodies is not None else None
        if bodies is not None and replaced is not None:
            # The session went on (or changed its last turn): this body takes the place of the
            # one it continues, and the messages they share stay held as they are.
            bodies.remove(replaced)
            self._size -= replaced.cost
            self._hold(entry, match, k if view is None else view.reused, replaced)
        else:
            self._hold(entry, match, 0, None)
        return entry

    def _keep(self, scope: Hashable, bodies: list[_Body] | None, entry: _Body) -> None:
        """Put ``entry`` first among ``scope``'s ``bodies`` (the scope's list, None: a new scope),
        the scope last to go; then drop the oldest bodies past :attr:`MAX_BODIES` in the scope
        and the least recently used scopes while more than ``max_bytes`` is held."""
        if bodies is None:
            bodies = self._scopes[scope] = []
        else:
            self._scopes.move_to_end(scope)
        bodies.insert(0, entry)
        self._size += entry.cost
        while len(bodies) > self.MAX_BODIES:
            self._drop(bodies.pop())
        while self._size > self.max_bytes and self._scopes:
            _, gone = self._scopes.popitem(last=False)
            for old in gone:
                self._drop(old)

    def remember_plan(
        self, scope: Hashable, raw: bytes, body: Mapping[str, Any], plan: TurnPlan, recalled: Recalled | None, *,
        tag: Any = None, array: str = MESSAGES,
    ) -> bool:
        """:meth:`remember` a planned body: its match, what its plan found clean, and the view it
        was planned on when there is one (:attr:`~proxy.core.plan.TurnPlan.view`)."""
        if plan.match is None:
            return False
        return self.remember(
            scope, raw, body, plan.match, recalled, tag, plan.clean, plan.tools_clean, array=array, view=plan.view,
        )

    def _hold(self, entry: _Body, match: Match, kept: int, source: _Body | None) -> None:
        """Hold ``entry``'s messages (and tools value) with their identities and chain steps. With
        ``source``, its first ``kept`` messages (and its tools value, when the same object) are
        ``entry``'s already: they pass over as held; the rest of ``source`` is released."""
        memo = self.memo
        messages = entry.messages
        sizes, dumped, ids = match.message_sizes, match.message_dumped, match.message_ids
        if source is None or kept > len(source.messages) or (kept and messages[kept - 1] is not source.messages[kept - 1]):
            kept = 0  # not the objects passed over (a view made anew): hold them all again
        if source is not None:
            for msg in source.messages[kept:]:
                memo.release(msg)
        for r in range(kept, len(messages)):
            memo.hold(messages[r], ids[r], sizes[r], dumped[r] if dumped else None)
        keys = match.keys
        # The chain steps of the messages passed over are still right unless the chain starts
        # elsewhere now (other tools): each step is a pure function of its parent and identity.
        settled = kept if source is not None and source.first_key == keys[0] else 0
        order = match.order
        # In order up to there (the usual case): only the steps past it are visited.
        first = settled if match.ordered or in_order(order, settled) else 0
        for p in range(first, len(order)):
            r = order[p]
            if r >= settled:
                step = memo.held(messages[r])
                if step is not None:
                    step.parent, step.key = keys[p], keys[p + 1]
        entry.first_key = keys[0]
        tools = entry.top.get("tools")
        old_tools = source.tools if source is not None else None
        if tools is not None and match.identities and keys:
            if tools is not old_tools:
                memo.hold(tools, match.identities[0], -1)
            step = memo.held(tools)
            if step is not None:
                step.parent, step.key = match.root, keys[0]
            entry.tools = tools
        if old_tools is not None and old_tools is not tools:
            memo.release(old_tools)

    def _drop(self, body: _Body) -> None:
        self._size -= body.cost
        for msg in body.messages:
            self.memo.release(msg)
        if body.tools is not None:
            self.memo.release(body.tools)


def _members_before(head: bytes, top: dict[str, Any], array: str) -> list[tuple[str, Any]] | None:
    """The members of ``top`` before its key ``array``, in order, when ``head`` (the bytes up to
    the array) names that key once and holds no ``\\u`` escape (which could spell it); else None:
    unknown, the key may be there twice (a parser keeps the last)."""
    if head.count(_quoted(array)) != 1 or b"\\u" in head:
        return None
    members: list[tuple[str, Any]] = []
    for item in top.items():
        if item[0] == array:
            break
        members.append(item)
    return members


def _message_end(raw: bytes, ends: list[int], back: int) -> tuple[int, int]:
    """Where the ``back``-th message from the last (1: the last) ends in ``raw``, and its last
    byte; ``(0, -1)`` when there are fewer messages."""
    if len(ends) < back:
        return 0, -1
    end = ends[-back]
    return end, raw[end - 1]


def _replaced(bodies: list[_Body], source: _Body, entry: _Body, k: int) -> _Body | None:
    """The kept body ``entry`` takes the place of: the one it was rebuilt from, when ``entry``
    continues it or changes its last turn; else (that one was replaced meanwhile, by a request
    answered in parallel) a recent one holding the same first ``k`` message objects and at most
    one more. None: ``entry`` is kept beside the others."""
    if k >= len(source.ends) - 1 and source in bodies:
        return source
    mark = entry.elements[k - 1]
    for body in bodies[:PrefixMemo.SEARCHED]:
        if k <= len(body.elements) <= k + 1 and body.elements[k - 1] is mark and body.first_key == source.first_key:
            return body
    return None


def _delimit(raw: bytes, pos: int) -> tuple[list[int], int] | None:
    """Ends of the array elements after the one that ends at ``pos``, and the offset of the ``]``
    that closes the array (the scanner of :mod:`proxy.core.splice`); None if it is not one."""
    ends: list[int] = []
    try:
        while True:
            m = _NEXT.match(raw, pos)
            if m is None:
                return None
            if m.lastindex == 2:
                return ends, m.start(2)
            pos = skip_value(raw, m.end(), ())
            ends.append(pos)
    except (Refused, IndexError):
        return None


def _ends_message(raw: bytes, end: int, last: int) -> bool:
    """``raw`` could hold a message ending at ``end`` with the byte ``last``: that byte, then what
    may follow an array element (a comma, the array's end, whitespace)."""
    if end <= 0 or end >= len(raw) or raw[end - 1] != last:
        return False
    after = raw[end]
    return after == 44 or after == 93 or _space(after)  # , ]


def _space(c: int) -> bool:
    """JSON whitespace: space, \\n, \\r, \\t."""
    return c == 32 or c == 10 or c == 13 or c == 9


def _quoted(key: str) -> bytes:
    return b'"' + key.encode() + b'"'


def _names_no_key(rest: memoryview, key: str) -> bool:
    """The bytes after the array cannot hold another ``key`` member: not even the word (nor a
    ``\\u`` escape that could spell it)."""
    data = bytes(rest)
    return _quoted(key) not in data and b"\\u" not in data


_KEYS: dict[str, re.Pattern[bytes]] = {}


def _array_key(key: str) -> re.Pattern[bytes]:
    """``"key" : [``, with any whitespace."""
    pattern = _KEYS.get(key)
    if pattern is None:
        pattern = _KEYS[key] = re.compile(re.escape(_quoted(key)) + rb"[ \t\n\r]*+:[ \t\n\r]*+\[")
    return pattern


def _element_end(raw: bytes, pos: int, dumped: bytes | None, element: Any) -> int | None:
    """End of the element at ``pos``: its ``orjson.dumps`` when the client wrote exactly that, else
    the scanner's extent."""
    if dumped is None:
        try:
            dumped = orjson.dumps(element)
        except TypeError:
            dumped = None
    if dumped is not None and raw.startswith(dumped, pos):
        return pos + len(dumped)
    try:
        return skip_value(raw, pos, ())
    except (Refused, IndexError):
        return None


def _locate(
    raw: bytes, pos: int, messages: Sequence[Any], start: int, dumped: Sequence[bytes | None], *, first: bool,
    close: int = -1,
) -> tuple[list[int], int] | None:
    """Ends of ``messages[start:]``, the first at ``pos`` (after ``[`` when ``first``, else after
    the previous element), and the offset of the ``]`` that follows them. ``close``: that offset,
    when the array is known to be valid JSON that closes there: its last element is not scanned."""
    ends: list[int] = []
    last = len(messages) - 1
    for r in range(start, len(messages)):
        m = (_WS if first and r == start else _COMMA).match(raw, pos)
        if m is None:
            return None
        if r == last and close >= 0:
            end: int | None = _trimmed(raw, close)
        else:
            end = _element_end(raw, m.end(), dumped[r] if dumped else None, messages[r])
        if end is None or end <= m.end():
            return None
        ends.append(end)
        pos = end
    m = _WS.match(raw, pos)
    assert m is not None  # matches the empty string
    close = m.end()
    if close >= len(raw) or raw[close] != _CLOSE:
        return None
    return ends, close


def _trimmed(raw: bytes, end: int) -> int:
    """``end`` moved back over the JSON whitespace before it."""
    while end > 0 and _space(raw[end - 1]):
        end -= 1
    return end


def _layout(
    raw: bytes, messages: Sequence[Any], dumped: Sequence[bytes | None], array: str = MESSAGES
) -> tuple[int, list[int], int] | None:
    """Where the top-level ``array``'s elements start (just after its ``[``), where each
    ends and where it closes; None when that is not certain."""
    first = dumped[0] if dumped and dumped[0] is not None else None
    candidates: list[int] = []
    if first is not None:
        at = raw.find(first)
        while at >= 0 and len(candidates) < _TRIES:
            # The array opens before the first message, whitespace between.
            p = _trimmed(raw, at)
            if p > 0 and raw[p - 1] == ord("["):
                candidates.append(p)
            at = raw.find(first, at + 1)
    if not candidates:
        candidates = [m.end() for _, m in zip(range(_TRIES), _array_key(array).finditer(raw), strict=False)]
    for start in candidates:
        located = _locate(raw, start, messages, 0, dumped, first=True)
        if located is not None and _is_top_level(raw, start, located[1], array):
            return start, located[0], located[1]
    return None


def _is_top_level(raw: bytes, start: int, close: int, array: str) -> bool:
    """The array from ``start`` (after its ``[``) to ``close`` is the value of the top-level key
    ``array``, and the last such key: the bytes before it close as an object whose last key is
    ``array``, and the bytes after it hold no other ``array`` member."""
    view = memoryview(raw)
    try:
        before = orjson.loads(b"".join((view[:start], b"]}")))
        after = orjson.loads(b"".join((b"{", _quoted(array), b":[", view[close:])))
    except orjson.JSONDecodeError:
        return False
    if type(before) is not dict or type(after) is not dict or not before:
        return False
    return next(reversed(before)) == array and before[array] == [] and _names_no_key(view[close:], array)
