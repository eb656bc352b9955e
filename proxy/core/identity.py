"""Identity: a 16-byte hash of what an element *means*, blind to exactly the safe drifts.

An element is a message, or the ``tools`` array (element 0 of every request). Two
elements have the same identity when restoring the stored one's bytes would change
nothing the model is meant to see (docs/ARCHITECTURE.md, "Identity"):

* key order in any object (the hash input is serialized with sorted keys);
* ``null`` / ``[]`` / ``""`` versus an absent field, at any level of a message; the
  transport key ``index`` of ``tool_calls[i]``; the cache markers ``cache_control`` and
  ``prompt_cache_breakpoint`` (they render no token: a client may move its own markers);
* ``content`` as a string versus a list of exactly one text part (whose only other key
  may be a cache marker); leading/trailing whitespace of each content text;
* tool-call ``arguments`` that parse to equal JSON, number tokens kept as their source
  text (``1`` != ``1.0``), duplicate keys or anything unparseable compared raw;
* the order of ``tool_calls`` in one message; the order of the tool definitions, and
  key order inside them.

Everything else is meaning: other text changes, ids, names, numbers, reasoning fields,
signatures, and every unknown non-empty key (it is hashed, canonicalized). Pinned spans
(opt-in, :class:`~proxy.core.policy.Policy`) are masked before hashing.

The no-drift path is what most requests take, so it is cheap: a message with only
non-empty scalar fields and edge-trimmed string content needs no normalization and is
hashed straight from ``orjson.dumps(msg, OPT_SORT_KEYS)`` -- exactly the bytes the
normalizing path would produce for it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import orjson

from .policy import PIN_MASK, Policy

__all__ = [
    "MARKER_KEYS",
    "RAW_ARGUMENTS",
    "REASONING_KEYS",
    "Held",
    "IdentityMemo",
    "canonical_arguments",
    "canonical_message",
    "canonical_tool_call",
    "canonical_tool_definition",
    "identify_message",
    "identify_messages",
    "is_text_part",
    "message_identity",
    "single_text",
    "tight",
    "tools_identity",
]

_SORT = orjson.OPT_SORT_KEYS
_MSG_PERSON = b"kvwarm.msg"
_TOOLS_PERSON = b"kvwarm.tools"

RAW_ARGUMENTS = b"\x00"
"""Prefix of :func:`canonical_arguments` for arguments compared as raw text (JSON never starts with NUL)."""
_RAW_ARGS_KEY = "arguments\x00raw"
"""Where unparseable arguments go in the hash input, so a raw ``abc`` never equals a JSON ``"abc"``."""

MARKER_KEYS = frozenset(("cache_control", "prompt_cache_breakpoint"))
"""Cache markers: where a prompt may be cached, not what it says (proxy/core/breakpoints.py)."""
_ONE_PART_KEYS = frozenset(("type", "text", *MARKER_KEYS))

REASONING_KEYS = frozenset(
    (
        "reasoning_content",
        "reasoning",
        "reasoning_details",
        "reasoning_text",
        "reasoning_signature",
        "thinking",
        "thinking_blocks",
        "thought_signature",
        "encrypted_content",
    )
)
"""Message fields that carry reasoning or its opaque signatures: meaning, never restored or added."""


def tight(data: bytes) -> bytes:
    """A copy of orjson's output that holds only its bytes: orjson's own result keeps its whole
    write buffer (a kilobyte or more behind a 40-byte message), which a store or a list of a
    100 000-message request would hold for as long as it keeps the value."""
    return bytes(memoryview(data))


def _digest(data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16, person=person).digest()


def _dump_any(value: Any) -> bytes:
    """Sorted-keys JSON of anything. Values orjson refuses (huge ints, lone surrogates, other
    types) are written field by field, still blind to key order; never raises."""
    try:
        return orjson.dumps(value, option=_SORT)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        pass
    try:
        return _dump_odd(value)
    except RecursionError:
        return b"\x00too-deep"


def _first(pair: tuple[str, Any]) -> str:
    return pair[0]


def _dump_odd(value: Any) -> bytes:
    t = type(value)
    if t is dict:
        items = sorted(((str(k), v) for k, v in value.items()), key=_first)
        return b"{" + b",".join(_dump_any(k) + b":" + _dump_any(v) for k, v in items) + b"}"
    if t is list or t is tuple:
        return b"[" + b",".join(_dump_any(x) for x in value) + b"]"
    if t is int:
        return str(value).encode()
    if t is str:
        return json.dumps(value).encode()  # ASCII escapes carry lone surrogates
    return b"\x00repr:" + repr(value).encode("utf-8", "surrogatepass")


def _empty(value: Any) -> bool:
    t = type(value)
    return value is None or ((t is str or t is list) and not value)


# -- tool-call arguments ---------------------------------------------------------------------


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_NOT_LOSSLESS: Any = object()


def _lossless(arguments: str) -> Any:
    """``arguments`` parsed by orjson when that loses nothing, else ``_NOT_LOSSLESS``.

    orjson loses number text and duplicate keys, so it is trusted only when its compact
    output is the input itself, or the input with spaces after "," / ":" (Python's json.dumps
    style): then every number token and every key of the input is in the output, unchanged.
    A removed space that sat inside a string makes the comparison fail (the safe direction).
    """
    try:
        raw = arguments.encode()
        value = orjson.loads(raw)
        compact = orjson.dumps(value)
    except (UnicodeEncodeError, orjson.JSONDecodeError, TypeError):  # TypeError: nested too deep
        return _NOT_LOSSLESS
    if compact == raw or (
        len(raw) > len(compact) and raw.replace(b", ", b",").replace(b": ", b":") == compact
    ):
        return value
    return _NOT_LOSSLESS


def canonical_arguments(arguments: str) -> bytes:
    """The comparison key of a tool-call ``arguments`` string.

    Arguments that parse as JSON give their canonical serialization: sorted keys, compact,
    strings as orjson writes them, every number token kept as its source text (so ``1``,
    ``1.0`` and ``1e0`` differ, big integers stay exact). Duplicate keys, NaN/Infinity or
    anything unparseable give ``RAW_ARGUMENTS + the raw UTF-8``: compared exactly.
    """
    value = _lossless(arguments)
    if value is not _NOT_LOSSLESS:
        return orjson.dumps(value, option=_SORT)
    raw = arguments.encode("utf-8", "surrogatepass")
    try:
        value = json.loads(
            arguments,
            object_pairs_hook=_pairs_no_duplicates,
            parse_float=orjson.Fragment,
            parse_int=orjson.Fragment,
            parse_constant=_reject_constant,
        )
        return orjson.dumps(value, option=_SORT)
    except (ValueError, TypeError, RecursionError):
        return RAW_ARGUMENTS + raw


# -- canonical forms ---------------------------------------------------------------------------


def _canon_value(value: Any) -> Any:
    """Generic canonical form: no cache markers, no empty fields, at any depth."""
    t = type(value)
    if t is dict:
        out = {}
        for k, x in value.items():
            if k in MARKER_KEYS:
                continue
            x = _canon_value(x)
            if not _empty(x):
                out[k] = x
        return out
    if t is list:
        return [_canon_value(x) for x in value]
    return value


def _canon_text(text: str, pins: tuple[re.Pattern[str], ...]) -> str:
    text = text.strip()
    for rx in pins:
        text = rx.sub(PIN_MASK, text)
    return text


def single_text(content: Any) -> str | None:
    """The text of ``content`` when it is a string or a list of exactly one plain text part."""
    if type(content) is str:
        return content
    if type(content) is list and len(content) == 1:
        part = content[0]
        if type(part) is dict and part.get("type") == "text":
            text = part.get("text")
            if type(text) is str and _ONE_PART_KEYS.issuperset(part):
                return text
    return None


def is_text_part(part: Any) -> bool:
    return type(part) is dict and part.get("type") == "text" and type(part.get("text")) is str


def _canon_part(part: Any, pins: tuple[re.Pattern[str], ...]) -> Any:
    if not is_text_part(part):
        return _canon_value(part)
    out = {}
    for k, x in part.items():
        if k in MARKER_KEYS:
            continue
        x = _canon_text(x, pins) if k == "text" else _canon_value(x)
        if not _empty(x):
            out[k] = x
    return out


def _canon_content(content: Any, pins: tuple[re.Pattern[str], ...]) -> Any:
    text = single_text(content)
    if text is not None:
        return _canon_text(text, pins)
    if type(content) is list:
        return [_canon_part(p, pins) for p in content]
    return _canon_value(content)


def _canon_function(function: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, x in function.items():
        if type(x) is str:  # the common case, kept free of calls
            if not x:
                continue
            if k == "arguments":
                key = canonical_arguments(x)
                if key[:1] == RAW_ARGUMENTS:
                    out[_RAW_ARGS_KEY] = x
                else:
                    out[k] = orjson.Fragment(key)
            else:
                out[k] = x
        elif x is not None and k != "cache_control":
            x = _canon_value(x)
            if not _empty(x):
                out[k] = x
    return out


def _canon_call(call: Any) -> Any:
    if type(call) is not dict:
        return _canon_value(call)
    out = {}
    for k, x in call.items():
        if k == "index" or k in MARKER_KEYS:
            continue
        t = type(x)
        if t is str:
            if x:
                out[k] = x
        elif t is dict and k == "function":
            out[k] = _canon_function(x)
        elif x is not None:
            x = _canon_value(x)
            if not _empty(x):
                out[k] = x
    return out


def canonical_tool_call(call: Any) -> bytes:
    """Comparison key of one ``tool_calls[i]``: ids and names kept, ``index`` dropped, arguments canonical."""
    return _dump_any(_canon_call(call))


def _call_id(call: Any) -> str:
    if type(call) is dict:
        call_id = call.get("id")
        if type(call_id) is str:
            return call_id
    return ""


def _plain_calls(calls: list[Any]) -> list[dict[str, Any]] | None:
    """The canonical ``tool_calls`` of the shape every client sends -- ``{id, type, function: {name,
    arguments}}`` with distinct ids and arguments orjson reads losslessly -- built without the
    generic walk. Byte for byte what the generic path gives (sorted by id, which is distinct)."""
    out: list[dict[str, Any]] = []
    for call in calls:
        try:
            function = call["function"]
            call_id = call["id"]
            kind = call["type"]
            name = function["name"]
            args = function["arguments"]
        except (KeyError, TypeError, IndexError):
            return None
        if (
            type(call_id) is not str
            or type(kind) is not str
            or type(name) is not str
            or type(args) is not str
            or not (call_id and kind and name and args)
            or len(function) != 2
            or len(call) != (4 if "index" in call else 3)
        ):
            return None
        value = _lossless(args)
        if value is _NOT_LOSSLESS:
            return None
        out.append({"function": {"arguments": value, "name": name}, "id": call_id, "type": kind})
    if len(out) > 1:
        out.sort(key=_by_id)
        if len({c["id"] for c in out}) != len(out):
            return None
    return out


def _by_id(call: dict[str, Any]) -> str:
    return call["id"]  # type: ignore[no-any-return]


def _canon_tool_calls(calls: Any) -> Any:
    if type(calls) is not list:
        return _canon_value(calls)
    plain = _plain_calls(calls)
    if plain is not None:
        return plain
    # Order-blind: sorted by call id, then by the canonical call.
    keys = [(_call_id(c), canonical_tool_call(c)) for c in calls]
    keys.sort()
    return [orjson.Fragment(k) for _id, k in keys]


def canonical_message(msg: Mapping[Any, Any], policy: Policy | None = None) -> dict[Any, Any]:
    """The normalized message whose sorted-keys JSON is hashed (tool calls embedded as JSON fragments)."""
    pins = policy.pins(msg.get("role")) if policy is not None else ()
    out: dict[Any, Any] = {}
    for k, v in msg.items():
        t = type(v)
        if t is str and k != "content":
            if v:
                out[k] = v
            continue
        if v is None or k in MARKER_KEYS:
            continue
        if k == "content":
            v = _canon_content(v, pins)
        elif k == "tool_calls":
            v = _canon_tool_calls(v)
        elif t is dict or t is list:
            v = _canon_value(v)
        if not _empty(v):
            out[k] = v
    return out


# -- identities ------------------------------------------------------------------------------


class Held:
    """A parsed element (a message, or a tools array) the prefix memo keeps for re-sent bodies,
    with what was computed from it: its identity, and the last chain step taken from it."""

    __slots__ = ("dumped", "identity", "key", "obj", "parent", "refs", "size")

    def __init__(self, obj: Any, identity: bytes, size: int, dumped: bytes | None) -> None:
        self.obj = obj
        """The object itself: held, so its ``id`` stays its own; never mutated (the core reads bodies only)."""
        self.identity = identity
        self.size = size
        """Its clean size (see :func:`identify_message`), -1 when it needed normalization."""
        self.dumped = dumped
        """``orjson.dumps(obj)`` when it needed normalization (repair compares those bytes), else None."""
        self.parent: bytes | None = None
        self.key: bytes | None = None
        """``key == chain(parent, identity)``, the chain step last taken from this element."""
        self.refs = 0
        """How many remembered bodies hold it."""


class IdentityMemo:
    """Identities of message serializations seen recently: exact bytes -> ``(identity, clean size)``.

    Agents re-send the same messages every turn, so most of a request's messages were
    identified before, in exactly these bytes. ``orjson.dumps`` of two JSON-parsed values
    gives equal bytes only for equal values (same keys in the same order, same strings,
    same numbers), so a hit is exact. One memo serves one :class:`Policy` (pins change
    identities). Owned by its caller (one per app); not thread-safe.

    Bounded by ``max_bytes`` of what it really holds: per entry, the key (a tight copy:
    orjson's output keeps at least a 4 kB buffer behind even a short message) and
    :attr:`ENTRY_OVERHEAD`; the tools memo likewise, within a sixteenth of the budget. Over
    the budget, the oldest entries go, an eighth of the budget at a time (one pass over the
    dict per batch, so eviction is O(1) per entry, where taking the first key of a dict
    again and again is not).
    """

    __slots__ = ("_entries", "_objects", "_size", "_tools", "_tools_size", "max_bytes")

    ENTRY_OVERHEAD: ClassVar[int] = 256
    """Bytes per entry beyond its key's length, measured on CPython 3.11: the key's ``bytes``
    header (33, rounded with the data to pymalloc's 16-byte classes: counted apart), the value
    tuple (56 -> 64), the 16-byte identity (49 -> 64), the clean size (an int, 28 -> 32) and the
    dict entry (60-120 under churn: 96)."""
    HELD_OVERHEAD: ClassVar[int] = 240
    """Bytes per held object beyond the object: the :class:`Held` (96), the dict entry (96), the
    ``id`` int (32), a share of the keys (interned with the match's)."""
    TOOLS_ENTRY_OVERHEAD: ClassVar[int] = 160
    """Bytes per tool set beyond its key's length: the identity (64) and the dict entry (96)."""
    MAX_TOOL_SETS = 256

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: dict[bytes, tuple[bytes, int]] = {}
        self._size = 0
        """Accounted bytes of both memos."""
        self._tools: dict[bytes, bytes] = {}
        self._tools_size = 0
        self._objects: dict[int, Held] = {}
        """``id(obj)`` -> the object a remembered body holds (:mod:`proxy.core.prefix`): a re-sent
        body's shared messages are those very objects, recognised without serializing them."""

    @staticmethod
    def _held(length: int) -> int:
        """A ``bytes`` of ``length`` as allocated: 33 bytes of header, 16-byte size classes."""
        return (length + 33 + 15) & ~15

    def tools_identity(self, tools: Any) -> bytes:
        """:func:`tools_identity`, remembered by the exact bytes of the array (agents send the
        same tools every turn)."""
        held = self._objects.get(id(tools))
        if held is not None and held.obj is tools:
            return held.identity
        try:
            data = orjson.dumps(tools)
        except TypeError:
            return tools_identity(tools)
        ident = self._tools.get(data)
        if ident is None:
            ident = tools_identity(tools)
            cost = self._held(len(data)) + self.TOOLS_ENTRY_OVERHEAD
            cap = self.max_bytes // 16
            if cost > cap:
                return ident
            tools_memo = self._tools
            while tools_memo and (self._tools_size + cost > cap or len(tools_memo) >= self.MAX_TOOL_SETS):
                oldest = next(iter(tools_memo))
                del tools_memo[oldest]
                gone = self._held(len(oldest)) + self.TOOLS_ENTRY_OVERHEAD
                self._tools_size -= gone
                self._size -= gone
            tools_memo[bytes(memoryview(data))] = ident
            self._tools_size += cost
            self._size += cost
            if self._size > self.max_bytes:
                self._shrink()
        return ident

    def __len__(self) -> int:
        return len(self._entries)

    # -- held objects ---------------------------------------------------------------------------

    def held(self, obj: Any) -> Held | None:
        """What is known of ``obj`` when a remembered body holds it; else None."""
        held = self._objects.get(id(obj))
        return held if held is not None and held.obj is obj else None

    def hold(self, obj: Any, identity: bytes, size: int, dumped: bytes | None = None) -> Held:
        """Keep ``obj`` (one more reference) with its identity; returns its record."""
        held = self._objects.get(id(obj))
        if held is None or held.obj is not obj:
            held = self._objects[id(obj)] = Held(obj, identity, size, dumped if size < 0 else None)
        held.refs += 1
        return held

    def release(self, obj: Any) -> None:
        """One reference to ``obj`` less; forgotten with the last."""
        held = self._objects.get(id(obj))
        if held is not None and held.obj is obj:
            held.refs -= 1
            if held.refs <= 0:
                del self._objects[id(obj)]

    def get(self, data: bytes) -> tuple[bytes, int] | None:
        return self._entries.get(data)

    def put(self, data: bytes, value: tuple[bytes, int], *, copied: bool = False) -> None:
        """Remember ``data``'s identity and clean size; ``copied``: ``data`` is already a
        :func:`tight` copy, kept itself."""
        cost = self._held(len(data)) + self.ENTRY_OVERHEAD
        if cost > self.max_bytes // 16 or data in self._entries:
            return
        self._entries[data if copied else tight(data)] = value
        self._size += cost
        if self._size > self.max_bytes:
            self._shrink()

    def _shrink(self) -> None:
        """Drop the oldest entries until an eighth of the budget is free."""
        target = self.max_bytes - self.max_bytes // 8
        entries = self._entries
        size = self._size
        gone: list[bytes] = []
        for key in entries:
            if size <= target:
                break
            size -= self._held(len(key)) + self.ENTRY_OVERHEAD
            gone.append(key)
        for key in gone:
            del entries[key]
        self._size = size


def identify_messages(
    messages: Sequence[Any],
    policy: Policy | None = None,
    memo: IdentityMemo | None = None,
    dumped: list[bytes | None] | None = None,
) -> tuple[list[bytes], list[int]]:
    """Identities of ``messages`` and their clean sizes (see :func:`identify_message`), in one pass.

    The loop is the hot path of every request, so the common shapes are handled inline:
    a message object a remembered body holds (:meth:`IdentityMemo.held`) costs a dict lookup;
    a message whose exact bytes are in ``memo`` costs one unsorted ``orjson.dumps`` and a
    dict lookup; a clean message is hashed from ``orjson.dumps(msg, OPT_SORT_KEYS)``; one
    whose only drift-prone field is edge whitespace of a string ``content`` from the same
    with the content stripped. Both give exactly the bytes :func:`canonical_message` would.
    With a memo, ``dumped`` (when given) receives each message's ``orjson.dumps`` bytes
    (None where orjson cannot write it), so that later stages need not serialize again.
    """
    if memo is None:
        return _identify_messages(messages, policy)
    ids: list[bytes] = []
    sizes: list[int] = []
    keep = dumped.append if dumped is not None else None
    dumps = orjson.dumps
    entries = memo._entries  # (compiled, a typed dict's ``get`` is a direct call; a bound one kept aside is not)
    objects = memo._objects
    for msg in messages:
        known = objects.get(id(msg))
        if known is not None and known.obj is msg:
            # A message of a remembered body, re-sent byte for byte: the very object.
            ids.append(known.identity)
            sizes.append(known.size)
            if keep is not None:
                keep(known.dumped)
            continue
        try:
            # A tight copy at once: the one the memo keeps and the caller gets, hashed once.
            data: bytes | None = tight(dumps(msg))
        except TypeError:
            data = None
        hit = entries.get(data) if data is not None else None
        if hit is None:
            one_id, one_size = _identify_messages((msg,), policy)
            hit = (one_id[0], one_size[0])
            if data is not None:
                memo.put(data, hit, copied=True)
        ids.append(hit[0])
        sizes.append(hit[1])
        if keep is not None:
            keep(data)
    return ids, sizes


def _identify_messages(
    messages: Sequence[Any], policy: Policy | None = None
) -> tuple[list[bytes], list[int]]:
    ids: list[bytes] = []
    sizes: list[int] = []
    pinned = policy if policy is not None and policy.pin_patterns else None
    dumps = orjson.dumps
    blake2b = hashlib.blake2b
    for msg in messages:
        if (
            type(msg) is dict
            and "cache_control" not in msg
            and not (pinned is not None and pinned.pins(msg.get("role")))
        ):
            padded = False
            for k, v in msg.items():
                t = type(v)
                if t is str:
                    if not v:
                        break
                    if k == "content" and (v[0].isspace() or v[-1].isspace()):
                        padded = True
                elif t is not int and t is not float and t is not bool:
                    break
            else:
                try:
                    if not padded:
                        data = dumps(msg, option=_SORT)
                        ids.append(blake2b(data, digest_size=16, person=_MSG_PERSON).digest())
                        sizes.append(len(data))
                        continue
                    stripped = msg["content"].strip()
                    if stripped:
                        data = dumps({**msg, "content": stripped}, option=_SORT)
                        ids.append(blake2b(data, digest_size=16, person=_MSG_PERSON).digest())
                        sizes.append(-1)
                        continue
                except TypeError:
                    pass
        ids.append(
            _digest(
                _dump_any(canonical_message(msg, policy) if type(msg) is dict else msg), _MSG_PERSON
            )
        )
        sizes.append(-1)
    return ids, sizes


def identify_message(msg: Any, policy: Policy | None = None) -> tuple[bytes, int]:
    """``(identity, clean_size)``: ``clean_size`` is ``len(orjson.dumps(msg))`` when the message
    needed no normalization (its bytes are its canonical form up to key order), else -1."""
    ids, sizes = identify_messages((msg,), policy)
    return ids[0], sizes[0]


def message_identity(msg: Any, policy: Policy | None = None) -> bytes:
    """The 16-byte identity of one message; never raises (a non-dict hashes its JSON)."""
    return identify_message(msg, policy)[0]


def strip_cache_control(definition: Any) -> Any:
    """A tool definition without its definition-level ``cache_control`` (a marker, not tokens)."""
    if type(definition) is dict and "cache_control" in definition:
        return {k: v for k, v in definition.items() if k != "cache_control"}
    return definition


def canonical_tool_definition(definition: Any) -> bytes:
    """Comparison key of one tool definition: sorted keys, definition-level ``cache_control`` dropped."""
    return _dump_any(strip_cache_control(definition))


def tools_identity(tools: Any) -> bytes:
    """The identity of the ``tools`` array: blind to definition order and key order; None, [] and absent are equal."""
    if tools is None:
        tools = []
    if type(tools) is not list:
        return _digest(_dump_any(tools), _TOOLS_PERSON)
    defs = sorted(canonical_tool_definition(d) for d in tools)
    return _digest(b"[" + b",".join(defs) + b"]", _TOOLS_PERSON)
