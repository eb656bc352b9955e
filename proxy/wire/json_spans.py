"""Where a value is in the bytes of a JSON document, and a JSON text in one compact form. Pure.

Some values mean more in their text than in their parse. A Messages ``tool_use`` carries its
``input`` as an object inside the body (chat carries ``arguments`` as a string), and orjson's
parse of it keeps the last of a repeated key and turns integers beyond 64 bits into floats:
two inputs a provider renders differently could parse the same. So the input's own bytes are
located in the body (:func:`member_spans`, :func:`element_spans`, with the scanner of
:mod:`proxy.core.splice`) and compared as text, as chat's arguments are.

:func:`compact_json` writes such a text without what no renderer keeps: the whitespace between
tokens and the escapes inside strings (``"\\u00e9"`` is ``"é"``). Every other byte stays:
the key order (a provider renders the input in the order sent), each number as spelled, each
repeated key. A text that is no JSON (a stream cut mid-value) is returned as it is.
"""

from __future__ import annotations

import re
from typing import Final

import orjson

from ..core.splice import Refused, skip_space, skip_value

__all__ = ["Malformed", "compact_json", "element_spans", "member_spans", "next_element", "value_end"]

Span = tuple[int, int]

_STRING: Final = rb'"(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+"'
_MEMBER: Final = re.compile(rb"[ \t\n\r]*+(" + _STRING + rb")[ \t\n\r]*+:[ \t\n\r]*+")
_AFTER_MEMBER: Final = re.compile(rb"[ \t\n\r]*+(?:(,)|(\}))")
_AFTER_ELEMENT: Final = re.compile(rb"[ \t\n\r]*+(?:(,)[ \t\n\r]*+|(\]))")
_TOKEN: Final = re.compile(
    rb'[ \t\n\r]*+(?:("(?:[^"\\]++|\\.)*+")|([-+.0-9a-zA-Z]++)|([\[\]{},:]))', re.DOTALL
)
_SPACES: Final = re.compile(rb"[ \t\n\r]*+")


class Malformed(ValueError):
    """The bytes are not the JSON value the caller expected there."""


def member_spans(raw: bytes, pos: int) -> dict[str, Span]:
    """The members of the object starting at ``pos``: each key's value as ``(start, end)``. Of a
    key given twice, the last value: the one orjson (and so the parsed body) keeps."""
    if raw[pos : pos + 1] != b"{":
        raise Malformed("not an object")
    spans: dict[str, Span] = {}
    p = skip_space(raw, pos + 1)
    if raw[p : p + 1] == b"}":
        return spans
    try:
        while True:
            m = _MEMBER.match(raw, p)
            if m is None:
                raise Malformed("not a member")
            start = m.end()
            end = skip_value(raw, start, ())
            spans[_key(m.group(1))] = (start, end)
            after = _AFTER_MEMBER.match(raw, end)
            if after is None:
                raise Malformed("no separator")
            p = after.end()
            if after.lastindex == 2:
                return spans
    except (Refused, IndexError) as exc:
        raise Malformed("not JSON") from exc


def element_spans(raw: bytes, pos: int, wanted: int = -1) -> list[Span]:
    """The elements of the array starting at ``pos``, as ``(start, end)``: all of them, or the first
    ``wanted + 1`` (nothing after them is read)."""
    if raw[pos : pos + 1] != b"[":
        raise Malformed("not an array")
    spans: list[Span] = []
    p = skip_space(raw, pos + 1)
    if raw[p : p + 1] == b"]":
        return spans
    try:
        while wanted < 0 or len(spans) <= wanted:
            end = skip_value(raw, p, ())
            spans.append((p, end))
            after = _AFTER_ELEMENT.match(raw, end)
            if after is None:
                raise Malformed("no separator")
            if after.lastindex == 2:
                break
            p = after.end()
    except (Refused, IndexError) as exc:
        raise Malformed("not JSON") from exc
    return spans


def next_element(raw: bytes, end: int) -> int:
    """Where the array element after the one ending at ``end`` starts (-1: the array ends there)."""
    after = _AFTER_ELEMENT.match(raw, end)
    if after is None:
        raise Malformed("no separator")
    return -1 if after.lastindex == 2 else after.end()


def value_end(raw: bytes, pos: int) -> int:
    """Where the value starting at ``pos`` ends."""
    try:
        return skip_value(raw, pos, ())
    except (Refused, IndexError) as exc:
        raise Malformed("not JSON") from exc


def _key(token: bytes) -> str:
    try:
        key = orjson.loads(token) if b"\\" in token else token[1:-1].decode()
    except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Malformed("not a key") from exc
    if type(key) is not str:
        raise Malformed("not a key")
    return key


def compact_json(text: bytes) -> str:
    """``text`` (one JSON value) without whitespace between tokens and with its strings written as
    orjson writes them; keys in their order, numbers as spelled, repeated keys kept. Not JSON (a
    value cut short): ``text`` itself."""
    try:
        compact = orjson.dumps(orjson.loads(text))
    except (orjson.JSONDecodeError, TypeError):
        compact = b""
    if compact and (compact == text or text.replace(b", ", b",").replace(b": ", b":") == compact):
        # The parse lost nothing: every number and key of ``text`` is in its compact dump (a
        # ", " inside a string would have made the comparison fail, the safe direction).
        return compact.decode()
    out: list[bytes] = []
    pos, n = 0, len(text)
    while True:
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
        string = m.group(1)
        out.append(_string(string) if string is not None else m.group(m.lastindex or 0))
    if _SPACES.match(text, pos).end() != n:  # type: ignore[union-attr]  # matches the empty string
        return text.decode("utf-8", "replace")
    return b"".join(out).decode("utf-8", "replace")


def _string(token: bytes) -> bytes:
    """A string token as orjson writes it (a lone surrogate escape stays as it was written)."""
    if b"\\" not in token:
        return token
    try:
        return orjson.dumps(orjson.loads(token))
    except (orjson.JSONDecodeError, TypeError):
        return token
