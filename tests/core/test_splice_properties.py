"""Invariants of the byte-exact splicer, property-based, over generated bodies written with odd
whitespace, odd escapes, unicode, duplicate keys and numbers orjson cannot keep.

The oracle is independent of the splicer: the generator records where it wrote every value, so
the expected output is built from those spans, and whether a splice must be refused is decided
on the generated values (Python's ``float``/``Decimal`` for numbers, ``str`` keys), not by
scanning bytes. Each example then checks the splicer against it exactly: refused when and only
when a rule applies, otherwise byte for byte the expected output, whose edited values orjson
(or, for bodies orjson rejects, Python's ``json``) reads back as the edits said.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import orjson
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from proxy.core.splice import Edit, Insert, Reorder, Replace, splice, try_splice

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- generated values, and the bytes they were written as --------------------------------------


@dataclass(eq=False)
class Node:
    kind: str
    """``obj``, ``arr``, ``str``, ``num`` or ``lit``."""
    members: list[tuple[str, Node]] = field(default_factory=list)
    """``obj``: (key, value) in order, duplicates kept."""
    items: list[Node] = field(default_factory=list)
    """``arr``: the elements."""
    text: str = ""
    """``str``: the string; ``num``: the token; ``lit``: the literal."""
    start: int = 0
    end: int = 0


KEYS = st.sampled_from(
    ["role", "content", "a", "é", "北", 'q"', "b\\s", "tab\t", "\U0001f600", "", "k/"]
)
TEXTS = st.text(
    alphabet=st.sampled_from(
        [*'ab "\\/{}[],:\n\t\r\x00\x1f\x7fé北', "\U0001f600", "\u2028", "\ud800", "\udc00"]
    ),
    max_size=12,
) | st.text(alphabet=st.sampled_from(list('ab\\"{}')), min_size=60, max_size=300)
NUMBERS = st.sampled_from(
    [
        "0", "-0", "-0.0", "0.0", "1", "-1", "1e2", "1E+2", "1.5E-3", "0.1",
        "18446744073709551615", "18446744073709551616", "-9223372036854775808",
        "-9223372036854775809", "100000000000000000000", "1E400", "-1e400", "1e-400",
        "1.00000000000000000001", "123456789012345678901234567890.0", "9007199254740993",
        "2.2250738585072014e-308", "4.9e-324", "1.7976931348623157e308",
    ]
) | st.from_regex(r"\A-?(0|[1-9][0-9]{0,22})(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?\Z")  # fmt: skip


def values(max_leaves: int = 12) -> st.SearchStrategy[Node]:
    leaf = st.one_of(
        TEXTS.map(lambda t: Node("str", text=t)),
        NUMBERS.map(lambda t: Node("num", text=t)),
        st.sampled_from(["true", "false", "null"]).map(lambda t: Node("lit", text=t)),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda xs: Node("arr", items=xs)),
            st.lists(st.tuples(KEYS, inner), max_size=4).map(lambda ms: Node("obj", members=ms)),
        ),
        max_leaves=max_leaves,
    )


def message() -> st.SearchStrategy[Node]:
    extra = st.lists(st.tuples(KEYS, values(3)), max_size=2)
    return st.tuples(st.sampled_from(["user", "assistant", "tool"]), TEXTS, extra).map(
        lambda t: Node(
            "obj",
            members=[("role", Node("str", text=t[0])), ("content", Node("str", text=t[1])), *t[2]],
        )
    )


BODIES = (
    st.tuples(st.lists(message(), max_size=6), st.lists(st.tuples(KEYS, values()), max_size=3)).map(
        lambda t: Node("obj", members=[("messages", Node("arr", items=t[0])), *t[1]])
    )
    | values()
)

WS = ["", "", "", " ", "\n", "\r\n", "\t", " \n\t ", "\r"]
SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def encode_string(s: str, rnd: random.Random) -> str:
    out = ['"']
    for ch in s:
        code = ord(ch)
        roll = rnd.random()
        if 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}" if roll < 0.5 else f"\\u{code:04X}")
        elif code > 0xFFFF and roll < 0.3:
            hi, lo = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
            out.append(f"\\u{hi:04x}\\u{lo:04x}")
        elif roll < 0.2 and code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        elif ch in SHORT:
            out.append(SHORT[ch])
        elif code < 0x20:
            out.append(f"\\u{code:04x}")
        elif ch == "/" and roll < 0.6:
            out.append("\\/")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def write(node: Node, rnd: random.Random) -> bytes:
    """The body's bytes, recording each node's span."""
    buf = bytearray()

    def ws() -> None:
        buf.extend(rnd.choice(WS).encode())

    def emit(n: Node) -> None:
        n.start = len(buf)
        if n.kind == "str":
            buf.extend(encode_string(n.text, rnd).encode("utf-8", "surrogatepass"))
        elif n.kind in ("num", "lit"):
            buf.extend(n.text.encode())
        elif n.kind == "arr":
            buf.extend(b"[")
            for i, item in enumerate(n.items):
                ws()
                emit(item)
                ws()
                if i < len(n.items) - 1:
                    buf.extend(b",")
            if not n.items:
                ws()
            buf.extend(b"]")
        else:
            buf.extend(b"{")
            for i, (key, value) in enumerate(n.members):
                ws()
                buf.extend(encode_string(key, rnd).encode("utf-8", "surrogatepass"))
                ws()
                buf.extend(b":")
                ws()
                emit(value)
                ws()
                if i < len(n.members) - 1:
                    buf.extend(b",")
            if not n.members:
                ws()
            buf.extend(b"}")
        n.end = len(buf)

    ws()
    emit(node)
    ws()
    return bytes(buf)


# -- the oracle --------------------------------------------------------------------------------


def number_keeps(token: str) -> bool:
    """Whether an orjson parse/dump round trip keeps the number: judged with Python's own float."""
    if all(c in "-0123456789" for c in token):
        return token != "-0" and -(2**63) <= int(token) < 2**64
    value = float(token)
    if math.isinf(value):
        return False
    before, after = Decimal(token), Decimal(repr(value))
    return before == after and before.is_signed() == after.is_signed()


def as_read(s: str) -> str:
    """The string a JSON parser reads back: escaped surrogate halves next to each other pair up."""
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def has_surrogate(s: str) -> bool:
    """Whether the string keeps an unpaired surrogate, which orjson refuses to read."""
    return any(0xD800 <= ord(c) <= 0xDFFF for c in as_read(s))


def replaced_is_safe(n: Node) -> bool:
    """No duplicate key, no number orjson changes, nothing orjson rejects, anywhere inside."""
    if n.kind == "num":
        return number_keeps(n.text)
    if n.kind == "str":
        return not has_surrogate(n.text)
    if n.kind == "arr":
        return all(replaced_is_safe(x) for x in n.items)
    if n.kind == "obj":
        keys = [k for k, _ in n.members]
        return (
            len(set(keys)) == len(keys)
            and not any(has_surrogate(k) for k in keys)
            and all(replaced_is_safe(v) for _, v in n.members)
        )
    return True


def object_ok(n: Node) -> bool:
    """An object splice walks through: every key once and readable by orjson."""
    keys = [k for k, _ in n.members]
    return len(set(keys)) == len(keys) and not any(has_surrogate(k) for k in keys)


def lookup(root: Node, path: tuple[Any, ...]) -> tuple[Node | None, bool]:
    """(the node at ``path``, whether every object on the way is unambiguous)."""
    node, clean = root, True
    for step in path:
        if node.kind == "obj" and type(step) is str:
            clean = clean and object_ok(node)
            found = [v for k, v in node.members if k == step]
            if not found:
                return None, clean
            node = found[0]
        elif node.kind == "arr" and type(step) is int and step < len(node.items):
            node = node.items[step]
        else:
            return None, clean
    return node, clean


def conflicting(edits: list[Edit]) -> bool:
    replaces = [e.path for e in edits if isinstance(e, Replace)]
    reorders = [e for e in edits if isinstance(e, Reorder)]
    inserts = [(e.path, e.key) for e in edits if isinstance(e, Insert)]
    places = [e.path for e in edits]
    if len(set(replaces)) != len(replaces) or len(set(inserts)) != len(inserts):
        return True
    if len({r.path for r in reorders}) != len(reorders):
        return True
    for replaced in replaces:
        if sum(p[: len(replaced)] == replaced for p in places) > 1:  # itself, and inside it
            return True
    for path, key in inserts:
        if (*path, key) in replaces or any(p[: len(path) + 1] == (*path, key) for p in places):
            return True
    for r in reorders:
        if len(set(r.order)) != len(r.order):
            return True
        kept = set(r.order)
        n = len(r.path)
        if any(len(p) > n and p[:n] == r.path and p[n] not in kept for p in places):
            return True
    return False


def refused(root: Node, edits: list[Edit]) -> bool:
    """Whether the rules say this splice must be refused."""
    if conflicting(edits):
        return True
    for e in edits:
        node, clean = lookup(root, e.path)
        if node is None or not clean:
            return True
        if isinstance(e, Replace) and not replaced_is_safe(node):
            return True
        if isinstance(e, Reorder) and (
            node.kind != "arr" or any(i >= len(node.items) for i in e.order)
        ):
            return True
        if isinstance(e, Insert) and (
            node.kind != "obj" or not object_ok(node) or e.key in [k for k, _ in node.members]
        ):
            return True
    return False


def expected(raw: bytes, root: Node, edits: list[Edit]) -> bytes:
    """The output the edits describe, built from the recorded spans (edits known to be valid)."""
    replaces = {e.path: e.value for e in edits if isinstance(e, Replace)}
    reorders = {e.path: e.order for e in edits if isinstance(e, Reorder)}
    inserts: dict[tuple[Any, ...], list[bytes]] = {}
    for e in edits:
        if isinstance(e, Insert):
            inserts.setdefault(e.path, []).append(orjson.dumps(e.key) + b":" + e.value)
    touched = {e.path[:i] for e in edits for i in range(len(e.path) + 1)}

    def render(n: Node, path: tuple[Any, ...]) -> bytes:
        if path in replaces:
            return replaces[path]
        if path not in touched:
            return raw[n.start : n.end]
        if n.kind == "obj":
            out = [b"{"]
            if path in inserts:
                out.append(b",".join(inserts[path]) + (b"," if n.members else b""))
            cursor = n.start + 1
            for key, value in n.members:
                out.append(raw[cursor : value.start])
                out.append(render(value, (*path, key)))
                cursor = value.end
            out.append(raw[cursor : n.end])
            return b"".join(out)
        assert n.kind == "arr"
        parts = [render(x, (*path, i)) for i, x in enumerate(n.items)]
        order = reorders.get(path, tuple(range(len(n.items))))
        if not n.items:
            return raw[n.start : n.end]
        spans = [(x.start, x.end) for x in n.items]
        out = [raw[n.start : spans[0][0]]]
        for slot, i in enumerate(order):
            if slot:
                out.append(raw[spans[slot - 1][1] : spans[slot][0]])
            out.append(parts[i])
        out.append(raw[spans[-1][1] : n.end])
        return b"".join(out)

    return raw[: root.start] + render(root, ()) + raw[root.end :]


# -- reading a value back ----------------------------------------------------------------------


def parse_exact(data: bytes) -> Any:
    """Python's json, keeping duplicate keys and number tokens (orjson keeps neither)."""
    return json.loads(
        data,
        object_pairs_hook=lambda pairs: ("obj", pairs),
        parse_float=lambda t: ("num", t),
        parse_int=lambda t: ("num", t),
    )


def at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        if type(step) is str:
            value = dict(value[1])[step]
        else:
            value = value[step]
    return value


def paths(n: Node, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Node]]:
    out = [(path, n)]
    if n.kind == "obj":
        for key, value in n.members:
            out.extend(paths(value, (*path, key)))
    elif n.kind == "arr":
        for i, x in enumerate(n.items):
            out.extend(paths(x, (*path, i)))
    return out


REPLACEMENTS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8),
    st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(-1000, 1000), max_size=2),
)  # fmt: skip


@st.composite
def edit_sets(draw: st.DrawFn, root: Node, raw: bytes) -> list[Edit]:
    where = paths(root)
    inner = where[1:] or where  # the whole body, replaced, would conflict with any other edit
    edits: list[Edit] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["replace", "replace_same", "reorder", "insert"]))
        path, node = draw(st.sampled_from(where if draw(st.integers(0, 9)) == 0 else inner))
        if kind == "replace":
            edits.append(Replace(path=path, value=orjson.dumps(draw(REPLACEMENTS))))
        elif kind == "replace_same":
            edits.append(Replace(path=path, value=raw[node.start : node.end]))
        elif kind == "reorder":
            n = len(node.items) if node.kind == "arr" else draw(st.integers(0, 3))
            order = draw(st.permutations(range(n)))
            keep = draw(st.integers(0, n))
            bad = draw(st.sampled_from([(), (), (), (), (0,), (n,)]))
            edits.append(Reorder(path=path, order=tuple(order[:keep]) + bad))
        else:
            edits.append(Insert(path=path, key=draw(KEYS), value=orjson.dumps(draw(REPLACEMENTS))))
    return edits


# -- the properties ----------------------------------------------------------------------------


@PROPS
@given(BODIES, st.randoms(use_true_random=False), st.data())
def test_splice_is_refused_exactly_when_a_rule_applies_and_is_byte_exact_otherwise(
    root: Node, rnd: random.Random, data: st.DataObject
) -> None:
    raw = write(root, rnd)
    edits = data.draw(edit_sets(root, raw))
    out = splice(raw, edits)
    if refused(root, edits):
        assert out is None, try_splice(raw, edits)
        return
    assert out is not None, try_splice(raw, edits)
    # (b) every byte outside the edited values is the client's byte: the output is exactly the
    # one built from the generator's own spans.
    assert out == expected(raw, root, edits)
    # (a) the output reads back with each edit applied.
    try:
        parsed: Any = orjson.loads(out)
    except orjson.JSONDecodeError:
        parsed = None  # a lone surrogate or 1E400 outside the edits: orjson refuses the body
    exact = parse_exact(out)
    for e in edits:
        if isinstance(e, Replace) and not any(
            isinstance(r, Reorder) and e.path[: len(r.path)] == r.path and len(e.path) > len(r.path)
            for r in edits
        ):
            assert at(exact, e.path) == parse_exact(e.value)
            if parsed is not None:
                assert orjson.dumps(at_plain(parsed, e.path)) == orjson.dumps(orjson.loads(e.value))
        elif isinstance(e, Insert) and not any(
            isinstance(r, Reorder) and e.path[: len(r.path)] == r.path and len(e.path) > len(r.path)
            for r in edits
        ):
            assert at(exact, (*e.path, e.key)) == parse_exact(e.value)
        elif isinstance(e, Reorder) and len(edits) == 1:
            before = at(parse_exact(raw), e.path)
            assert at(exact, e.path) == [before[i] for i in e.order]


def at_plain(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


@PROPS
@given(BODIES, st.randoms(use_true_random=False), st.data())
def test_replacing_a_value_with_its_own_bytes_returns_the_body_unchanged(
    root: Node, rnd: random.Random, data: st.DataObject
) -> None:
    raw = write(root, rnd)
    path, node = data.draw(st.sampled_from(paths(root)))
    out = splice(raw, [Replace(path=path, value=raw[node.start : node.end])])
    assert (out is None) == refused(root, [Replace(path=path, value=b"0")])
    assert out is None or out == raw
    if node.kind == "arr":
        same = splice(raw, [Reorder(path=path, order=tuple(range(len(node.items))))])
        assert same is None or same == raw


@PROPS
@given(BODIES, st.randoms(use_true_random=False), st.data())
def test_a_duplicate_key_on_an_edit_path_is_always_refused(
    root: Node, rnd: random.Random, data: st.DataObject
) -> None:
    objects = [(p, n) for p, n in paths(root) if n.kind == "obj" and n.members]
    assume(objects)
    path, obj = data.draw(st.sampled_from(objects))
    i = data.draw(st.integers(0, len(obj.members) - 1))
    key = obj.members[i][0]
    # The duplicate goes before or after the original; the writer may escape it differently.
    copy = Node("lit", text=data.draw(st.sampled_from(["null", "1", "true"])))
    j = data.draw(st.integers(0, len(obj.members)))
    obj.members.insert(j, (key, copy))
    raw = write(root, rnd)
    target = (*path, key)
    choices: list[Edit] = [
        Replace(path=target, value=b'"x"'),
        Replace(path=path, value=b"{}"),  # the object itself is replaced: a duplicate inside
        Insert(path=path, key="\x01new", value=b"1"),
    ]
    edits = [data.draw(st.sampled_from(choices))]
    assert splice(raw, edits) is None


@PROPS
@given(BODIES, st.randoms(use_true_random=False))
def test_the_generator_writes_what_it_recorded(root: Node, rnd: random.Random) -> None:
    """The oracle's own footing: every recorded span parses back to its node."""
    raw = write(root, rnd)
    for _, node in paths(root):
        assume(node.end > node.start)
        value = parse_exact(raw[node.start : node.end])
        if node.kind == "str":
            assert value == as_read(node.text)
        elif node.kind == "num":
            assert value == ("num", node.text)
        elif node.kind == "obj":
            assert [k for k, _ in value[1]] == [k for k, _ in node.members]


CHATS = st.tuples(
    st.lists(message(), min_size=1, max_size=8), st.lists(st.tuples(KEYS, values()), max_size=2)
).map(lambda t: Node("obj", members=[("messages", Node("arr", items=t[0])), *t[1]]))


@PROPS
@given(CHATS, st.randoms(use_true_random=False), st.data())
def test_a_planner_shaped_repair_reads_back_as_the_repaired_body(
    root: Node, rnd: random.Random, data: st.DataObject
) -> None:
    """The edits kvwarm makes: put messages in order, drop one, restore contents (by the client's
    indices), add ``stream_options``. The output reads back as the body repaired in Python."""
    raw = write(root, rnd)
    n = len(root.members[0][1].items)
    order = tuple(data.draw(st.permutations(range(n))))[: data.draw(st.integers(max(0, n - 1), n))]
    restored = dict(data.draw(st.lists(st.tuples(st.integers(0, n - 1), TEXTS), max_size=3)))
    edits: list[Edit] = [Reorder(path=("messages",), order=order)] if data.draw(st.booleans()) else []
    if not edits:
        order = tuple(range(n))
    edits += [
        Replace(path=("messages", i, "content"), value=orjson.dumps(as_read(t)))
        for i, t in restored.items()
        if i in order and not has_surrogate(t)
    ]
    if not edits or data.draw(st.booleans()):
        edits.append(Insert(path=(), key="stream_options", value=b'{"include_usage":true}'))
    out = splice(raw, edits)
    if refused(root, edits):
        assert out is None
        return
    assert out == expected(raw, root, edits)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return  # orjson reads neither (a lone surrogate or 1E400 left as it came)
    messages = body["messages"]
    for i, t in restored.items():
        if i in order and not has_surrogate(t):
            messages[i]["content"] = as_read(t)
    body["messages"] = [messages[i] for i in order]
    if any(isinstance(e, Insert) for e in edits):
        body = {"stream_options": {"include_usage": True}, **body}
    assert orjson.loads(out) == body


# -- the chat front-end's one-step insert of the usage option -------------------------------------

_CHAT_KEYS = st.sampled_from(["model", "temperature", "tools", "user", "metadata", "stream", "n"])
_WRITERS = {
    "orjson": orjson.dumps,
    "json.dumps": lambda v: json.dumps(v).encode(),
    "indented": lambda v: json.dumps(v, indent=2, ensure_ascii=False).encode(),
    "padded": lambda v: b" \n\t" + json.dumps(v, separators=(" , ", " : "), ensure_ascii=False).encode() + b"\r\n ",
}


@PROPS
@given(
    others=st.dictionaries(_CHAT_KEYS, st.one_of(st.integers(), st.text(max_size=8), st.booleans(), st.none()), max_size=4),
    contents=st.lists(st.one_of(TEXTS, st.just('say "stream"'), st.just("stream_options")), min_size=1, max_size=4),
    writer=st.sampled_from(sorted(_WRITERS)),
    stream_first=st.booleans(),
)
def test_the_usage_option_inserted_in_one_step_is_the_splice(
    others: dict[str, Any], contents: list[str], writer: str, stream_first: bool
) -> None:
    """``insert_first_member`` gives byte for byte what the splicer gives for the same insert, or
    declines (None) where it cannot be sure: a second ``"stream"``, a ``"stream_options"`` or a
    ``\\u`` escape anywhere in the bytes."""
    from proxy.wire.chat import insert_first_member

    body: dict[str, Any] = {k: v for k, v in others.items() if k != "stream"}
    messages = [{"role": "user", "content": c} for c in contents]
    body = {"stream": True, **body, "messages": messages} if stream_first else {**body, "messages": messages, "stream": True}
    try:
        raw = _WRITERS[writer](body)
    except (TypeError, UnicodeEncodeError):  # a lone surrogate only an ASCII-escaping writer can write
        assume(False)
    member = b'"stream_options":{"include_usage":true}'
    fast = insert_first_member(raw, member)
    slow = splice(raw, (Insert(path=(), key="stream_options", value=b'{"include_usage":true}'),))
    sure = raw.count(b'"stream"') == 1 and b'"stream_options"' not in raw and b"\\u" not in raw
    assert (fast is not None) == sure
    if fast is not None:
        assert fast == slow
        assert orjson.loads(fast) == {"stream_options": {"include_usage": True}, **orjson.loads(raw)}


def test_the_one_step_insert_declines_a_second_stream_member() -> None:
    from proxy.wire.chat import insert_first_member

    raw = b'{"model":"m","stream":false,"stream":true,"messages":[{"role":"user","content":"hi"}]}'
    assert insert_first_member(raw, b'"x":1') is None
    assert insert_first_member(b'{"stream":true,"messages":[]}', b'"x":1') == b'{"x":1,"stream":true,"messages":[]}'
