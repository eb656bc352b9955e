"""Byte-exact edits of a JSON body: change the values a repair names, keep every other byte.

Re-serializing a whole request body can change what it means: of duplicate keys
(``"content":"A","content":"B"``) a parser keeps one and the dump forwards only that one;
integers beyond 64 bits come back as floats; ``1e-400`` becomes ``0.0``; ``-0`` becomes ``0``.
:func:`splice` applies a repair's edits to the client's bytes instead, so every byte outside
the edited values is the client's byte, and gives up (``None``) wherever that, or the meaning
of an edited value, cannot be guaranteed. The caller then forwards the client's bytes
unrepaired and counts the refusal (:func:`try_splice` says why, one of :data:`REFUSALS`).

Edits
    :class:`Replace` sets the value at a path to new bytes; :class:`Reorder` makes the array at a
    path its own elements in a new order, leaving out the indices it drops; :class:`Insert`
    adds a member in front of an object's first member. A path is object keys and array
    indices, e.g. ``("messages", 3, "content")``. Every path, in every edit of one call, names a
    place in the *client's* body, original indices included: with ``Reorder(("messages",),
    (1, 0))`` and ``Replace(("messages", 0, "content"), ...)`` the replaced content is that of
    the client's first message, wherever it ends up. Edits may nest (a Reorder of ``messages``
    and a Reorder of one message's ``tool_calls``) but never overlap: nothing may be edited
    inside, or twice at, a replaced value.

Output form
    A replaced value's bytes (only the value: the whitespace around it stays) become the new
    bytes as given. A reordered array keeps its separators in place (the bytes from ``[`` to
    the first element, between elements, and from the last element to ``]``) and moves whole
    elements, so a pretty-printed array stays pretty. An insert writes
    ``"key":value`` right after ``{``, followed by ``,`` unless the object was empty.

What is refused, and why (anything else is safe)
    ``duplicate_key``
        An object that an edit's path goes through or into (the top level included) has a key
        more than once, keys compared after unescaping (``"\\u0063ontent"`` is ``"content"``).
        Which member an edit should touch, and what the object means (the planner read it with
        orjson, where the last one wins; others take the first), depends on the parser. Or the
        value being replaced has a duplicate key anywhere inside it: the caller built the
        replacement from its parsed form, which kept one of them. Duplicate keys anywhere else
        are fine, their bytes are forwarded as they came; so are elements moved whole by a
        Reorder, duplicates and all.
    ``unsafe_number``
        A number inside the value being replaced does not mean the same after an orjson
        parse/dump round trip (integers outside [-2**63, 2**64), more digits than a double
        keeps, ``1e-400``, ``1E400``, integer ``-0``). Numbers outside replaced values stay bytes.
    ``invalid_json``
        The body is not JSON where :func:`splice` reads it, or the value being replaced is not
        JSON orjson accepts (an unpaired ``\\ud800``, invalid UTF-8). The containers on the edit
        paths are parsed strictly. Values skipped over (siblings, moved elements) are only
        delimited: a string ends at the first quote after an even run of backslashes, brackets
        outside strings are counted. Every parser that accepts the body sees the same extents,
        and a body ill-formed inside a skipped value is forwarded exactly as ill-formed as it
        came (the caller has parsed the body before planning edits, so it is not).
    ``missing_path``
        A path leads nowhere: a key the object lacks, an index past the array's end, a key into
        an array or an index into anything else. Only :class:`Insert` adds what is not there.
    ``key_exists``
        An :class:`Insert` of a key the object already has (use :class:`Replace`).
    ``invalid_edit``
        The edits contradict each other or themselves: two edits of one place, an edit inside a
        replaced value or inside an element a Reorder drops, a Reorder index repeated or out of
        range, new bytes that are not exactly one JSON value, a path step that is neither a
        ``str`` nor an ``int >= 0``.

Speed: Python runs once per member of the containers on the edit paths and once per bracket
or long string of a value skipped over; ``bytes.find`` and compiled regexes (C) do the rest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson

__all__ = [
    "REFUSALS",
    "Edit",
    "Insert",
    "Path",
    "Refusal",
    "Refused",
    "Reorder",
    "Replace",
    "skip_space",
    "skip_value",
    "splice",
    "try_splice",
]

Path = tuple[str | int, ...]
"""Object keys and array indices from the top-level value down, in the client's body."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Replace:
    """Set the value at ``path`` (which must exist) to ``value``."""

    path: Path
    value: bytes
    """Exactly one JSON value, serialized (no surrounding whitespace needed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reorder:
    """The array at ``path`` becomes its own elements (client bytes) in ``order``."""

    path: Path
    order: tuple[int, ...]
    """Original indices, each at most once; the ones left out are dropped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Insert:
    """Add the member ``key: value`` in front of the object at ``path``, which lacks ``key``."""

    path: Path
    key: str
    value: bytes
    """Exactly one JSON value, serialized."""


Edit = Replace | Reorder | Insert

REFUSALS = (
    "invalid_json",
    "missing_path",
    "duplicate_key",
    "unsafe_number",
    "key_exists",
    "invalid_edit",
)
"""Every :attr:`Refusal.reason` (a bounded metrics label)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """Why :func:`try_splice` gave up."""

    reason: str
    """One of :data:`REFUSALS`."""
    path: Path
    """Where: the path of the edit, or of the container, concerned (``()`` for the top level)."""


def splice(raw: bytes, edits: Sequence[Edit]) -> bytes | None:
    """``raw`` with each edit applied and every other byte unchanged; None when that cannot be guaranteed."""
    out = try_splice(raw, edits)
    return out if isinstance(out, bytes) else None


def try_splice(raw: bytes, edits: Sequence[Edit]) -> bytes | Refusal:
    """Like :func:`splice`, saying why it refused. No edits: ``raw`` itself, unread."""
    if not edits:
        return raw
    try:
        root = _plan(edits)
        view = memoryview(raw)
        start = skip_space(raw, 0)
        end, pieces = _edit(raw, view, start, root, ())
        if skip_space(raw, end) != len(raw):
            raise Refused("invalid_json", ())
    except Refused as refused:
        return Refusal(reason=refused.reason, path=refused.path)
    except IndexError:  # ran off the end of the body in the middle of a value
        return Refusal(reason="invalid_json", path=())
    return b"".join([view[:start], *pieces, view[end:]])


class Refused(Exception):
    """A body the scanner cannot take: unwinds a descent to :func:`try_splice` (or to a caller
    of :func:`skip_value`, which treats it as "not a JSON value here")."""

    def __init__(self, reason: str, path: Path) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = path


# -- the edits, as a tree of the paths they name -------------------------------------------------


class _Node:
    """The edits at one place of the body and below it."""

    __slots__ = ("children", "inserts", "reorder", "replace")

    def __init__(self) -> None:
        self.replace: bytes | None = None
        self.reorder: tuple[int, ...] | None = None
        self.inserts: dict[str, bytes] = {}
        self.children: dict[str | int, _Node] = {}


def _plan(edits: Sequence[Edit]) -> _Node:
    root = _Node()
    for edit in edits:
        path = edit.path
        node = root
        steps: Sequence[Any] = path  # each step is checked here, whatever its annotation says
        for step in steps:
            if not (type(step) is str or (type(step) is int and step >= 0)):
                raise Refused("invalid_edit", path)
            node = node.children.setdefault(step, _Node())
        if isinstance(edit, Replace):
            _check_new(edit.value, path)
            if node.replace is not None:
                raise Refused("invalid_edit", path)
            node.replace = edit.value
        elif isinstance(edit, Reorder):
            order = edit.order
            if (
                node.reorder is not None
                or not all(type(i) is int and i >= 0 for i in order)
                or len(set(order)) != len(order)
            ):
                raise Refused("invalid_edit", path)
            node.reorder = order
        elif isinstance(edit, Insert):
            _check_new(edit.value, path)
            if type(edit.key) is not str or edit.key in node.inserts:
                raise Refused("invalid_edit", path)
            node.inserts[edit.key] = edit.value
        else:
            raise Refused("invalid_edit", path)
    _check_overlaps(root, ())
    return root


def _check_new(value: bytes, path: Path) -> None:
    try:
        orjson.loads(value)
    except (orjson.JSONDecodeError, TypeError):
        raise Refused("invalid_edit", path) from None


def _check_overlaps(node: _Node, path: Path) -> None:
    if node.replace is not None and (node.children or node.inserts or node.reorder is not None):
        raise Refused("invalid_edit", path)
    if node.reorder is not None:
        kept = set(node.reorder)
        if any(type(k) is int and k not in kept for k in node.children):
            raise Refused("invalid_edit", path)  # an edit inside a dropped element
    if any(k in node.children for k in node.inserts):
        raise Refused("invalid_edit", path)
    for step, child in node.children.items():
        _check_overlaps(child, (*path, step))


# -- the scanner -----------------------------------------------------------------------------------

_STRING = rb'"(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+"'
_NUMBER = rb"-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+"
_WS = re.compile(rb"[ \t\n\r]*+")
# A quote no backslash precedes. Starting with the quote lets ``re`` search for it as fast as
# ``bytes.find``; a character class, or a lookbehind first, would test every byte in turn.
_UNESCAPED_QUOTE = re.compile(rb'"(?<!\\")')
_SCALAR = re.compile(_NUMBER + rb"|true|false|null")
_MEMBER = re.compile(rb"[ \t\n\r]*+(" + _STRING + rb")[ \t\n\r]*+:[ \t\n\r]*+")
# Inside a skipped container, everything up to the next bracket or the next string that is
# long or has an escape (``_skip_string`` takes those: ``re`` walks a character class at a few ns
# a byte, a search for the quote itself runs at memory speed). Ranges, not ``[^"\\]``: ``re``
# tests a negated list of literals several times slower.
_INSIDE = re.compile(rb'(?:[^"\[\]{}]++|"[\x00-\x21\x23-\x5b\x5d-\xff]{0,32}+")*+')
_SEPARATOR = re.compile(rb"[ \t\n\r]*+(?:(,)[ \t\n\r]*+|(\]))")  # after an array element
_AFTER_MEMBER = re.compile(rb"[ \t\n\r]*+(?:(,)|(\}))")
_TOKEN = re.compile(
    rb"[ \t\n\r]*+(?:(" + _STRING + rb")|(" + _NUMBER + rb")|(true|false|null)|([\[\]{},:]))"
)
_SMALL_INT = re.compile(rb"-?(?:0|[1-9][0-9]{0,17})")  # 18 digits at most: always an int64
_INTEGER = re.compile(rb"-?[0-9]+")
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1

_OPEN_OBJECT, _CLOSE_OBJECT, _OPEN_ARRAY, _CLOSE_ARRAY = b"{}[]"
_COMMA, _QUOTE, _BACKSLASH = b',"\\'
_Pieces = list[bytes | memoryview]


def skip_space(raw: bytes, pos: int) -> int:
    """The first position at or after ``pos`` that is not JSON whitespace."""
    m = _WS.match(raw, pos)
    assert m is not None  # matches the empty string
    return m.end()


def skip_value(raw: bytes, pos: int, path: Path) -> int:
    """End of the JSON value starting at ``pos``; :class:`Refused` when there is none."""
    c = raw[pos]
    if c == _QUOTE:
        return _skip_string(raw, pos, path)
    if c == _OPEN_OBJECT or c == _OPEN_ARRAY:
        return _skip_container(raw, pos, path)
    m = _SCALAR.match(raw, pos)
    if m is None:
        raise Refused("invalid_json", path)
    return m.end()


def _skip_string(raw: bytes, pos: int, path: Path) -> int:
    """End of the string whose opening quote is at ``pos``: the first quote after it that an
    even run of backslashes (none included) precedes.

    The regex finds the first quote no backslash precedes, searching for the quote itself at
    memory speed. Every quote before it follows a backslash: it is escaped if that is the only
    one, so only the quotes after two or more (``find`` of the three bytes) need counting."""
    at = pos + 1
    m = _UNESCAPED_QUOTE.search(raw, at)
    last = m.start() if m is not None else len(raw)
    find = raw.find
    k = find(b'\\\\"', at, last)
    while k >= 0:
        q = k + 2
        b = k - 1
        while raw[b] == _BACKSLASH:  # stops at the opening quote at the latest
            b -= 1
        if (q - b) % 2:
            return q + 1
        k = find(b'\\\\"', q + 1, last)
    if m is None:
        raise Refused("invalid_json", path)
    return last + 1


def _skip_container(raw: bytes, pos: int, path: Path) -> int:
    """End of the object or array starting at ``pos``: a regex step per bracket and long string.

    Brackets are counted, not paired: a body that mismatches them is JSON to no parser, and
    is forwarded as it came."""
    depth = 1
    inside = _INSIDE.match
    find = raw.find
    pos = inside(raw, pos + 1).end()  # type: ignore[union-attr]  # matches the empty string
    while True:
        c = raw[pos]
        if c == _QUOTE:
            q = find(b'"', pos + 1)
            pos = q + 1 if q > 0 and raw[q - 1] != _BACKSLASH else _skip_string(raw, pos, path)
        elif c == _OPEN_OBJECT or c == _OPEN_ARRAY:
            depth += 1
            pos += 1
        else:  # a closing bracket: ``_INSIDE`` stops at nothing else
            depth -= 1
            pos += 1
            if not depth:
                return pos
        pos = inside(raw, pos).end()  # type: ignore[union-attr]


def _key(token: bytes, path: Path) -> str:
    try:
        if b"\\" in token:
            key = orjson.loads(token)
            assert type(key) is str
            return key
        return token[1:-1].decode()
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        raise Refused("invalid_json", path) from None


def _edit(raw: bytes, view: memoryview, pos: int, node: _Node, path: Path) -> tuple[int, _Pieces]:
    """End of the value at ``pos`` and its bytes with the edits of ``node`` applied."""
    if node.replace is not None:
        end = skip_value(raw, pos, path)
        _check_replaced(raw[pos:end], path)
        return end, [node.replace]
    c = raw[pos]
    if c == _OPEN_OBJECT and node.reorder is None:
        return _edit_object(raw, view, pos, node, path)
    if c == _OPEN_ARRAY and not node.inserts:
        return _edit_array(raw, view, pos, node, path)
    skip_value(raw, pos, path)  # an invalid body is said so before a wrong path
    raise Refused("missing_path", path)


def _children(raw: bytes, pos: int, node: _Node, path: Path, kind: type) -> dict[str | int, _Node]:
    """``node``'s edits below the container at ``pos``, all addressed by ``kind`` (member names
    of an object, indices of an array); else the path leads nowhere in this body."""
    children = node.children
    if any(type(k) is not kind for k in children):
        _skip_container(raw, pos, path)
        raise Refused("missing_path", path)
    return children


def _edit_object(
    raw: bytes, view: memoryview, pos: int, node: _Node, path: Path
) -> tuple[int, _Pieces]:
    children = _children(raw, pos, node, path, str)
    inserts = node.inserts
    pieces: _Pieces = [view[pos : pos + 1]]
    cursor = pos + 1
    keys: set[str] = set()
    pending: Refused | None = None
    p = skip_space(raw, pos + 1)
    empty = raw[p] == _CLOSE_OBJECT
    if inserts:
        members = b",".join(orjson.dumps(k) + b":" + v for k, v in inserts.items())
        pieces.append(members if empty else members + b",")
    if empty:
        end = p + 1
    else:
        member = _MEMBER.match
        after = _AFTER_MEMBER.match
        while True:
            m = member(raw, p)
            if m is None:
                raise Refused("invalid_json", path)
            start = m.end()
            key = _key(m.group(1), path)
            if key in keys:
                raise Refused("duplicate_key", (*path, key))
            keys.add(key)
            child = children.get(key)
            if child is not None:
                try:
                    end, sub = _edit(raw, view, start, child, (*path, key))
                except Refused as refused:
                    # Read on: a second member of the same key is the better reason to give.
                    pending = pending or refused
                    end = skip_value(raw, start, path)
                else:
                    pieces.append(view[cursor:start])
                    pieces.extend(sub)
                    cursor = end
            else:
                end = skip_value(raw, start, path)
            m = after(raw, end)
            if m is None:
                raise Refused("invalid_json", path)
            p = m.end()
            if m.lastindex == 2:
                end = p
                break
    if pending is not None:
        raise pending
    for wanted in children:
        if wanted not in keys:
            raise Refused("missing_path", (*path, wanted))
    for new in inserts:
        if new in keys:
            raise Refused("key_exists", (*path, new))
    pieces.append(view[cursor:end])
    return end, pieces


def _edit_array(
    raw: bytes, view: memoryview, pos: int, node: _Node, path: Path
) -> tuple[int, _Pieces]:
    """The array at ``pos``: its elements delimited (each edited one rewritten), then its bytes
    put together, in place or in ``node.reorder``'s order. Without a reorder, nothing past the
    last edited element is read but to find the array's end."""
    children = _children(raw, pos, node, path, int)
    order = node.reorder
    last = max((int(k) for k in children), default=-1)  # without a reorder, nothing past it is read
    spans: list[tuple[int, int]] = []
    edited: dict[int, _Pieces] = {}
    p = skip_space(raw, pos + 1)
    if raw[p] == _CLOSE_ARRAY:
        end = p + 1
    else:
        separator = _SEPARATOR.match
        index = 0
        while True:
            if order is None and index > last:
                end = _skip_elements(raw, p, path)
                break
            child = children.get(index)
            if child is not None:
                e, sub = _edit(raw, view, p, child, (*path, index))
                edited[index] = sub
            else:
                e = skip_value(raw, p, path)
            spans.append((p, e))
            m = separator(raw, e)
            if m is None:
                raise Refused("invalid_json", path)
            p = m.end()
            if m.lastindex == 2:
                end = p
                break
            index += 1
    if last >= len(spans):
        raise Refused("missing_path", (*path, last))
    if order is None:
        return end, _in_place(view, pos, end, spans, edited)
    if any(i >= len(spans) for i in order):
        raise Refused("invalid_edit", path)
    return end, _reordered(view, pos, end, spans, edited, order)


def _in_place(
    view: memoryview, pos: int, end: int, spans: list[tuple[int, int]], edited: dict[int, _Pieces]
) -> _Pieces:
    """The array from ``pos`` to ``end`` with each edited element's bytes (``edited``, by index,
    in the order the elements come) in place of its span; every other byte as it is."""
    pieces: _Pieces = []
    cursor = pos
    for i, sub in edited.items():
        start, stop = spans[i]
        pieces.append(view[cursor:start])
        pieces.extend(sub)
        cursor = stop
    pieces.append(view[cursor:end])
    return pieces


def _reordered(
    view: memoryview,
    pos: int,
    end: int,
    spans: list[tuple[int, int]],
    edited: dict[int, _Pieces],
    order: tuple[int, ...],
) -> _Pieces:
    """The array from ``pos`` to ``end`` with its elements (``spans``, every index of ``order``
    among them; ``edited``: the rewritten ones) in ``order``. Separators stay where they are:
    whole elements move between them."""
    if not spans:
        return [view[pos:end]]
    pieces: _Pieces = [view[pos : spans[0][0]]]
    for slot, i in enumerate(order):
        if slot:
            pieces.append(view[spans[slot - 1][1] : spans[slot][0]])
        moved = edited.get(i)
        if moved is None:
            start, stop = spans[i]
            pieces.append(view[start:stop])
        else:
            pieces.extend(moved)
    pieces.append(view[spans[-1][1] : end])
    return pieces


def _skip_elements(raw: bytes, pos: int, path: Path) -> int:
    """End of the array whose remaining elements start at ``pos``."""
    separator = _SEPARATOR.match
    while True:
        m = separator(raw, skip_value(raw, pos, path))
        if m is None:
            raise Refused("invalid_json", path)
        pos = m.end()
        if m.lastindex == 2:
            return pos


# -- is the value being replaced safe to have been re-serialized? ---------------------------------


def _check_replaced(span: bytes, path: Path) -> None:
    try:
        orjson.loads(span)
    except orjson.JSONDecodeError:
        # 1E400 is a number orjson refuses to read: say so rather than "not JSON".
        for m in _TOKEN.finditer(span):
            if m.lastindex == 2 and not _number_survives(m.group(2)):
                raise Refused("unsafe_number", path) from None
        raise Refused("invalid_json", path) from None
    first = span[0]
    if first == _QUOTE or first in b"tfn":
        return
    if first != _OPEN_OBJECT and first != _OPEN_ARRAY:
        if not _number_survives(span):
            raise Refused("unsafe_number", path)
        return
    # orjson accepted the span, so its tokens follow each other with nothing in between.
    keys: list[set[str] | None] = []
    key_next = False
    for m in _TOKEN.finditer(span):
        kind = m.lastindex
        if kind == 4:
            c = m.group(4)[0]
            if c == _OPEN_OBJECT:
                keys.append(set())
                key_next = True
            elif c == _OPEN_ARRAY:
                keys.append(None)
                key_next = False
            elif c == _COMMA:
                key_next = keys[-1] is not None
            else:
                if c != b":"[0]:
                    keys.pop()
                key_next = False
        elif kind == 1:
            if key_next:
                seen = keys[-1]
                assert seen is not None
                key = _key(m.group(1), path)
                if key in seen:
                    raise Refused("duplicate_key", path)
                seen.add(key)
                key_next = False
        elif kind == 2 and not _number_survives(m.group(2)):
            raise Refused("unsafe_number", path)


def _number_survives(token: bytes) -> bool:
    """Whether an orjson parse/dump round trip keeps the number's type, value and sign."""
    if _SMALL_INT.fullmatch(token):
        return token != b"-0"
    if _INTEGER.fullmatch(token):
        # orjson reads integers outside int64/uint64 as floats: a seed must stay an integer.
        return len(token) <= 20 and _INT_MIN <= int(token) <= _UINT_MAX
    try:
        back = orjson.dumps(orjson.loads(token))
    except orjson.JSONDecodeError:  # out of a double's range
        return False
    if back == token:
        return True
    before, after = Decimal(token.decode()), Decimal(back.decode())
    return before == after and before.is_signed() == after.is_signed()
