"""The Markdown transcript format: exact round trips of any content, and loud failures naming the line."""

from __future__ import annotations

from dataclasses import astuple, replace
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core import transcript_md as tm
from proxy.core.identity import message_identity, tools_identity
from proxy.core.match import chain, tenant_root
from proxy.core.policy import Policy
from proxy.errors import TranscriptFormatError
from proxy.store.base import ROLE_TOOLS, Node, SessionTotals

ROOT = tenant_root(b"k" * 32, "Bearer sk-test")
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.\nSecond line.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are careful."},
    {"role": "user", "content": "Find the cache key.\n"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"src/cache.py"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "def key(): ...\n"},
    {"role": "assistant", "content": "It is computed in key().\n"},
]
DELIMITERS = [
    "-->", "--->", "<!--", "%", "%25", "%0A", "%u2028", "\\", "\n", "\r", "\r\n", "\u2028", "\u2029", "\x85", "\x0b",
    tm.END_MARKER, tm.HEADER_OPEN, tm.ELEMENT_OPEN, "\n-->\n", "    ", "# heading", "```",
]


def build(
    elements: list[Any],
    *,
    totals: SessionTotals | None = None,
    policy: Policy | None = None,
    generated_last: bool = True,
    bodies: list[bytes] | None = None,
) -> tm.Transcript:
    """A transcript chained exactly as the pipeline chains one (element 0 is the tools array)."""
    nodes: list[Node] = []
    parent = ROOT
    for depth, element in enumerate(elements):
        body = bodies[depth] if bodies is not None else orjson.dumps(element)
        identity = tools_identity(element) if depth == 0 else message_identity(element, policy)
        generated = generated_last and depth == len(elements) - 1 and depth > 0
        role = ROLE_TOOLS if depth == 0 else element.get("role") if isinstance(element, dict) else ""
        key = chain(parent, identity)
        nodes.append(Node(key=key, parent=parent, tenant=ROOT, depth=depth, role=role or ("assistant" if generated else ""),
                          identity=identity, body=body, tokens=depth * 7, generated=generated,
                          created=1_700_000_000.25 + depth))
        parent = key
    totals = totals or SessionTotals(turns=2, prompt_tokens=3000, cached_tokens=2048, completion_tokens=40,
                                     cost_usd=0.1 + 0.2, billed=True, repaired=3, last_break="content_changed",
                                     model="gpt-4o", created=1_700_000_000.5, updated=1_700_000_100.000001)
    return tm.Transcript(session=parent, tenant=ROOT, secret_id=b"\x01" * 8, totals=totals, nodes=tuple(nodes))


def assert_same(a: tm.Transcript, b: tm.Transcript) -> None:
    assert (a.session, a.tenant, a.secret_id) == (b.session, b.tenant, b.secret_id)
    assert astuple(a.totals) == astuple(b.totals)
    assert [astuple(n) for n in a.nodes] == [astuple(n) for n in b.nodes]


def line_of(text: str, needle: str, nth: int = 0) -> int:
    """1-based number of the ``nth`` line (0 = first) that starts with ``needle``."""
    found = [i + 1 for i, line in enumerate(text.split("\n")) if line.startswith(needle)]
    return found[nth]


def replace_line(text: str, number: int, new: str | None) -> str:
    lines = text.split("\n")
    if new is None:
        del lines[number - 1]
    else:
        lines[number - 1] = new
    return "\n".join(lines)


def fails_at(text: str, line: int, words: str, policy: Policy | None = None) -> TranscriptFormatError:
    with pytest.raises(TranscriptFormatError) as info:
        tm.parse(text, policy)
    assert info.value.line == line, str(info.value)
    assert words in info.value.problem
    return info.value


# -- escaping --------------------------------------------------------------------------------


@given(st.text())
def test_escape_is_a_one_line_bijection(text: str) -> None:
    escaped = tm.escape(text)
    assert tm.unescape(escaped) == text
    assert "-->" not in escaped
    assert len(escaped.splitlines()) <= 1 and "\n" not in escaped and "\r" not in escaped


@given(st.lists(st.sampled_from(DELIMITERS), max_size=8).map("".join))
def test_escape_round_trips_delimiter_soup(text: str) -> None:
    assert tm.unescape(tm.escape(text)) == text


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("%ZZ", "bad escape"),
        ("abc%4", "bad escape"),
        ("%0a", "bad escape"),  # lower-case hex is not the canonical spelling
        ("%u20", "bad escape"),
        ("%41", "canonical"),  # 'A' needs no escape
        ("%3E", "canonical"),  # only the > of a --> is escaped
        ("a-->b", "canonical"),  # a raw --> cannot come from escape()
    ],
)
def test_unescape_refuses_anything_escape_does_not_write(line: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        tm.unescape(line)


# -- round trips -----------------------------------------------------------------------------


def test_round_trip_of_a_tool_using_conversation() -> None:
    t = build([TOOLS, *MESSAGES])
    text = tm.render(t)
    back = tm.parse(text)
    assert_same(back, t)
    assert tm.render(back) == text
    # People can read it: the texts appear as indented rendering, the header as in the seed format.
    assert "    It is computed in key()." in text
    assert "    → read_file({\"path\":\"src/cache.py\"})" in text
    assert "cache_hit_pct: 68.3%" in text and "charged_usd: 0.30000000000000004" in text


def test_bodies_that_orjson_did_not_write_round_trip_byte_for_byte() -> None:
    elements = [[], {"role": "user", "content": "a\nb"}]
    bodies = [b"[ ]", b'{ "content" : "a\\nb",\n  "role": "user" }\r\n']
    t = build(elements, bodies=bodies, generated_last=False)
    assert [n.body for n in tm.parse(tm.render(t)).nodes] == bodies


texts = st.one_of(st.text(), st.lists(st.one_of(st.sampled_from(DELIMITERS), st.text(max_size=5)), max_size=8).map("".join))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    contents=st.lists(texts, min_size=1, max_size=4),
    role=texts,
    model=texts,
    last_break=texts,
    arguments=texts,
    tool_name=texts,
    cost=st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False),
    micros=st.integers(min_value=0, max_value=4_000_000_000_000_000),
)
def test_any_content_round_trips_exactly(
    contents: list[str], role: str, model: str, last_break: str, arguments: str, tool_name: str, cost: float, micros: int
) -> None:
    messages: list[dict[str, Any]] = [{"role": role, "content": c} for c in contents]
    messages.append({"role": "assistant", "content": contents[0],
                     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": tool_name, "arguments": arguments}}]})
    tools = [{"type": "function", "function": {"name": tool_name, "description": contents[-1]}}]
    totals = SessionTotals(turns=1, prompt_tokens=10, cached_tokens=5, completion_tokens=1, cost_usd=cost,
                           last_break=last_break, model=model, created=micros / 1e6, updated=micros / 1e6)
    t = build([tools, *messages], totals=totals)
    text = tm.render(t)
    back = tm.parse(text.encode("utf-8"))
    assert_same(back, t)
    assert tm.render(back) == text


def test_pinned_identities_need_the_same_policy() -> None:
    pinned = Policy.build(True, False, {"system": [r"\d{4}-\d{2}-\d{2}"]})
    t = build([[], {"role": "system", "content": "Today is 2026-04-11."}], policy=pinned, generated_last=False)
    text = tm.render(t)
    assert_same(tm.parse(text, pinned), t)
    fails_at(text, line_of(text, tm.ELEMENT_OPEN, 1), "pin_patterns")


# -- malformed files: each refused whole, naming the line --------------------------------------


@pytest.fixture
def text() -> str:
    return tm.render(build([TOOLS, *MESSAGES]))


def test_bad_header_first_line(text: str) -> None:
    fails_at("# notes\n" + text, 1, "not a kvwarm session transcript")
    fails_at(text.replace("\n", "\r\n"), 1, "CRLF")
    fails_at("", 1, "not a kvwarm session transcript")


@pytest.mark.parametrize(
    ("key", "new", "words"),
    [
        ("turn_count:", "turn_count: three", "whole number"),
        ("input_tokens:", "input_tokens: -5", "whole number"),
        ("charged_usd:", "charged_usd: nan", "USD"),
        ("billed:", "billed: yes", "true or false"),
        ("created:", "created: 2026-04-11 14:30:00", "UTC time"),
        ("tenant:", "tenant: XYZ", "hex"),
        ("version:", "version: 2", "unsupported version"),
        ("model:", "model: gpt%ZZ", "bad escape"),
        ("model:", "colour: blue", "unknown header key"),
        ("model:", "model = gpt-4o", "key: value"),
    ],
)
def test_bad_header_value(text: str, key: str, new: str, words: str) -> None:
    number = line_of(text, key)
    fails_at(replace_line(text, number, new), number, words)


def test_header_key_missing_or_repeated(text: str) -> None:
    number = line_of(text, "billed:")
    fails_at(replace_line(text, number, None), line_of(text, "-->") - 1, "lacks billed")
    fails_at(replace_line(text, number, "model: again"), number, "repeats")


def test_unterminated_element(text: str) -> None:
    opened = line_of(text, tm.ELEMENT_OPEN, 2)
    # The '-->' after the data line is missing: the next line is named.
    fails_at(replace_line(text, opened + 2, None), opened + 2, f"closing the element of line {opened}")
    # The file ends right after an element's opening line.
    cut = "\n".join(text.split("\n")[:opened]) + "\n"
    fails_at(cut, opened, "unterminated element")


def test_bad_role(text: str) -> None:
    number = line_of(text, tm.ELEMENT_OPEN, 2)
    line = text.split("\n")[number - 1]
    assert " role=user " in line
    fails_at(replace_line(text, number, line.replace(" role=user ", " role=system ")), number, "bad role")
    fails_at(replace_line(text, number, line.replace(" role=user ", " role=us%ZZer ")), number, "role:")
    tools_line = line_of(text, tm.ELEMENT_OPEN, 0)
    fails_at(replace_line(text, tools_line, text.split("\n")[tools_line - 1].replace("role=tools", "role=user")),
             tools_line, "bad role")


def test_bad_escape_in_data_line(text: str) -> None:
    data = line_of(text, tm.ELEMENT_OPEN, 1) + 1
    original = text.split("\n")[data - 1]
    fails_at(replace_line(text, data, original + "%Q1"), data, "bad escape")
    fails_at(replace_line(text, data, original.replace("careful", "care%66ul")), data, "canonical")


def test_edited_body_keeps_no_identity(text: str) -> None:
    data = line_of(text, tm.ELEMENT_OPEN, 1) + 1
    original = text.split("\n")[data - 1]
    fails_at(replace_line(text, data, original.replace("careful", "reckless")), data - 1, "id does not match")
    fails_at(replace_line(text, data, original[:-1]), data, "not JSON")


def test_missing_or_reordered_elements_break_the_chain(text: str) -> None:
    lines = text.split("\n")
    last = line_of(text, tm.ELEMENT_OPEN, 5)
    # Drop the last element (its heading, rendering and comment): depths stay in order, the chain does not.
    dropped = "\n".join(lines[: last - 1] + lines[last + 2 :])
    fails_at(dropped, line_of(text, "session:"), "chain")
    second = line_of(text, tm.ELEMENT_OPEN, 2)
    wrong_depth = replace_line(text, second, lines[second - 1].replace("depth=2", "depth=3"))
    fails_at(wrong_depth, second, "out of order")


@pytest.mark.parametrize("cut_at", ["end", "header", "data"])
def test_truncated(text: str, cut_at: str) -> None:
    lines = text.split("\n")
    if cut_at == "end":
        cut = "\n".join(lines[:-2]) + "\n"  # everything but the end marker
        fails_at(cut, len(lines) - 1, "truncated")
    elif cut_at == "header":
        cut = "\n".join(lines[:5]) + "\n"
        fails_at(cut, 6, "header is not closed")
    else:
        data = line_of(text, tm.ELEMENT_OPEN, 3) + 1
        cut = "\n".join(lines[: data - 1]) + "\n" + lines[data - 1][:20]
        fails_at(cut, data - 1, "unterminated")


def test_every_prefix_of_a_file_is_refused(text: str) -> None:
    """Never load in part: a file cut anywhere (but after its last newline) raises."""
    assert text.endswith(tm.END_MARKER + "\n")
    for cut in range(0, len(text) - 1, 7):
        with pytest.raises(TranscriptFormatError):
            tm.parse(text[:cut])


def test_stray_text_is_refused(text: str) -> None:
    heading = line_of(text, "## 1")
    fails_at(replace_line(text, heading + 1, "a paragraph someone typed"), heading + 1, "unexpected line")
    fails_at(text + "more\n", len(text.split("\n")), "after the end marker")
    attrs = line_of(text, tm.ELEMENT_OPEN, 0)
    fails_at(replace_line(text, attrs, text.split("\n")[attrs - 1] + " extra=1"), attrs, "unknown element attribute")


def test_not_utf8_names_the_line(text: str) -> None:
    data = text.encode()
    number = line_of(text, tm.ELEMENT_OPEN, 1) + 1
    offset = len("\n".join(text.split("\n")[: number - 1]).encode()) + 3
    broken = data[:offset] + b"\xff" + data[offset:]
    with pytest.raises(TranscriptFormatError) as info:
        tm.parse(broken)
    assert info.value.line == number and "UTF-8" in info.value.problem


def test_flags_round_trip_and_are_checked() -> None:
    t = build([[], {"role": "user", "content": "hi"}, {"content": "partial reply"}])
    last = t.nodes[-1]
    t = replace(t, nodes=(*t.nodes[:-1], replace(last, partial=True)))
    text = tm.render(t)
    back = tm.parse(text)
    assert back.nodes[-1].role == "assistant" and back.nodes[-1].generated and back.nodes[-1].partial
    number = line_of(text, tm.ELEMENT_OPEN, 2)
    fails_at(text.replace("flags=generated,partial", "flags=partial"), number, "flags:")
    # Without the generated flag, a message without a role has no role.
    fails_at(text.replace("flags=generated,partial", "flags=-"), number, "bad role")
