"""The Messages view and its repairs, pure: what is the same message, and what a repair writes.

Identity rules of docs/ARCHITECTURE.md ("Identity"), for Anthropic's content blocks: a string and
one text block, ``system`` as a string or one block, edge whitespace, tool order and
``input_schema`` key order, ``tool_use.input`` compared as the JSON its text says (``1`` is not
``1.0``, a 30-digit integer is not its double, a repeated key is not its last value), a
tool-result group's order, ``cache_control`` anywhere: the same. Thinking blocks: byte for byte.
A repair is written into the client's bytes: only the restored values change, and the markers
stay where the client put them.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from proxy.core.guard import STRICT
from proxy.core.identity import REASONING_KEYS, IdentityMemo, message_identity, tools_identity
from proxy.core.match import tenant_root
from proxy.core.plan import TurnPlan, turn_write
from proxy.core.policy import Policy
from proxy.core.splice import Reorder, Replace
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.wire.json_spans import compact_json
from proxy.wire.messages import MessagesWire
from proxy.wire.messages_edits import message_edits
from proxy.wire.messages_view import messages_view, tool_input_texts

WIRE = MessagesWire()
MARK = {"type": "ephemeral"}
TOOLS = [
    {"name": "read_file", "description": "Read.", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
    {"name": "search", "description": "Search.", "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}},
]


def view_ids(body: dict[str, Any], raw: bytes | None = None) -> list[bytes]:
    raw = raw if raw is not None else orjson.dumps(body)
    view = messages_view(body.get("system"), body["messages"], tool_input_texts(raw, body))
    return [message_identity(m) for m in view.messages]


def use(inputs: str = '{"path":"a.py","start":1}', *more: str) -> dict[str, Any]:
    blocks = [{"type": "tool_use", "id": f"toolu_{k}", "name": "read_file", "input": orjson.loads(text)}
              for k, text in enumerate((inputs, *more))]
    return {"role": "assistant", "content": [{"type": "text", "text": "Reading."}, *blocks]}


def results(*texts: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": t}
                                        for k, t in enumerate(texts)]}


def body_of(*messages: dict[str, Any], system: Any = "Be brief.", tools: Any = TOOLS) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10, "system": system, "tools": tools, "messages": list(messages)}


# -- identity -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"role": "user", "content": "Hi there"}, {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}),
        ({"role": "user", "content": "Hi there"},
         {"role": "user", "content": [{"type": "text", "text": "Hi there", "cache_control": MARK}]}),
        ({"role": "user", "content": "Hi there"}, {"role": "user", "content": "  Hi there\n"}),
        ({"role": "assistant", "content": "Done."}, {"role": "assistant", "content": [{"type": "text", "text": "Done.", "citations": None}]}),
        (results("ok"), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": [{"type": "text", "text": "ok"}]}]}),
        (results("ok"), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "ok", "is_error": False}]}),
        (use('{"path":"a.py","start":1}'), use('{"start":1,"path":"a.py"}')),
        (use(), {**use(), "content": [{**b, "cache_control": MARK} for b in use()["content"]]}),
    ],
    ids=["string-block", "marker", "edge-space", "none-fields", "result-block", "is_error-false", "input-key-order", "markers-moved"],
)
def test_safe_drift_is_the_same_message(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert view_ids(body_of(a)) == view_ids(body_of(b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (use('{"path":"a.py","start":1}'), use('{"path":"a.py","start":1.0}')),
        (use('{"path":"a.py","start":1}'), use('{"path":"b.py","start":1}')),
        (results("ok"), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "ok", "is_error": True}]}),
        ({"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}, {"type": "text", "text": "A"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "A"}]}),
        ({"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}, {"type": "text", "text": "A"}]},
         {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "c2lo"}, {"type": "text", "text": "A"}]}),
        ({"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}, {"type": "text", "text": "A"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}]}),
    ],
    ids=["1-vs-1.0", "value", "is_error", "thinking-dropped", "signature", "block-order"],
)
def test_semantic_change_is_another_message(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert view_ids(body_of(a))[1] != view_ids(body_of(b))[1]


def test_inputs_compare_as_their_text() -> None:
    def ids(text: bytes) -> list[bytes]:
        raw = (b'{"model":"m","max_tokens":1,"messages":[{"role":"assistant","content":[{"type":"tool_use",'
               b'"id":"t","name":"f","input":' + text + b"}]}]}")
        return view_ids(orjson.loads(raw), raw)

    big = b"123456789012345678901234567890"
    assert ids(b'{"n":' + big + b"}") != ids(b'{"n":' + big[:-1] + b"1}")  # the same double
    assert ids(b'{"n":1,"n":2}') != ids(b'{"n":2}')  # orjson keeps the last
    assert ids(b'{"a": 1, "b": "\\u00e9"}') == ids('{"b":"é","a":1}'.encode())


def test_system_as_a_string_or_one_block_and_tool_order_are_formatting() -> None:
    message = {"role": "user", "content": "Hi"}
    assert view_ids(body_of(message, system="Be brief.")) == view_ids(body_of(message, system=[{"type": "text", "text": "Be brief.", "cache_control": MARK}]))
    schema_reversed = [{**t, "input_schema": dict(reversed(t["input_schema"].items()))} for t in TOOLS]
    assert tools_identity(TOOLS) == tools_identity(TOOLS[::-1]) == tools_identity(schema_reversed)


def test_compact_json_keeps_order_numbers_and_repeats() -> None:
    assert compact_json(b'{ "b" : [1, 2.50 ,{"c":null}], "a":"\\u00e9\\n" }') == '{"b":[1,2.50,{"c":null}],"a":"é\\n"}'
    assert compact_json(b'{"a":1,"a":2}') == '{"a":1,"a":2}'
    assert compact_json(b'{"cut": "hal') == '{"cut": "hal'  # no JSON: as it is


# -- repairs, written into the client's bytes -----------------------------------------------------


class Planner:
    """Plans Messages bodies against a store, records each turn with its reply."""

    def __init__(self) -> None:
        self.store = LocalStore(MemoryStore(3600, 1 << 30, secret=b"s" * 32))
        self.memo = IdentityMemo()
        self.root = tenant_root(b"s" * 32, "Bearer sk")

    def plan(self, body: dict[str, Any], raw: bytes | None = None) -> TurnPlan:
        raw = raw if raw is not None else orjson.dumps(body)
        return WIRE.plan(raw, orjson.loads(raw), self.root, self.store.view(self.root), Policy(), self.memo, STRICT)

    def record(self, plan: TurnPlan) -> None:
        turn = turn_write(plan, None, None, None, model="m", client_gone=False, now=1.0)
        assert turn is not None
        self.store.write_turn_now(turn)


def test_tools_are_restored_with_the_markers_where_the_client_put_them() -> None:
    planner = Planner()
    first = body_of({"role": "user", "content": "Hi"}, tools=[*TOOLS[:-1], {**TOOLS[-1], "cache_control": MARK}])
    planner.record(planner.plan(first))
    # Reordered, the marker on the client's last tool (another one now).
    drifted = body_of({"role": "user", "content": "Hi"}, tools=[TOOLS[1], {**TOOLS[0], "cache_control": MARK}])
    plan = planner.plan(drifted)
    assert plan.spliced is not None
    sent = orjson.loads(plan.spliced)
    assert sent["tools"] == first["tools"]  # the stored order, the marker still on the last tool
    assert {k: v for k, v in sent.items() if k != "tools"} == {k: v for k, v in drifted.items() if k != "tools"}


def test_a_result_group_moves_whole_and_keeps_its_markers_in_place() -> None:
    planner = Planner()
    history = [{"role": "user", "content": "Go"}, use('{"path":"a.py"}', '{"path":"b.py"}'), results("A", "B")]
    planner.record(planner.plan(body_of(*history)))
    # Reordered, without markers: the blocks move as the client's bytes.
    swapped = copy.deepcopy(history)
    swapped[2]["content"].reverse()
    plan = planner.plan(body_of(*swapped, {"role": "user", "content": "Next"}))
    assert plan.spliced is not None and plan.repair.repairs[0].kind == "tool_results_order"
    assert orjson.loads(plan.spliced)["messages"][2] == history[2]
    # Reordered, the client's marker on its last block: restored, the marker still last.
    marked = copy.deepcopy(swapped)
    marked[2]["content"][-1]["cache_control"] = MARK
    plan = planner.plan(body_of(*marked, {"role": "user", "content": "Next"}))
    assert plan.spliced is not None
    blocks = orjson.loads(plan.spliced)["messages"][2]["content"]
    assert [b["content"] for b in blocks] == ["A", "B"]
    assert [("cache_control" in b) for b in blocks] == [False, True]


def test_input_key_order_is_restored_to_the_bytes_first_seen() -> None:
    planner = Planner()
    history = [{"role": "user", "content": "Go"}, use('{"path":"a.py","start":1}'), results("A")]
    planner.record(planner.plan(body_of(*history)))
    drifted = copy.deepcopy(history)
    drifted[1]["content"][1]["input"] = {"start": 1, "path": "a.py"}
    raw = orjson.dumps(body_of(*drifted))
    plan = planner.plan(body_of(*drifted), raw)
    assert plan.spliced is not None and [r.kind for r in plan.repair.repairs] == ["arguments"]
    assert plan.spliced == raw.replace(b'{"start":1,"path":"a.py"}', b'{"path":"a.py","start":1}')


def test_a_view_message_moved_out_of_its_message_has_no_place() -> None:
    body = body_of({"role": "user", "content": "Go"}, use(), results("A", "B"), results("C"))
    view = messages_view(body["system"], body["messages"], {})
    # view: system, user, assistant, tools A and B (message 2), tool C (message 3).
    assert message_edits(body, view, [Reorder(path=("messages",), order=(0, 1, 2, 3, 5, 4))]) is None
    assert message_edits(body, view, [Reorder(path=("messages",), order=(1, 0, 2, 3, 4, 5))]) is None  # the system moved
    # Whole messages move (a group of one-result messages), a message's blocks among themselves.
    assert message_edits(body, view, [Reorder(path=("messages",), order=(0, 1, 2, 5, 3, 4))]) == [
        Reorder(path=("messages",), order=(0, 1, 3, 2))
    ]
    assert message_edits(body, view, [Reorder(path=("messages",), order=(0, 1, 2, 4, 3, 5))]) == [
        Reorder(path=("messages", 2, "content"), order=(1, 0))
    ]
    edits = message_edits(body, view, [Replace(path=("messages", 0, "content"), value=b'"Be brief"')])
    assert edits == [Replace(path=("system",), value=b'"Be brief"')]


def test_interleaved_thinking_dropped_is_a_reasoning_change_only() -> None:
    """Thinking between a text and a tool use renders there; without its thinking blocks the message
    is the same but for its reasoning, whatever their places were."""
    def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in message.items() if k not in REASONING_KEYS}

    think = {"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}
    text, call = {"type": "text", "text": "Let me look."}, use()["content"][1]
    first = messages_view(None, [{"role": "assistant", "content": [think, text, think, call]}], {}).messages[0]
    moved = messages_view(None, [{"role": "assistant", "content": [think, think, text, call]}], {}).messages[0]
    dropped = messages_view(None, [{"role": "assistant", "content": [text, call]}], {}).messages[0]
    assert message_identity(first) != message_identity(moved)
    assert message_identity(_without_reasoning(first)) == message_identity(dropped) == message_identity(_without_reasoning(moved))
    after = messages_view(None, [{"role": "assistant", "content": [call, text]}], {}).messages[0]
    assert message_identity(after) != message_identity(dropped)  # text after the tool use renders after it
