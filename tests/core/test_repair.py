"""Field-level repair: restore token-bearing values of the matched prefix, keep everything else as sent."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.core.policy import Policy
from proxy.core.repair import REPAIR_KINDS, Repair
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


def messages_of(t: Any) -> list[dict[str, Any]]:
    return t.forwarded["messages"]


def test_no_drift_forwards_the_clients_bytes(session: Session) -> None:
    body = make_chat(system("s"), user("hi"), tools=TOOLS)
    session.turn(body, assistant("Hello!\n"))
    t = session.look(
        make_chat(system("s"), user("hi"), assistant("Hello!\n"), user("next"), tools=TOOLS)
    )
    assert t.match.matched == 4
    assert t.plan.body is None and t.plan.repairs == () and t.plan.rescued_tokens == 0


def test_stripped_reply_whitespace_is_restored(session: Session) -> None:
    session.turn(make_chat(user("write code")), assistant("def f():\n    return 1\n"))
    echo = make_chat(user("write code"), assistant("def f():\n    return 1"), user("thanks"))
    t = session.look(echo)
    assert t.plan.repairs == (Repair(depth=2, kind="whitespace"),)
    assert messages_of(t)[1]["content"] == "def f():\n    return 1\n"
    assert messages_of(t)[2] == user("thanks")
    assert t.plan.rescued_tokens == t.match.nodes[2].tokens


def test_repair_keeps_the_clients_other_keys(session: Session) -> None:
    first = {"role": "user", "content": "  hello\n", "x_vendor": {"trace": "abc", "n": 1}}
    session.turn(make_chat(first), assistant("Hi there."))
    echoed = {
        "x_vendor": {"n": 1, "trace": "abc"},
        "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}],
        "name": None,
        "role": "user",
    }
    t = session.look(make_chat(echoed, assistant("Hi there."), user("bye")))
    assert t.match.matched == 3
    fixed = messages_of(t)[0]
    assert list(fixed) == list(echoed), "key order and keys as the client sent them"
    assert list(fixed["x_vendor"]) == ["n", "trace"] and fixed["name"] is None
    assert fixed["content"] == [
        {"type": "text", "text": "  hello\n", "cache_control": {"type": "ephemeral"}}
    ]
    assert t.kinds() == ["whitespace"]


def test_a_reply_echoed_with_an_unknown_key_is_not_the_same_message(session: Session) -> None:
    session.turn(make_chat(user("hello")), assistant("Hi."))
    t = session.look(
        make_chat(user("hello"), assistant("Hi.", x_plugin={"seen": True}), user("bye"))
    )
    assert t.match.matched == 2
    assert t.plan.body is None


def test_string_and_one_part_forms_are_not_rewritten(session: Session) -> None:
    session.turn(
        make_chat({"role": "user", "content": [{"type": "text", "text": "hello"}]}), assistant("hi")
    )
    # same text, other form, no cache_control: nothing to restore, the form does not change tokens
    t = session.look(make_chat(user("hello"), assistant("hi"), user("next")))
    assert t.match.matched == 3
    assert t.plan.body is None


def test_list_with_cache_control_to_string_keeps_the_string(session: Session) -> None:
    first = {
        "role": "user",
        "content": [{"type": "text", "text": "hello\n", "cache_control": {"type": "ephemeral"}}],
    }
    session.turn(make_chat(first), assistant("hi"))
    t = session.look(make_chat(user("hello"), assistant("hi"), user("next")))
    assert messages_of(t)[0] == {"role": "user", "content": "hello\n"}
    assert t.kinds() == ["whitespace"]


def test_arguments_and_call_order_restored_with_client_keys(session: Session) -> None:
    generated = assistant(
        None,
        call("call_1", "get_weather", '{"city":"北京","days":1}'),
        call("call_2", "search", '{"query":"rain","limit":3}'),
    )
    session.turn(make_chat(user("go")), generated)
    echoed = assistant(
        "",
        {
            "index": 1,
            "id": "call_2",
            "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"limit": 3, "query": "rain"})},
        },
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": "北京", "days": 1}),
            },
        },
    )
    t = session.look(
        make_chat(user("go"), echoed, result("call_1", "sunny"), result("call_2", "wet"))
    )
    assert t.match.matched == 3
    assert sorted(t.kinds()) == ["arguments", "tool_calls_order"]
    fixed = messages_of(t)[1]
    assert [c["id"] for c in fixed["tool_calls"]] == ["call_1", "call_2"]
    assert [c["function"]["arguments"] for c in fixed["tool_calls"]] == [
        '{"city":"北京","days":1}',
        '{"query":"rain","limit":3}',
    ]
    assert [c["index"] for c in fixed["tool_calls"]] == [0, 1], "the client's transport keys stay"
    assert fixed["content"] == "", "the client's content form stays"
    assert messages_of(t)[2:] == [result("call_1", "sunny"), result("call_2", "wet")], (
        "past the prefix: as sent"
    )


def test_tools_order_restored(session: Session) -> None:
    session.turn(make_chat(user("hi"), tools=[WEATHER, SEARCH, READ]), assistant("yo"))
    t = session.look(make_chat(user("hi"), tools=[READ, WEATHER, SEARCH]))
    assert t.kinds() == ["tools_order"]
    assert t.forwarded["tools"] == [WEATHER, SEARCH, READ]
    assert t.plan.rescued_tokens == sum(n.tokens for n in t.match.nodes)


def test_tools_schema_key_order_restored_keeping_cache_control(session: Session) -> None:
    session.turn(make_chat(user("hi"), tools=TOOLS), assistant("yo"))
    resorted = [orjson.loads(orjson.dumps(d, option=orjson.OPT_SORT_KEYS)) for d in TOOLS]
    resorted[-1]["cache_control"] = {"type": "ephemeral"}
    t = session.look(make_chat(user("hi"), tools=resorted))
    assert t.kinds() == ["tools_schema"]
    sent = t.forwarded["tools"]
    assert orjson.dumps(sent[:2]) == orjson.dumps(TOOLS[:2])
    assert sent[2] == {**READ, "cache_control": {"type": "ephemeral"}}
    assert list(sent[2])[: len(READ)] == list(READ)


def test_no_tools_never_becomes_an_empty_tools_array(session: Session) -> None:
    session.turn(make_chat(user("hi"), tools=[]), assistant("yo"))
    t = session.look(make_chat(user("hi"), assistant("yo")))
    assert t.plan.body is None
    assert "tools" not in t.forwarded


def test_final_assistant_prefill_never_gains_trailing_whitespace(session: Session) -> None:
    session.turn(make_chat(user("start a poem")), assistant("  Roses are red\n\n"))
    t = session.look(make_chat(user("start a poem"), assistant("Roses are red")))
    assert t.match.complete
    assert messages_of(t)[-1]["content"] == "  Roses are red"
    assert t.kinds() == ["whitespace"]
    # not the final message any more: the full stored text comes back
    t = session.look(make_chat(user("start a poem"), assistant("Roses are red"), user("go on")))
    assert messages_of(t)[1]["content"] == "  Roses are red\n\n"


def test_final_prefill_with_only_trailing_drift_is_left_alone(session: Session) -> None:
    session.turn(make_chat(user("x")), assistant("Sure.\n"))
    t = session.look(make_chat(user("x"), assistant("Sure.")))
    assert t.plan.body is None


def test_nothing_past_the_prefix_is_touched(session: Session) -> None:
    session.turn(make_chat(system("s "), user("a")), assistant("b\n"))
    later = [
        system("s"),
        user("a"),
        assistant("b"),
        user("  c  "),
        assistant("d ", refusal=None),
        user("e\n"),
    ]
    t = session.look(make_chat(*later))
    assert t.match.matched == 4
    assert [r.depth for r in t.plan.repairs] == [1, 3]
    assert orjson.dumps(messages_of(t)[3:]) == orjson.dumps(later[3:])


def test_the_callers_body_is_never_mutated(session: Session) -> None:
    session.turn(make_chat(user("a"), tools=[WEATHER, SEARCH]), assistant("b\n"))
    body = make_chat(user("a"), assistant("b"), user("c"), tools=[SEARCH, WEATHER])
    before = orjson.dumps(body)
    t = session.look(body)
    assert t.plan.body is not None and t.plan.body is not body
    assert orjson.dumps(body) == before
    assert body["messages"][1] is not t.plan.body["messages"][1]


def test_tool_results_order_restored_as_a_group(session: Session) -> None:
    msgs = [
        user("two"),
        assistant(None, call("c1", "search", {"query": "a"}), call("c2", "search", {"query": "b"})),
        result("c1", "A"),
        result("c2", "B"),
    ]
    session.turn(make_chat(*msgs), assistant("done"))
    t = session.look(make_chat(*msgs[:2], msgs[3], msgs[2], assistant("done"), user("next")))
    assert t.kinds() == ["tool_results_order"]
    assert t.plan.repairs[0].depth == 3
    assert [m.get("tool_call_id") for m in messages_of(t)] == [None, None, "c1", "c2", None, None]


def test_pinned_span_restored_to_the_first_seen_value(store: DictStore) -> None:
    policy = Policy.build(True, False, {"system": [r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"]})
    s = Session(store=store, policy=policy)
    s.turn(
        make_chat(system("Now: 2026-11-03T10:00:00Z. Be brief."), user("hi")), assistant("hello")
    )
    t = s.look(
        make_chat(
            system("Now: 2026-11-03T11:42:07Z. Be brief."),
            user("hi"),
            assistant("hello"),
            user("more"),
        )
    )
    assert t.match.matched == 4
    assert t.kinds() == ["pinned"]
    assert messages_of(t)[0]["content"] == "Now: 2026-11-03T10:00:00Z. Be brief."


def test_multi_part_content_texts_restored(session: Session) -> None:
    parts = [
        {"type": "text", "text": "look:\n"},
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
    ]
    session.turn(make_chat({"role": "user", "content": parts}), assistant("a cat"))
    drifted = [
        {"type": "text", "text": "look:", "cache_control": {"type": "ephemeral"}},
        {"image_url": {"url": "https://x/y.png"}, "type": "image_url"},
    ]
    t = session.look(make_chat({"role": "user", "content": drifted}, assistant("a cat"), user("?")))
    assert t.kinds() == ["content_parts"]
    sent = messages_of(t)[0]["content"]
    assert sent[0] == {"type": "text", "text": "look:\n", "cache_control": {"type": "ephemeral"}}
    assert sent[1] is drifted[1] or sent[1] == drifted[1]


def test_observe_mode_never_rewrites(store: DictStore) -> None:
    Session(store=store).turn(make_chat(user("a"), tools=[WEATHER, SEARCH]), assistant("b\n"))
    observer = Session(store=store, policy=Policy(repair=False))
    t = observer.look(make_chat(user("a"), assistant("b"), user("c"), tools=[SEARCH, WEATHER]))
    assert t.match.matched == 3
    assert t.plan.body is None and t.plan.repairs == ()


def test_rescued_tokens_count_from_the_first_repair(session: Session) -> None:
    msgs = [system("sys"), user("one"), assistant("two\n"), user("three"), assistant("four")]
    session.turn(make_chat(*msgs[:2]), msgs[2])
    session.turn(make_chat(*msgs[:4]), msgs[4])
    t = session.look(make_chat(*msgs[:2], assistant("two"), *msgs[3:], user("five")))
    assert t.plan.repairs == (Repair(depth=3, kind="whitespace"),)
    assert t.plan.rescued_tokens == sum(n.tokens for n in t.match.nodes[3:])


def test_every_kind_is_declared() -> None:
    assert len(set(REPAIR_KINDS)) == len(REPAIR_KINDS) == 9


@pytest.mark.parametrize("drift", ["refusal", "annotations"])
def test_empty_field_drift_alone_needs_no_repair(session: Session, drift: str) -> None:
    session.turn(make_chat(user("a")), {"role": "assistant", "content": "b", drift: None})
    t = session.look(make_chat(user("a"), assistant("b"), user("c")))
    assert t.match.matched == 3
    assert t.plan.body is None
