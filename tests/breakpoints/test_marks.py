"""Markers in the outgoing bytes (proxy/wire/cache_marks.py), and markers as no meaning
(proxy/core/identity.py): pure, with the production planner and the wire front-ends.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.breakpoints import CACHE_CONTROL, OPENAI, Marks, tree_facts
from proxy.core.identity import message_identity
from proxy.core.plan import TurnPlan, plan_turn
from proxy.core.policy import Policy
from proxy.transport.traits import UpstreamTraits
from proxy.wire.cache_marks import with_breakpoints
from proxy.wire.chat import ChatWire
from proxy.wire.responses import ResponsesWire
from tests.core.factories import TOOLS, Session, assistant, call, make_chat, result, system, user

STABLE_TEXT = "You are a careful agent. " * 200
STABLE = system(STABLE_TEXT)
CC = {"type": "ephemeral"}
BP = {"mode": "explicit"}


def traits(rule: str) -> UpstreamTraits:
    return UpstreamTraits(cache_breakpoints=rule)


def chat_out(s: Session, body: dict[str, Any], rule: str, raw: bytes | None = None) -> tuple[bytes, Marks | None]:
    raw = orjson.dumps(body) if raw is None else raw
    plan = plan_turn(body, s.root, s.store, s.policy, raw=raw)
    assert plan.match is not None
    plan = plan.with_tree(tree_facts(plan.match, s.store))
    out = ChatWire().outgoing(raw, body, plan, traits(rule))
    return out.body, out.marks


def shared(s: Session, n: int = 1, *, tools: bool = False) -> None:
    for i in range(n):
        s.turn(make_chat(STABLE, user(f"Task {i}."), tools=TOOLS if tools else None), assistant(f"Done {i}."))


def test_a_string_becomes_one_text_part_carrying_the_marker() -> None:
    s = Session()
    shared(s)
    body = make_chat(STABLE, user("Task 9."))
    sent, marks = chat_out(s, body, OPENAI)
    assert marks is not None and [m.kind for m in marks.placed] == ["stem"]
    out = orjson.loads(sent)
    assert out["messages"][0]["content"] == [{"type": "text", "text": STABLE_TEXT, "prompt_cache_breakpoint": BP}]
    out["messages"][0]["content"] = STABLE_TEXT
    assert out == body  # nothing else changed


def test_a_part_list_gets_the_marker_on_its_last_part() -> None:
    s = Session()
    parts = [{"type": "text", "text": STABLE_TEXT}, {"type": "text", "text": "Be brief."}]
    s.turn(make_chat(system(parts), user("Task 0."), tools=TOOLS), assistant("ok"))
    body = make_chat(system(parts), user("Task 9."), tools=TOOLS)
    sent, _ = chat_out(s, body, CACHE_CONTROL)
    out = orjson.loads(sent)
    assert out["messages"][0]["content"][1] == {"cache_control": CC, "type": "text", "text": "Be brief."}
    assert out["messages"][0]["content"][0] == parts[0]
    # Its sibling ended after one reply: no continuation marker on this single-shot task.
    assert out["messages"][1]["content"] == "Task 9."


def test_the_clients_own_markers_arrive_byte_identical() -> None:
    s = Session()
    shared(s, tools=True)
    marked = user([{"type": "text", "text": "Task 9.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
    body = make_chat(STABLE, marked, tools=TOOLS)
    raw = orjson.dumps(body)
    sent, marks = chat_out(s, body, CACHE_CONTROL, raw)
    assert marks is not None and marks.client == 1
    assert [m.kind for m in marks.placed] == ["stem"]  # its last block is the client's
    clients = b'{"type":"text","text":"Task 9.","cache_control":{"type":"ephemeral","ttl":"1h"}}'
    assert clients in raw and clients in sent


def test_a_client_with_four_markers_gets_none() -> None:
    s = Session()
    shared(s, tools=True)
    four = [{"type": "text", "text": f"Part {i}.", "cache_control": CC} for i in range(4)]
    body = make_chat(STABLE, user(four), tools=TOOLS)
    raw = orjson.dumps(body)
    sent, marks = chat_out(s, body, CACHE_CONTROL, raw)
    assert sent == raw
    assert marks is not None and marks.placed == () and marks.client == 4


def test_a_refused_splice_adds_nothing() -> None:
    """A duplicate key on the marker's path: the client's bytes go unchanged, and it is said why."""
    s = Session()
    shared(s)
    body = make_chat(STABLE, user("Task 9."))
    raw = orjson.dumps(body).replace(b'"role":"system"', b'"role":"system","role":"system"', 1)
    sent, marks = chat_out(s, body, OPENAI, raw)
    assert sent == raw
    assert marks is not None and marks.refused == "duplicate_key" and marks.placed == ()


def test_no_markers_when_the_upstream_takes_none() -> None:
    s = Session()
    shared(s)
    body = make_chat(STABLE, user("Task 9."))
    raw = orjson.dumps(body)
    assert chat_out(s, body, "off", raw) == (raw, None)
    assert chat_out(s, body, "auto:openai", raw) == (raw, None)  # gpt-test is no GPT-5.6


def test_responses_items_carry_the_markers() -> None:
    s = Session()
    wire = ResponsesWire()
    developer = {"type": "message", "role": "developer", "content": STABLE_TEXT}
    first = {"model": "m", "instructions": "Be careful.", "input": [developer, {"role": "user", "content": "Task 0."}]}
    call_item = {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path":"a.py"}'}
    raw = orjson.dumps(first)
    plan = wire.plan(raw, first, s.root, s.store, Policy(), None, _strict())
    from proxy.core.plan import turn_write
    from proxy.core.record import Reply

    write = turn_write(plan, Reply(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py"}'}}]},
        finish_reason=None, partial=False, model=None), None, None, model="m", client_gone=False, now=1.0)
    assert write is not None
    s.store.insert(list(write.nodes))
    output = {"type": "function_call_output", "call_id": "c1", "output": "print(1)"}
    second = {**first, "input": [*first["input"], call_item, output]}
    raw = orjson.dumps(second)
    plan = wire.plan(raw, second, s.root, s.store, Policy(), None, _strict())
    assert plan.match is not None
    plan = plan.with_tree(tree_facts(plan.match, s.store))
    out = wire.outgoing(raw, second, plan, traits(CACHE_CONTROL))
    sent = orjson.loads(out.body)
    assert sent["input"][3] == {"cache_control": CC, **output}  # the continuation, on the item
    # The leading developer message (the instructions string can carry none), written anyway.
    assert sent["input"][0]["content"] == [{"type": "input_text", "text": STABLE_TEXT, "cache_control": CC}]
    assert out.marks is not None and [m.kind for m in out.marks.placed] == ["continuation", "head"]
    sent["input"][3] = output
    sent["input"][0]["content"] = STABLE_TEXT
    assert sent == second


def _strict() -> Any:
    from proxy.core.guard import STRICT

    return STRICT


# -- markers are not meaning -------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("cache_control", CC), ("prompt_cache_breakpoint", BP)])
def test_identity_ignores_markers(key: str, value: dict[str, Any]) -> None:
    plain = user("Hello there.")
    one_part = user([{"type": "text", "text": "Hello there.", key: value}])
    on_message = user("Hello there.", **{key: value})
    assert message_identity(plain) == message_identity(one_part) == message_identity(on_message)
    parts = [{"type": "text", "text": "A"}, {"type": "image_url", "image_url": {"url": "u"}}]
    marked = [parts[0], {**parts[1], key: value}]
    assert message_identity(user(parts)) == message_identity(user(marked))


def test_a_client_moving_its_markers_is_no_drift() -> None:
    """Turn by turn the client moves its marker to its latest message (the static policy): no
    break, no repair back to where it was, and the bytes sent are the client's."""
    s = Session()
    history: list[Any] = [system([{"type": "text", "text": STABLE_TEXT, "prompt_cache_breakpoint": BP}])]
    for turn in range(3):
        latest = user([{"type": "text", "text": f"Step {turn}.", "prompt_cache_breakpoint": BP}])
        body = make_chat(*history, latest)
        t = s.turn(body, assistant(f"Done {turn}."))
        assert t.brk is None or not t.brk.is_break, t.brk
        assert t.plan.repairs == ()
        assert t.match.matched == len(t.match.keys) - 1 if turn else True
        assert t.forwarded == body
        # Next turn the marker has moved on: this message is sent without it.
        history += [user(f"Step {turn}."), assistant(f"Done {turn}.")]


def test_a_repaired_message_keeps_the_markers_the_client_sent() -> None:
    s = Session()
    s.turn(make_chat(STABLE, user("Step 0.")), assistant("Done 0."))
    drifted = {"role": "user", "content": [{"type": "text", "text": "Step 0.  \n", "cache_control": CC}]}
    body = make_chat(STABLE, drifted, assistant("Done 0."), user("Step 1."))
    raw = orjson.dumps(body)
    plan = plan_turn(body, s.root, s.store, s.policy, raw=raw)
    assert [r.kind for r in plan.repair.repairs] == ["whitespace"]
    assert plan.spliced is not None
    sent = orjson.loads(plan.spliced)
    assert sent["messages"][1]["content"] == [{"type": "text", "text": "Step 0.", "cache_control": CC}]


def test_moving_a_tool_marker_is_no_drift() -> None:
    s = Session()
    tools = [dict(t) for t in TOOLS]
    s.turn(make_chat(STABLE, user("Go."), tools=[*tools[:-1], {**tools[-1], "cache_control": CC}]), assistant(None, call("c", "search", {"query": "q"})))
    moved = [{**tools[0], "cache_control": CC}, *tools[1:]]
    body = make_chat(STABLE, user("Go."), assistant(None, call("c", "search", {"query": "q"})), result("c", "r"), tools=moved)
    plan: TurnPlan = plan_turn(body, s.root, s.store, s.policy, raw=orjson.dumps(body))
    assert plan.match is not None and plan.match.matched == 4
    assert plan.repair.repairs == ()


def test_an_error_while_marking_sends_the_bytes_as_they_were() -> None:
    """The error goes to the request's fail-open boundary (the pipeline's ``breakpoints`` stage)
    with the bytes unmarked; the repair, if any, stays."""
    s = Session()
    shared(s)
    body = make_chat(STABLE, user("Task 9."))
    raw = orjson.dumps(body)
    plan = plan_turn(body, s.root, s.store, s.policy, raw=raw)
    assert plan.match is not None
    plan = plan.with_tree(tree_facts(plan.match, s.store))

    def broken(dialect: str) -> Any:
        raise RuntimeError("no elements today")

    sent, marks = with_breakpoints(raw, body, plan, traits(OPENAI), broken)
    assert sent == raw
    assert marks is not None and marks.refused == "error" and isinstance(marks.error, RuntimeError)
