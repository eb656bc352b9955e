"""Messages API: the tail-only path plans exactly what the full path plans, on every drift class.

The Messages twin of ``test_responses_tail_plan.py``. Two planners see the same ``/v1/messages``
bytes, turn after turn:

* **tail**: what the request path does -- :meth:`PrefixMemo.recall` on the ``messages`` array,
  the view taken over from the previous body's view where its messages are shared
  (:func:`~proxy.wire.messages_view.continued_view`, the tool inputs of the new messages read from
  the bytes after the shared ones), the match from where the previous one left off, then
  :meth:`PrefixMemo.remember_plan`;
* **full**: ``orjson.loads`` of the whole body, the view made whole, an identity memo of its own.

Whatever the drift (every safe class, and semantic edits), the serializer (compact, spaced with
``\\u`` escapes, indented) and the turn's shape (going on, its last turn changed, the same bytes
again), the two plans must be equal in everything the request path uses, and the tail path must
really have been taken, the previous view's messages taken over.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from proxy.core.guard import STRICT
from proxy.core.match import tenant_root
from proxy.core.plan import TurnPlan, turn_write
from proxy.core.policy import Policy
from proxy.wire.messages import MessagesObserver, MessagesWire
from tests.messages.agents import SAFE_DRIFTS, SYSTEM, TOOLS, Drift, Messages, Tools
from tests.perf.test_tail_plan import ViewPlanner, same_plan

WIRE = MessagesWire()


def text_edited(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """The first tool result rewritten (a client that trims old tool results)."""
    for message in messages:
        for block in message["content"] if isinstance(message["content"], list) else ():
            if block.get("type") == "tool_result":
                block["content"] = f"(trimmed at turn {turn})"
                return messages, system, tools
    return messages, system, tools


def thinking_dropped(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """Re-sent thinking blocks dropped (a client that keeps none)."""
    for message in messages:
        if message["role"] == "assistant" and isinstance(message["content"], list):
            message["content"] = [b for b in message["content"] if b.get("type") != "thinking"]
    return messages, system, tools


DRIFTS: dict[str, Drift] = {
    "no_drift": lambda m, s, t, turn: (m, s, t), **SAFE_DRIFTS,
    "text_edited": text_edited, "thinking_dropped": thinking_dropped,
}
SERIALIZERS: dict[str, Callable[[Any], bytes]] = {
    "orjson": orjson.dumps,
    "json.dumps": lambda body: json.dumps(body).encode(),
    "indented": lambda body: json.dumps(body, indent=1, ensure_ascii=False).encode(),
}


class Planner(ViewPlanner):
    """One planner of the comparison, planning Messages bodies."""

    wire = WIRE
    array = "messages"

    def record(self, plan: TurnPlan, reply: dict[str, Any]) -> None:  # type: ignore[override]
        observer = MessagesObserver(STRICT, success=True)
        observer.on_body(orjson.dumps(reply))
        turn = turn_write(plan, observer.end(client_gone=False), None, None, model="m", client_gone=False, now=1.0,
                          memo=self.memo if self.resent is not None else None)
        if turn is not None:
            self.store.write_turn_now(turn)


def reply_to(body: dict[str, Any], n: int) -> dict[str, Any]:
    """Thinking, then tool use (two, every third turn) after a user text; text after tool results."""
    last = body["messages"][-1]["content"]
    answering = isinstance(last, list) and any(b.get("type") == "tool_result" for b in last)
    content: list[dict[str, Any]] = [{"type": "thinking", "thinking": f"Step {n}.", "signature": f"c2ln{n:04d}"}]
    if answering:
        content.append({"type": "text", "text": f"Read it: step {n} done.\n"})
    else:
        for i in range(1 + (n % 3 == 0)):
            content.append({"type": "tool_use", "id": f"toolu_{n}_{i}", "name": "read_file",
                            "input": {"path": f"src/m{n}_{i}.py", "start_line": 1, "encoding": "café"}})
    return {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": "m", "content": content,
            "stop_reason": "end_turn" if answering else "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}


def run(drift: Drift, dumps: Callable[[Any], bytes], shapes: list[str]) -> Planner:
    secret = b"s" * 32
    tail, full = Planner(True, secret, Policy()), Planner(False, secret, Policy())
    root = tenant_root(secret, "Bearer sk-agent")
    history: Messages = [{"role": "user", "content": "Find the cache key."}]
    sent = 0

    def both(body: dict[str, Any]) -> tuple[TurnPlan, TurnPlan]:
        raw = dumps(body)
        body_t, plan_t = tail.plan(raw, root)
        body_f, plan_f = full.plan(raw, root)
        assert orjson.dumps(body_t) == orjson.dumps(body_f)
        same_plan(plan_t, plan_f)
        assert plan_t.view is not None and plan_f.view is not None
        assert orjson.dumps(plan_t.view.messages) == orjson.dumps(plan_f.view.messages)
        assert list(plan_t.view.spans) == list(plan_f.view.spans)
        return plan_t, plan_f

    for n, shape in zip(itertools.count(), shapes, strict=False):
        resent, system, tools = copy.deepcopy(history[:sent]), [{"type": "text", "text": SYSTEM}], copy.deepcopy(TOOLS)
        if n:
            resent, system, tools = drift(resent, system, tools, n)
        body = {"model": "m", "max_tokens": 64, "system": system, "tools": tools,
                "messages": resent + copy.deepcopy(history[sent:])}
        if shape == "retry" and isinstance(body["messages"][-1]["content"], str):
            other = copy.deepcopy(body)
            other["messages"][-1]["content"] += " (asked again)"
            for planner, plan in zip((tail, full), both(other), strict=True):
                planner.record(plan, reply_to(other, n))
        if shape == "resend":
            both(body)
        reply = reply_to(body, n)
        for planner, plan in zip((tail, full), both(body), strict=True):
            planner.record(plan, reply)
        history.append({"role": "assistant", "content": copy.deepcopy(reply["content"])})
        sent = len(history)
        uses = [b for b in reply["content"] if b["type"] == "tool_use"]
        if uses:
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"], "content": f"ok {b['id']}\n"} for b in uses]})
        else:
            history.append({"role": "user", "content": f"Next task {n}."})
    return tail


SHAPES = ["step", "retry", "step", "resend", "step", "step", "step"]


@pytest.mark.parametrize("order", ["messages first", "messages last"])
@pytest.mark.parametrize("serializer", sorted(SERIALIZERS))
@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_tail_only_plan_equals_full_plan(drift: str, serializer: str, order: str) -> None:
    dumps = SERIALIZERS[serializer]
    if order == "messages first":  # the anthropic SDK's order: a drifting system or tools array comes after
        dumps = _messages_first(dumps)
    tail = run(DRIFTS[drift], dumps, SHAPES)
    # Every request whose start is a recent one's is rebuilt from it, its view taking over the
    # previous view's messages (as a leading run, unless the system changed).
    assert tail.recalled == tail.continuable, (tail.recalled, tail.continuable)
    if drift == "no_drift":
        assert tail.recalled == tail.planned - 1
    if drift != "system_as_block":
        assert tail.reused == tail.recalled


def _messages_first(dumps: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def write(body: dict[str, Any]) -> bytes:
        return dumps({"messages": body["messages"], **{k: v for k, v in body.items() if k != "messages"}})

    return write
