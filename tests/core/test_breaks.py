"""Break diagnosis: every reason, and spans that show a shape but never the text."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.breaks import REASONS, Break, _BodyMemo, _parse, _reasoning_scan, span_of
from proxy.core.policy import Policy
from tests.core.factories import (
    READ,
    SEARCH,
    TOOLS,
    WEATHER,
    DictStore,
    Session,
    assistant,
    call,
    make_chat,
    result,
    system,
    user,
)

SYSTEM = "You are a coding agent.\nCurrent time: 2026-11-03T10:00:00Z.\nWork in /repo."


def brk(session: Session, *messages: dict[str, Any], tools: Any = None) -> Break | None:
    return session.look(make_chat(*messages, tools=tools)).brk


@pytest.fixture
def talked(session: Session) -> Session:
    """A session with three stored turns: system, u1, a1, u2, a2, u3, a3 (replies generated)."""
    history: list[dict[str, Any]] = [system(SYSTEM)]
    for i in (1, 2, 3):
        history.append(user(f"question {i}"))
        session.turn(make_chat(*history, tools=TOOLS), assistant(f"answer {i}"))
        history.append(assistant(f"answer {i}"))
    return session


def history(n: int = 3) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [system(SYSTEM)]
    for i in range(1, n + 1):
        out += [user(f"question {i}"), assistant(f"answer {i}")]
    return out


def test_reasons_are_bounded() -> None:
    assert len(set(REASONS)) == len(REASONS) == 10


def test_no_break_when_everything_is_stored(talked: Session) -> None:
    assert brk(talked, *history(3), tools=TOOLS) is None


def test_new_branch_on_an_empty_store(session: Session) -> None:
    assert brk(session, user("hi")) == Break(reason="new_branch", depth=0)


def test_new_branch_for_the_next_turn(talked: Session) -> None:
    assert brk(talked, *history(3), user("question 4"), tools=TOOLS) == Break(reason="new_branch", depth=8)


def test_new_task_under_a_shared_system_prompt_is_a_new_branch(talked: Session) -> None:
    assert brk(talked, system(SYSTEM), user("a different task"), tools=TOOLS) == Break(
        reason="new_branch", depth=2
    )


def test_edited_last_prompt_is_a_new_branch_but_edited_history_is_not(talked: Session) -> None:
    msgs = history(2)
    assert brk(talked, *msgs, user("question 3, rephrased"), tools=TOOLS) == Break(
        reason="new_branch", depth=6
    )
    msgs[3] = user("question 2, rephrased")
    b = brk(talked, *msgs, user("question 3"), tools=TOOLS)
    assert b is not None and (b.reason, b.depth) == ("content_changed", 4)


def test_new_branch_for_another_tenant(talked: Session) -> None:
    other = Session(store=talked.store, credential="sk-mallory")
    b = brk(other, *history(3), tools=TOOLS)
    assert b is not None and b.reason == "new_branch"


def test_text_change_is_content_changed_with_a_span(talked: Session) -> None:
    msgs = history(3)
    msgs[3] = user("question two")
    b = brk(talked, *msgs, tools=TOOLS)
    assert b is not None and (b.reason, b.depth) == ("content_changed", 4)
    assert b.span is not None
    assert (b.span.offset, b.span.length) == (9, 3)
    assert b.span.shape == "aaa"


def test_extra_context_added_to_a_user_turn(talked: Session) -> None:
    msgs = history(3)
    msgs[5] = {
        "role": "user",
        "content": [
            {"type": "text", "text": "[Mon 10:01] calendar: standup at 11"},
            {"type": "text", "text": "question 3"},
        ],
    }
    b = brk(talked, *msgs, tools=TOOLS)
    assert b is not None and (b.reason, b.depth) == ("content_changed", 6)
    assert b.span is not None and b.span.offset == 0


def test_system_timestamp_changed(talked: Session) -> None:
    msgs = history(3)
    msgs[0] = system(SYSTEM.replace("10:00:00Z", "10:05:13Z"))
    b = brk(talked, *msgs, tools=TOOLS)
    assert b is not None and (b.reason, b.depth) == ("system_changed", 1)
    span = b.span
    assert span is not None
    assert span.shape == "dddd-dd-ddTdd:dd:ddZ"
    assert span.hint == r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"
    client = msgs[0]["content"]
    assert client[span.offset : span.offset + span.length] == "2026-11-03T10:05:13Z"
    assert re.fullmatch(span.hint, "2026-11-03T10:05:13Z")


def test_developer_message_folded_into_system(talked: Session) -> None:
    msgs = history(3)
    msgs[0] = system(SYSTEM + "\nAlways answer in French.")
    b = brk(talked, *msgs, tools=TOOLS)
    assert b is not None and b.reason == "system_changed"


def test_tool_set_changed(talked: Session) -> None:
    b = brk(talked, *history(3), tools=[WEATHER, SEARCH])
    assert b is not None and (b.reason, b.depth) == ("tools_changed", 0)
    assert b.span is not None


def test_tool_description_timestamp_changed(talked: Session) -> None:
    dated = {
        **READ,
        "function": {**READ["function"], "description": "Read a file. Session sess_9f3a2c."},
    }
    talked.turn(make_chat(user("x"), tools=[WEATHER, SEARCH, dated]), assistant("y"))
    redated = {
        **READ,
        "function": {**READ["function"], "description": "Read a file. Session sess_71bb0e."},
    }
    b = brk(talked, user("x"), tools=[WEATHER, SEARCH, redated])
    assert b is not None and b.reason == "tools_changed"
    assert b.span is not None
    assert (b.span.shape, b.span.hint) == ("aaaa_ddaada", "[A-Za-z]{4}_[0-9A-Za-z]{6}")


def test_reasoning_dropped_from_the_echo(session: Session) -> None:
    session.turn(
        make_chat(user("why?")), assistant("Because.", reasoning_content="Let me think about it.")
    )
    b = brk(session, user("why?"), assistant("Because."), user("ok"))
    assert b == Break(reason="reasoning_changed", depth=2)


def test_reasoning_added(session: Session) -> None:
    session.turn(make_chat(user("why?")), assistant("Because."))
    b = brk(
        session, user("why?"), assistant("Because.", reasoning="re-rendered thinking"), user("ok")
    )
    assert b is not None and b.reason == "reasoning_changed"


def test_generated_reply_changed_by_a_plugin(talked: Session) -> None:
    msgs = history(3)
    msgs[4] = assistant("answer 2 [INTERRUPTED]")
    b = brk(talked, *msgs, tools=TOOLS)
    assert b == Break(reason="assistant_modified", depth=5)


@pytest.mark.parametrize(
    ("generated", "echoed"),
    [
        pytest.param('{"n":1}', '{"n":1.0}', id="int-vs-float"),
        pytest.param('{"id":123456789012345678901}', '{"id":123456789012345678902}', id="bigint"),
        pytest.param('{"a":1,"a":2}', '{"a":2}', id="duplicate-keys"),
    ],
)
def test_semantic_argument_drift_on_a_generated_reply(
    session: Session, generated: str, echoed: str
) -> None:
    session.turn(make_chat(user("go")), assistant(None, call("c1", "f", generated)))
    t = session.look(
        make_chat(user("go"), assistant(None, call("c1", "f", echoed)), result("c1", "ok"))
    )
    assert t.brk == Break(reason="assistant_modified", depth=2)
    assert t.plan.body is None, "never rewritten"


def test_semantic_argument_drift_on_a_client_message(session: Session) -> None:
    # A history the client wrote itself (e.g. loaded from disk): not a generated reply.
    session.turn(
        make_chat(user("go"), assistant(None, call("c1", "f", '{"n":1}')), result("c1", "ok")),
        assistant("done"),
    )
    t = session.look(
        make_chat(user("go"), assistant(None, call("c1", "f", '{"n":1.0}')), result("c1", "ok"))
    )
    assert t.brk is not None and t.brk.reason == "content_changed" and t.brk.depth == 2
    assert t.brk.span is not None


def test_tool_call_ids_regenerated(session: Session) -> None:
    session.turn(
        make_chat(user("go")), assistant(None, call("functions.search:0", "search", {"query": "x"}))
    )
    t = session.look(
        make_chat(
            user("go"),
            assistant(None, call("functions_search_0_ab12cd", "search", {"query": "x"})),
            result("functions_search_0_ab12cd", "r"),
        )
    )
    assert t.brk == Break(reason="assistant_modified", depth=2)


def test_tool_result_rewritten_by_a_hook(session: Session) -> None:
    msgs = [
        user("go"),
        assistant(None, call("c1", "read_file", {"path": "a.py"})),
        result("c1", "x = 1\n" * 20),
    ]
    session.turn(make_chat(*msgs), assistant("read it"))
    pruned = [*msgs[:2], result("c1", "[pruned]"), assistant("read it"), user("next")]
    b = brk(session, *pruned)
    assert b is not None and (b.reason, b.depth) == ("content_changed", 3)


def test_prompt_appended_twice(talked: Session) -> None:
    msgs = history(3)
    b = brk(talked, *msgs[:6], user("question 3"), *msgs[6:], tools=TOOLS)
    assert b == Break(reason="duplicate_replay", depth=7)


def test_message_removed(talked: Session) -> None:
    msgs = history(3)
    del msgs[3]  # u2 dropped: the request goes on with the stored grandchild a2
    b = brk(talked, *msgs, tools=TOOLS)
    assert b == Break(reason="message_removed", depth=4)


def test_message_inserted(talked: Session) -> None:
    msgs = history(3)
    msgs.insert(3, user("by the way, use metric units"))
    b = brk(talked, *msgs, tools=TOOLS)
    assert b == Break(reason="message_inserted", depth=4)


@pytest.mark.parametrize("dropped_turns", [1, 2])
def test_history_pruned_after_the_system_prompt(talked: Session, dropped_turns: int) -> None:
    msgs = history(3)
    # the oldest turns dropped to fit the window, the system prompt kept
    pruned = [msgs[0], *msgs[1 + 2 * dropped_turns :]]
    assert brk(talked, *pruned, tools=TOOLS) == Break(reason="message_removed", depth=2)


@pytest.mark.parametrize("dropped", [1, 3])
def test_truncated_head(talked: Session, dropped: int) -> None:
    msgs = history(3)
    # the head summarised away, system prompt included: the request starts inside the chain
    assert brk(talked, *msgs[dropped:], tools=TOOLS) == Break(reason="truncated_head", depth=1)


def test_a_message_found_in_another_chain_is_not_removed(talked: Session) -> None:
    other = [system("another agent"), user("a"), assistant("b"), user("c"), assistant("d")]
    talked.turn(make_chat(*other, user("elsewhere"), tools=TOOLS), assistant("x"))
    b = brk(talked, *history(1), user("elsewhere"), assistant("x"), user("?"), tools=TOOLS)
    assert b is not None and (b.reason, b.depth) == ("content_changed", 4)


def test_new_role_without_a_stored_peer_is_a_new_branch(session: Session) -> None:
    session.turn(make_chat(user("go")), assistant("partial answ"), partial=True)
    # the client dropped the interrupted reply and asked again differently
    b = brk(session, user("go"), user("go on please"))
    assert b == Break(reason="new_branch", depth=2)


def test_observe_mode_diagnoses_too(store: DictStore) -> None:
    Session(store=store).turn(make_chat(user("a")), assistant("b"))
    observer = Session(store=store, policy=Policy(repair=False))
    assert observer.look(make_chat(user("a"), assistant("b!"))).brk == Break(
        reason="assistant_modified", depth=2
    )


# -- spans -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "client", "shape", "hint"),
    [
        (
            "at 2026-11-03T10:00:00Z.",
            "at 2026-11-03T10:05:13Z.",
            "dddd-dd-ddTdd:dd:ddZ",
            r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z",
        ),
        (
            "cwd: /home/ann/proj\n",
            "cwd: /home/bob/proj\n",
            "/aaaa/aaa/aaaa",
            "/[A-Za-z]{4}/[A-Za-z]{3}/[A-Za-z]{4}",
        ),
        ("id=4f2a9c end", "id=77be01 end", "ddaadd", "[0-9A-Za-z]{6}"),
        ("at 10:05 ok", "at 10:5 ok", "dd:d", r"\d{2}:\d"),
        ("v1.2.3 ok", "v1.2.4 ok", "ad.d.d", r"[0-9A-Za-z]{2}\.\d\.\d"),
        ("Mon 10:01 hi", "Tue 10:01 hi", "aaa", "[A-Za-z]{3}"),
    ],
)
def test_span_shapes_and_hints(stored: str, client: str, shape: str, hint: str) -> None:
    span = span_of(client, stored, 1)
    assert span is not None
    assert (span.shape, span.hint) == (shape, hint)
    region = client[span.offset : span.offset + span.length]
    assert re.fullmatch(span.hint, region)


def test_span_of_a_deletion_has_no_length() -> None:
    span = span_of("hello world", "hello big world", 1)
    assert span is not None and span.length == 0 and span.offset == 6 and span.hint == ""


def test_long_spans_are_cut_and_get_no_hint() -> None:
    span = span_of("x" * 500, "", 2)
    assert span is not None and span.length == 500
    assert len(span.shape) <= 65 and span.hint == ""
    assert set(span.shape) <= {"a", "…"}


def test_span_never_reveals_the_text() -> None:
    secret = "token sk-live-8fJ2kQ secret"
    span = span_of(secret, "token sk-live-0000aa secret", 1)
    assert span is not None
    assert not any(c.isalnum() and c not in "adTZ" for c in span.shape)
    assert "sk" not in span.shape and "live" not in span.hint


def _naive_prefix(a: str, b: str) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


_texts = st.text(alphabet=st.sampled_from(["a", "b", "é", "\U0001f600", " "]), max_size=400)


@settings(max_examples=300, deadline=None)
@given(shared=_texts, a=_texts, b=_texts, tail=_texts, cut=st.integers(0, 400))
def test_common_prefix_and_suffix_are_exact(shared: str, a: str, b: str, tail: str, cut: int) -> None:
    """The galloping searches give the exact lengths (of texts that share long runs, as a
    re-sent system prompt does with its stored siblings)."""
    from proxy.core.breaks import _common_prefix, _common_suffix

    x, y = shared + a + tail, shared + b + tail
    assert _common_prefix(x, y) == _naive_prefix(x, y)
    limit = min(cut, len(x), len(y))
    assert _common_suffix(x, y, limit) == min(limit, _naive_prefix(x[::-1], y[::-1]))


@settings(max_examples=200, deadline=None)
@given(template=_texts, client=_texts, variants=st.lists(st.tuples(_texts, _texts), min_size=1, max_size=8))
def test_the_closest_sibling_is_the_most_similar(template: str, client: str, variants: list[tuple[str, str]]) -> None:
    """Siblings from one template: the one chosen shares the most of its start and end with the
    client's text (the first of equals)."""
    from proxy.core.breaks import _closest
    from proxy.core.model import Node

    def similarity(x: str, y: str) -> int:
        p = _naive_prefix(x, y)
        return p + min(min(len(x), len(y)) - p, _naive_prefix(x[::-1], y[::-1]))

    msg = {"role": "system", "content": template + client + template}
    siblings = [{"role": "system", "content": template + mid + template + end} for mid, end in variants]
    siblings = [c for c in siblings if c["content"] != msg["content"]]
    if not siblings:
        return
    scores = [similarity(msg["content"], c["content"]) for c in siblings]
    node = Node(key=b"k", parent=b"p", tenant=b"t", depth=1, role="system", identity=b"i", body=b"{}")
    assert _closest(msg, [(node, c) for c in siblings]) is siblings[scores.index(max(scores))]


_PIECES = [b'{"role":"assistant","content":"x"', b',"reasoning_content":"y"', b',"thinking":1', b'"\\u0041"',
           b',"thought_signature":"s"', b',"encrypted_content":"e"', b"\\n", b"}", b"reason", b'"think']


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(_PIECES), max_size=6), st.booleans()), min_size=1, max_size=40),
       st.integers(0, 200))
def test_the_reasoning_scan_memo_answers_as_the_scan_within_its_budget(calls: list[tuple[list[bytes], bool]], budget: int) -> None:
    """Bodies equal in content or the very same object, scanned again or not: the memo's answer
    is the scan's, and the bodies it keeps alive stay within its byte budget."""
    memo = _BodyMemo(_reasoning_scan, budget)
    seen: list[bytes] = []
    for pieces, again in calls:
        body = seen[len(pieces) % len(seen)] if again and seen else bytes(bytearray(b"".join(pieces)))
        seen.append(body)
        assert memo(body) is _reasoning_scan(body)
        assert memo._bytes == sum(len(b) for b in memo._known) <= budget


_TEXT = st.characters(exclude_categories=("Cs",))  # JSON text: no lone surrogates
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(_TEXT, max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(_TEXT, max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_JSON | st.binary(max_size=12), st.booleans()), min_size=1, max_size=40), st.integers(0, 400))
def test_the_parsed_body_memo_answers_as_the_parser_within_its_budget(calls: list[tuple[Any, bool]], budget: int) -> None:
    """A stored sibling parsed once is handed out again while it stays within the byte budget;
    a body that is not JSON (a damaged entry) parses to None, as before."""
    memo = _BodyMemo(_parse, budget)
    seen: list[bytes] = []
    for value, again in calls:
        if again and seen:
            body = seen[len(seen) // 2]
        else:
            body = value if isinstance(value, bytes) else orjson.dumps(value)
        seen.append(body)
        kept = body in memo._known
        before = memo._known.get(body)
        got = memo(body)
        assert got == _parse(body)
        if kept:
            assert got is before  # the very object: not parsed again
        assert memo._bytes == sum(len(b) for b in memo._known) <= budget
