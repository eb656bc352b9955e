"""Byte-exact splicing of repair edits into the client's JSON body: each edit kind, every refusal
rule, and the odd JSON the scanner must get right.

Run as a script for the speed measurement (not asserted)::

    .venv/bin/python -m tests.core.test_splice
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.core.splice import (
    REFUSALS,
    Edit,
    Insert,
    Refusal,
    Reorder,
    Replace,
    splice,
    try_splice,
)


def spliced(raw: bytes, *edits: Edit) -> bytes:
    out = try_splice(raw, list(edits))
    assert isinstance(out, bytes), out
    assert splice(raw, list(edits)) == out
    return out


def refusal(raw: bytes, *edits: Edit) -> str:
    out = try_splice(raw, list(edits))
    assert isinstance(out, Refusal), out
    assert out.reason in REFUSALS
    assert splice(raw, list(edits)) is None
    return out.reason


CHAT = (
    b'{"model":"m","messages":[{"role":"system","content":"be brief"},'
    b'{"role":"user","content":"hi  "},{"role":"assistant","content":"hello"}],"seed":7}'
)


# -- Replace -----------------------------------------------------------------------------------


def test_replace_sets_one_value_and_keeps_every_other_byte() -> None:
    out = spliced(CHAT, Replace(path=("messages", 1, "content"), value=b'"hi"'))
    assert out == CHAT.replace(b'"hi  "', b'"hi"')


def test_replace_keeps_the_whitespace_around_the_value() -> None:
    raw = b'{ "a" :\r\n\t[ 1 ,\n 2 ] ,"b":{ "c" : "x" } }'
    assert spliced(raw, Replace(path=("a", 1), value=b"3")) == b'{ "a" :\r\n\t[ 1 ,\n 3 ] ,"b":{ "c" : "x" } }'
    assert (
        spliced(raw, Replace(path=("b", "c"), value=b"null"))
        == b'{ "a" :\r\n\t[ 1 ,\n 2 ] ,"b":{ "c" : null } }'
    )
    assert spliced(raw, Replace(path=("a",), value=b"{}")) == b'{ "a" :\r\n\t{} ,"b":{ "c" : "x" } }'


def test_replace_of_the_whole_body_keeps_the_surrounding_whitespace() -> None:
    assert spliced(b' \n{"a":1}\t', Replace(path=(), value=b"[]")) == b" \n[]\t"
    assert spliced(b"3", Replace(path=(), value=b'"x"')) == b'"x"'


def test_replace_of_a_whole_message_and_of_its_tool_calls() -> None:
    raw = (
        b'{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"b","function":'
        b'{"name":"f","arguments":"{\\"x\\": 1}"}},{"id":"a"}]}]}'
    )
    calls = b'[{"id":"a"},{"id":"b","function":{"name":"f","arguments":"{\\"x\\":1}"}}]'
    out = spliced(raw, Replace(path=("messages", 0, "tool_calls"), value=calls))
    assert orjson.loads(out)["messages"][0]["tool_calls"] == orjson.loads(calls)
    assert out.startswith(b'{"messages":[{"role":"assistant","content":null,"tool_calls":')
    whole = spliced(raw, Replace(path=("messages", 0), value=b'{"role":"user","content":"x"}'))
    assert whole == b'{"messages":[{"role":"user","content":"x"}]}'


def test_replace_with_the_same_bytes_returns_the_body_unchanged() -> None:
    raw = b'{"a" : [1, {"b": "\\u00e9\\"x"}] , "c":2}'
    assert spliced(raw, Replace(path=("a", 1, "b"), value=b'"\\u00e9\\"x"')) == raw
    assert spliced(raw, Replace(path=("a",), value=b'[1, {"b": "\\u00e9\\"x"}]')) == raw
    assert spliced(raw) == raw  # no edits: the body itself


# -- Reorder -----------------------------------------------------------------------------------


def test_reorder_moves_whole_elements_between_fixed_separators() -> None:
    raw = b'{"m": [\n  {"i":0},\n  {"i":1} ,\n  "two"\n]}'
    assert (
        spliced(raw, Reorder(path=("m",), order=(2, 0, 1))) == b'{"m": [\n  "two",\n  {"i":0} ,\n  {"i":1}\n]}'
    )
    assert (
        spliced(raw, Reorder(path=("m",), order=(1, 0, 2))) == b'{"m": [\n  {"i":1},\n  {"i":0} ,\n  "two"\n]}'
    )


def test_reorder_drops_the_indices_it_leaves_out() -> None:
    raw = b'{"m":[ 1 , 2 ,3 ]}'
    assert spliced(raw, Reorder(path=("m",), order=(0, 2))) == b'{"m":[ 1 , 3 ]}'
    assert spliced(raw, Reorder(path=("m",), order=(2,))) == b'{"m":[ 3 ]}'
    assert spliced(raw, Reorder(path=("m",), order=())) == b'{"m":[  ]}'
    assert json.loads(spliced(raw, Reorder(path=("m",), order=()))) == {"m": []}


def test_reorder_in_order_and_of_an_empty_array_changes_nothing() -> None:
    raw = b'{"m":[ 1 , 2 ,3 ], "e": [ ]}'
    assert spliced(raw, Reorder(path=("m",), order=(0, 1, 2))) == raw
    assert spliced(raw, Reorder(path=("e",), order=())) == raw


def test_reorder_moves_elements_with_duplicate_keys_whole() -> None:
    raw = b'[{"content":"A","content":"B"},{"n":1e400,"big":18446744073709551616}]'
    out = spliced(raw, Reorder(path=(), order=(1, 0)))
    assert out == b'[{"n":1e400,"big":18446744073709551616},{"content":"A","content":"B"}]'


def test_edits_inside_a_reordered_array_name_the_clients_indices() -> None:
    raw = b'{"messages":[{"content":"zero"},{"content":"one"},{"content":"two"},{"content":"one"}]}'
    out = spliced(
        raw,
        Reorder(path=("messages",), order=(2, 0, 1)),  # the replayed duplicate (index 3) dropped
        Replace(path=("messages", 0, "content"), value=b'"ZERO"'),
        Replace(path=("messages", 2, "content"), value=b'"TWO"'),
    )
    assert out == b'{"messages":[{"content":"TWO"},{"content":"ZERO"},{"content":"one"}]}'


def test_nested_reorders_and_a_replace_in_the_same_message() -> None:
    raw = b'{"messages":[{"tool_calls":[{"id":"b"},{"id":"a"}],"content":"x "},{"content":"y"}]}'
    out = spliced(
        raw,
        Reorder(path=("messages",), order=(1, 0)),
        Reorder(path=("messages", 0, "tool_calls"), order=(1, 0)),
        Replace(path=("messages", 0, "content"), value=b'"x"'),
    )
    assert (
        out
        == b'{"messages":[{"content":"y"},{"tool_calls":[{"id":"a"},{"id":"b"}],"content":"x"}]}'
    )


# -- Insert ------------------------------------------------------------------------------------


def test_insert_goes_in_front_of_the_first_member() -> None:
    raw = b'{"model":"m","stream":true}'
    out = spliced(raw, Insert(path=(), key="stream_options", value=b'{"include_usage":true}'))
    assert out == b'{"stream_options":{"include_usage":true},"model":"m","stream":true}'


def test_insert_into_an_empty_object_and_into_a_nested_one() -> None:
    assert spliced(b"{}", Insert(path=(), key="a", value=b"1")) == b'{"a":1}'
    assert spliced(b"{ \n }", Insert(path=(), key="a", value=b"1")) == b'{"a":1 \n }'
    raw = b'{"stream_options": {"x": 1}}'
    assert spliced(raw, Insert(path=("stream_options",), key="include_usage", value=b"true")) == (
        b'{"stream_options": {"include_usage":true,"x": 1}}'
    )


def test_several_inserts_keep_their_order_and_keys_are_escaped() -> None:
    out = spliced(b'{"z":0}', Insert(path=(), key="a", value=b"1"), Insert(path=(), key='q"\\é', value=b"2"))
    assert out == '{"a":1,"q\\"\\\\é":2,"z":0}'.encode()
    assert json.loads(out) == {"a": 1, 'q"\\é': 2, "z": 0}


def test_insert_with_repairs_in_one_splice() -> None:
    out = spliced(
        CHAT,
        Insert(path=(), key="stream_options", value=b'{"include_usage":true}'),
        Replace(path=("messages", 1, "content"), value=b'"hi"'),
    )
    assert out == b'{"stream_options":{"include_usage":true},' + CHAT[1:].replace(
        b'"hi  "', b'"hi"'
    )


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (b'{"messages":[{"content":"A","content":"B"}]}', ("messages", 0, "content")),
        (b'{"messages":[{"content":"A","\\u0063ontent":"B"}]}', ("messages", 0, "content")),
        (b'{"messages":[],"messages":[{"content":"A"}]}', ("messages", 0, "content")),
        # Another key twice in an object on the path: the planner (orjson: last wins) and an
        # upstream that takes the first read the message differently.
        (
            b'{"messages":[{"role":"user","content":"A","role":"assistant"}]}',
            ("messages", 0, "content"),
        ),
        (
            b'{"stream":false,"stream":true,"messages":[{"content":"A"}]}',
            ("messages", 0, "content"),
        ),
    ],
)
def test_a_key_twice_in_an_object_on_the_path_is_refused(raw: bytes, path: tuple[Any, ...]) -> None:
    assert refusal(raw, Replace(path=path, value=b'"x"')) == "duplicate_key"


def test_duplicate_keys_off_the_path_are_fine() -> None:
    raw = b'{"messages":[{"content":"A","content":"B"},{"content":"C"}],"x":{"k":1,"k":2}}'
    out = spliced(raw, Replace(path=("messages", 1, "content"), value=b'"D"'))
    assert out == raw.replace(b'"C"', b'"D"')


def test_insert_into_an_object_with_a_key_twice_is_refused() -> None:
    assert (
        refusal(b'{"model":"a","model":"b"}', Insert(path=(), key="stream_options", value=b"{}"))
        == "duplicate_key"
    )


@pytest.mark.parametrize(
    "value",
    [
        b'{"a":1,"a":2}',
        b'[{"x":{"k":1,"k":1}}]',
        b'{"a":1,"\\u0061":2}',
        b'{"t":[{"b":{"c":0,"c":0}}]}',
    ],
)
def test_a_duplicate_key_inside_the_replaced_value_is_refused(value: bytes) -> None:
    raw = b'{"messages":[{"tool_calls":' + value + b"}]}"
    assert refusal(raw, Replace(path=("messages", 0, "tool_calls"), value=b"[]")) == "duplicate_key"


@pytest.mark.parametrize(
    "number",
    [
        b"18446744073709551616",
        b"-9223372036854775809",
        b"100000000000000000000",  # same value as 1e20, but an integer no more
        b"1E400",
        b"-1e400",
        b"1e-400",
        b"-0",
        b"1.00000000000000000001",
        b"123456789012345678901234567890.0",
        b"1" * 5000,
    ],
)
def test_a_number_orjson_would_change_inside_the_replaced_value_is_refused(number: bytes) -> None:
    raw = b'{"messages":[{"tool_calls":[{"function":{"x":' + number + b"}}]}]}"
    assert refusal(raw, Replace(path=("messages", 0, "tool_calls"), value=b"[]")) == "unsafe_number"
    assert refusal(b'{"seed":' + number + b"}", Replace(path=("seed",), value=b"1")) == "unsafe_number"


@pytest.mark.parametrize(
    "number",
    [b"0", b"-1", b"18446744073709551615", b"-9223372036854775808", b"0.1", b"1e2", b"1E+2",
     b"-0.0", b"-0e0", b"1.5E-3", b"2.2250738585072014e-308", b"1.7976931348623157e308"],
)  # fmt: skip
def test_a_number_orjson_keeps_inside_the_replaced_value_is_fine(number: bytes) -> None:
    raw = b'{"a":[' + number + b',{"n":' + number + b"}]}"
    assert spliced(raw, Replace(path=("a",), value=b"[]")) == b'{"a":[]}'


def test_numbers_outside_replaced_values_stay_as_sent() -> None:
    raw = b'{"seed": 18446744073709551616, "t": -0, "x": 1E400, "m":[{"content":"a"}], "y": 1e-400}'
    out = spliced(raw, Replace(path=("m", 0, "content"), value=b'"b"'), Reorder(path=("m",), order=(0,)))
    assert out == raw.replace(b'"a"', b'"b"')


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"   ",
        b'{"m":[{"content":"a"}]',  # unclosed
        b'{"m":[{"content":"a"}]} x',  # trailing bytes
        b'{"m":[{"content":"a"}]}}',
        b'\xef\xbb\xbf{"m":[{"content":"a"}]}',  # a byte order mark
        b'{"m":[{"content":"a"},]}',  # trailing comma
        b'{"m" [{"content":"a"}]}',  # no colon
        b'{m:[{"content":"a"}]}',  # unquoted key
        b'{"m":[{"content":"a"} {"content":"b"}]}',
        b'{"x":"unclosed, "m":[{"content":"a"}]}',
        b'{"x":[1,2,"m":[{"content":"a"}]}',
        b'{"x":nul,"m":[{"content":"a"}]}',
        b'{"x":01,"m":[{"content":"a"}]}',
        b'{"x":1.,"m":[{"content":"a"}]}',
        b'{"x":NaN,"m":[{"content":"a"}]}',
        b"{'m':[{'content':'a'}]}",
    ],
)
def test_a_body_that_is_not_json_where_splice_reads_it_is_refused(raw: bytes) -> None:
    assert refusal(raw, Replace(path=("m", 0, "content"), value=b'"b"')) == "invalid_json"


@pytest.mark.parametrize(
    "value",
    [
        b'"\\ud800"',  # an unpaired surrogate: orjson cannot have read it
        b'"\\udc00\\ud800"',
        b'"\xff"',  # not UTF-8
        b'{"a":"\\ud800"}',
        b'"\\x"',  # no such escape
        b'"a\x01"',  # a raw control character
        b"[1,]",
    ],
)
def test_a_replaced_value_orjson_cannot_read_is_refused(value: bytes) -> None:
    assert refusal(b'{"c":' + value + b"}", Replace(path=("c",), value=b'"b"')) == "invalid_json"


@pytest.mark.parametrize(
    ("raw", "edit"),
    [
        (CHAT, Replace(path=("messages", 3, "content"), value=b'"x"')),
        (CHAT, Replace(path=("messages", 0, "name"), value=b'"x"')),
        (CHAT, Replace(path=("nope",), value=b'"x"')),
        (CHAT, Replace(path=("messages", "0"), value=b'"x"')),  # a key into an array
        (CHAT, Replace(path=(0,), value=b'"x"')),  # an index into an object
        (CHAT, Replace(path=("model", "x"), value=b'"x"')),  # through a string
        (CHAT, Replace(path=("seed", 0), value=b'"x"')),
        (CHAT, Reorder(path=("model",), order=())),
        (CHAT, Reorder(path=("messages", 0), order=())),  # an object is not reordered
        (CHAT, Insert(path=("messages",), key="k", value=b"1")),  # an array gets no members
        (CHAT, Insert(path=("missing",), key="k", value=b"1")),
        (b"[]", Replace(path=(0,), value=b"1")),
    ],
)
def test_a_path_that_leads_nowhere_is_refused(raw: bytes, edit: Edit) -> None:
    assert refusal(raw, edit) == "missing_path"


def test_insert_of_a_key_the_object_has_is_refused() -> None:
    assert refusal(CHAT, Insert(path=(), key="seed", value=b"1")) == "key_exists"
    assert refusal(b'{"\\u0073eed":1}', Insert(path=(), key="seed", value=b"1")) == "key_exists"
    assert refusal(b'{"a":{"b":1}}', Insert(path=("a",), key="b", value=b"1")) == "key_exists"


@pytest.mark.parametrize(
    "edits",
    [
        [Replace(path=("seed",), value=b"1"), Replace(path=("seed",), value=b"2")],
        [Replace(path=("messages",), value=b"[]"), Replace(path=("messages", 0, "content"), value=b'"x"')],
        [Replace(path=("messages", 0, "content"), value=b'"x"'), Replace(path=("messages",), value=b"[]")],
        [Replace(path=("messages",), value=b"[]"), Reorder(path=("messages",), order=(0,))],
        [Replace(path=(), value=b"{}"), Insert(path=(), key="a", value=b"1")],
        [Reorder(path=("messages",), order=(0, 1)), Reorder(path=("messages",), order=(1, 0))],
        [Reorder(path=("messages",), order=(0, 0))],
        [Reorder(path=("messages",), order=(0, 3))],  # no element 3
        [Reorder(path=("messages",), order=(-1,))],
        [Reorder(path=("messages",), order=(1, 2)), Replace(path=("messages", 0, "content"), value=b'"x"')],  # dropped
        [Insert(path=(), key="a", value=b"1"), Insert(path=(), key="a", value=b"2")],
        [Insert(path=(), key="seed", value=b"1"), Replace(path=("seed",), value=b"2")],
        [Replace(path=("seed",), value=b"")],
        [Replace(path=("seed",), value=b"1 2")],
        [Replace(path=("seed",), value=b"{")],
        [Replace(path=("seed",), value=b"NaN")],
        [Insert(path=(), key="a", value=b"tru")],
        [Replace(path=("messages", -1), value=b"1")],
        [Replace(path=("messages", True), value=b"1")],  # type: ignore[list-item]
        [Replace(path=("messages", 1.0), value=b"1")],  # type: ignore[arg-type]
    ],
)
def test_edits_that_contradict_each_other_or_themselves_are_refused(edits: list[Edit]) -> None:
    assert refusal(CHAT, *edits) == "invalid_edit"


def test_refusal_names_where() -> None:
    out = try_splice(b'{"a":{"b":1,"b":2}}', [Replace(path=("a", "b"), value=b"3")])
    assert out == Refusal(reason="duplicate_key", path=("a", "b"))
    assert try_splice(CHAT, [Replace(path=("messages", 9), value=b"1")]) == Refusal(
        reason="missing_path", path=("messages", 9)
    )


# -- odd JSON the scanner must get right -------------------------------------------------------

ODD_STRINGS = [
    b'""',
    b'"\\\\"',  # one backslash: the string ends at the next quote
    b'"\\\\\\\\"',
    b'"\\"\\\\\\""',  # quote, backslash, quote
    b'"a\\\\\\"b"',  # a backslash then a quote
    b'"}]{[,:"',  # brackets and separators inside a string
    b'"\\u0022\\u005c"',
    b'"\\ud83d\\ude00 \xf0\x9f\x98\x80 \xe5\x8c\x97 \\u00e9"',  # a surrogate pair and raw UTF-8
    b'"\\/\\b\\f\\n\\r\\t"',
    b'"' + b"x" * 64 + b'"',  # the short-string bound of the regex, and past it
    b'"' + b"x" * 65 + b'"',
    b'"' + b"x\\\\" * 40 + b'"',
    b'"' + b'\\"' * 200 + b'"',  # escaped quotes come thick: the regex takes over
    b'"' + (b"y" * 300 + b'\\"') * 5 + b'"',  # and sparse: find jumps between them
    b'"' + b'\\"}' * 100 + b"\\\\" + b'"',
    b'"\\\\' + b"z" * 200 + b'"',
]


@pytest.mark.parametrize("text", ODD_STRINGS)
def test_strings_are_skipped_to_their_real_end(text: bytes) -> None:
    raw = b'{"skip":' + text + b',"in":[' + text + b',{"k":' + text + b'}],\r\n\t"t" : 1 }'
    out = spliced(raw, Replace(path=("t",), value=b"2"))
    assert out == raw[: -len(b"1 }")] + b"2 }"
    assert json.loads(out)["skip"] == json.loads(text)
    moved = spliced(raw, Reorder(path=("in",), order=(1, 0)))
    assert json.loads(moved)["in"] == [{"k": json.loads(text)}, json.loads(text)]
    assert refusal(raw + b"]", Replace(path=("t",), value=b"2")) == "invalid_json"


@pytest.mark.parametrize(
    "value",
    [
        b"[[[[]]],[{}],{}]",
        b'{"a":{"b":{"c":[1,[2,[3]]]}}}',
        b"[ ]",
        b"{ }",
        b"-0.5e-7",
        b"1E+400",
        b"18446744073709551616",
        b"true",
        b"false",
        b"null",
        b' [ 1 ,\r\n\t"]" , { "}" : [ ] } ] ',
    ],
)
def test_values_of_every_form_are_skipped_whole(value: bytes) -> None:
    raw = b'\r\n {\t"v" :' + value + b', "list" : [' + value + b" , " + value + b'] ,"t":0 } \n'
    out = spliced(raw, Replace(path=("t",), value=b"1"), Reorder(path=("list",), order=(1,)))
    # The one element left sits between the array's first and last separators: "[" and "]".
    assert out == raw.replace(b"[" + value + b" , " + value + b"]", b"[" + value + b"]").replace(
        b'"t":0', b'"t":1'
    )


def test_keys_on_the_path_are_compared_after_unescaping() -> None:
    raw = b'{"\\u006dessages":[{"c\\u006Fntent":"a","\\ud83d\\ude00":1}]}'
    out = spliced(raw, Replace(path=("messages", 0, "content"), value=b'"b"'))
    assert out == raw.replace(b'"a"', b'"b"')
    assert spliced(raw, Replace(path=("messages", 0, "\U0001f600"), value=b"2")) == raw.replace(b":1}", b":2}")


def test_whitespace_everywhere() -> None:
    raw = (
        b' \r\n\t{ \r\n\t"a" \r\n\t: \r\n\t[ \r\n\t1 \r\n\t, \r\n\t{ \r\n\t} \r\n\t] \r\n\t} \r\n\t'
    )
    out = spliced(raw, Reorder(path=("a",), order=(1, 0)), Insert(path=("a", 1), key="k", value=b"null"))
    assert out == raw.replace(b"1 \r\n\t, \r\n\t{ \r\n\t}", b'{"k":null \r\n\t} \r\n\t, \r\n\t1')


def test_a_many_megabyte_transcript_with_a_repair_at_its_end() -> None:
    messages = [{"role": "user", "content": f"message {i} " + 'x\\"y' * 200} for i in range(2000)]
    body = {"model": "m", "messages": messages}
    raw = orjson.dumps(body)
    order = (*range(1000), 1001, 1000, *range(1002, 2000))
    out = spliced(
        raw, Reorder(path=("messages",), order=order), Replace(path=("messages", 1999, "content"), value=b'"z"')
    )
    expected = [messages[i] for i in order]
    expected[-1] = {**expected[-1], "content": "z"}
    assert orjson.loads(out) == {"model": "m", "messages": expected}


# -- speed, measured by hand -------------------------------------------------------------------


def _benchmark() -> None:  # pragma: no cover - run manually
    import glob
    import random
    import time

    rnd = random.Random(1)
    source = "".join(open(f).read() for f in sorted(glob.glob("proxy/**/*.py", recursive=True)))
    words = "the quick brown fox jumps over a lazy dog while the agent reads , . é 北京".split()

    def prose(n: int) -> str:
        return " ".join(rnd.choice(words) for _ in range(n // 5))

    def code(n: int) -> str:
        i = rnd.randrange(len(source) - n)
        return source[i : i + n]

    def json_text(n: int) -> str:
        rows: list[bytes] = []
        while sum(map(len, rows)) < n:
            rows.append(orjson.dumps({"id": rnd.randrange(10**6), "path": "/a/b.py", "ok": True}))
        return "[" + ",".join(r.decode() for r in rows) + "]"

    def mixed(n: int) -> str:
        return rnd.choice([prose, code, json_text])(n)

    def best(f: Any, n: int = 30) -> float:
        """The fastest of nine rounds, in CPU time: the machine is shared."""
        times = []
        for _ in range(9):
            start = time.process_time()
            for _ in range(n):
                f()
            times.append((time.process_time() - start) / n)
        return min(times)

    for name, make in [("prose", prose), ("code", code), ("json", json_text), ("mixed", mixed)]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
        for i in range(499):
            if i % 5 == 3:
                args = orjson.dumps({"path": "/a/b", "n": i}).decode()
                call = {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": "read", "arguments": args},
                }
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                role = "tool" if i % 5 == 4 else "user" if i % 2 else "assistant"
                messages.append({"role": role, "content": make(2400)})
        raw = orjson.dumps({"model": "m", "messages": messages, "stream": True})
        order = (*range(100), 101, 100, *range(102, 500))
        edits: list[Edit] = [
            Replace(path=("messages", 499, "content"), value=b'"restored"'),
            Reorder(path=("messages",), order=order),
        ]
        assert splice(raw, edits) is not None
        loads = best(lambda raw=raw: orjson.loads(raw))
        both = best(lambda raw=raw, edits=edits: splice(raw, edits))
        one = best(lambda raw=raw, edits=edits: splice(raw, edits[:1]))
        print(
            f"{name:6} {len(raw) / 1e6:.2f} MB, 500 messages: orjson.loads {loads * 1e3:.2f} ms; "
            f"splice Replace+Reorder {both * 1e3:.2f} ms ({both / loads:.1f}x); "
            f"Replace only {one * 1e3:.2f} ms ({one / loads:.1f}x)"
        )


if __name__ == "__main__":
    _benchmark()
