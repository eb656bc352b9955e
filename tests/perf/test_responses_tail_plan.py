"""Responses API: the tail-only path plans exactly what the full path plans, on every drift class.

The Responses twin of ``test_tail_plan.py``. Two planners see the same ``/v1/responses`` bytes,
turn after turn, from the agent of :mod:`tests.responses.agents`:

* **tail**: what the request path does -- :meth:`PrefixMemo.recall` on the ``input`` array, the
  view taken over from the previous body's view where its items are shared
  (:func:`~proxy.wire.responses.continued_view`), the match from where the previous one left off,
  then :meth:`PrefixMemo.remember_plan`;
* **full**: ``orjson.loads`` of the whole body, the view made whole, an identity memo of its own.

Whatever the drift (every safe class, and semantic edits: changed instructions, a dropped item,
dropped reasoning, an edited tool output), the serializer, reasoning items on or off and the
turn's shape (the conversation going on, its last turn changed, the same bytes again, a body
ending with a reasoning item and then one going on after it), the two
plans must be equal in everything the request path uses, and the tail path must really have
been taken -- with the previous view's messages taken over, not made again.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections.abc import Callable
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.guard import STRICT
from proxy.core.match import tenant_root
from proxy.core.plan import TurnPlan, turn_write
from proxy.core.policy import Policy
from proxy.core.prefix import Recalled
from proxy.wire.responses import ResponsesObserver, ResponsesWire
from tests.perf.test_tail_plan import SERIALIZERS as CHAT_SERIALIZERS
from tests.perf.test_tail_plan import ViewPlanner, message_dropped, same_plan
from tests.responses.agents import SAFE_DRIFTS, Items, ResponsesAgent, Tools

Drift = Callable[[Items, Tools, int], tuple[Items, Tools]]
WIRE = ResponsesWire()


# -- semantic drift: never rewritten, reported -- the tail path must see it the same way ----------

def output_edited(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """The first tool output rewritten (a client that trims old tool results)."""
    for item in items:
        if item.get("type") == "function_call_output":
            item["output"] = f"(trimmed at turn {turn})"
            break
    return items, tools


def reasoning_dropped(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """Re-sent reasoning items dropped (a client that keeps no encrypted reasoning)."""
    return [i for i in items if i.get("type") != "reasoning"], tools


def instructions_stamped(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """A timestamp in the instructions that changes every turn (applied by the test's ``post``:
    a drift sees only the items)."""
    return items, tools


SEMANTIC_DRIFTS: dict[str, Drift] = {
    fn.__name__: fn for fn in (output_edited, message_dropped, reasoning_dropped, instructions_stamped)
}
DRIFTS: dict[str, Drift] = {"no_drift": lambda items, tools, turn: (items, tools), **SAFE_DRIFTS, **SEMANTIC_DRIFTS}

FIRST_ITEM_DRIFTS = frozenset(("content_as_parts", "null_fields", "ids_regenerated", "resumed", "instructions_stamped"))
"""Drifts that change the bytes up to the first item's end (with the instructions first): no
byte-identical start to continue."""

SERIALIZERS: dict[str, Callable[[Any], bytes]] = {
    **CHAT_SERIALIZERS,
    # The instructions after the items: a change to them is outside the byte-identical start.
    "instructions last": lambda body: orjson.dumps(
        {**{k: v for k, v in body.items() if k != "instructions"}, "instructions": body["instructions"]}
    ),
}


class Planner(ViewPlanner):
    """One planner of the comparison (the chat test's: its own store, identity memo and, for the
    tail path, prefix memo), planning Responses bodies. A body's head: the members before the
    items (the instructions, unless they come after) and the first item."""

    wire = WIRE
    array = "input"

    def __init__(self, tail: bool, secret: bytes, policy: Policy) -> None:
        super().__init__(tail, secret, policy)
        self.taken = 0
        """Plans whose view holds messages of the previous view (the very objects), anywhere."""

    def counted(self, plan: TurnPlan, recalled: Recalled | None) -> None:
        if recalled is not None:
            assert plan.view is not None
            before = {id(m) for m in recalled.source.messages}
            self.taken += any(id(m) in before for m in plan.view.messages)
        self.known += plan.match is not None and plan.match.clean > 0

    def record(self, plan: TurnPlan, output: list[dict[str, Any]]) -> None:  # type: ignore[override]
        observer = ResponsesObserver(STRICT, success=True)
        observer.on_body(orjson.dumps({"output": output, "usage": {"input_tokens": 1, "output_tokens": 1}}))
        reply = observer.end(client_gone=False)
        turn = turn_write(plan, reply, None, None, model="m", client_gone=False, now=1.0)
        if turn is not None:
            self.store.write_turn_now(turn)


def same_responses_plan(tail: TurnPlan, full: TurnPlan) -> None:
    same_plan(tail, full)
    assert tail.view is not None and full.view is not None
    assert orjson.dumps(tail.view.messages) == orjson.dumps(full.view.messages)
    assert list(tail.view.spans) == list(full.view.spans)


def output_for(request: dict[str, Any], n: int, reasoning: bool) -> list[dict[str, Any]]:
    """The upstream's output: a function call (two, every third turn) after a user turn, text after
    tool outputs; an encrypted reasoning item first when asked for."""
    out: list[dict[str, Any]] = []
    if reasoning:
        out.append({"type": "reasoning", "id": f"rs_{n}", "summary": [], "encrypted_content": f"gAAA{n:04d}=="})
    if request["input"][-1].get("type") != "function_call_output":
        for i in range(1 + (n % 3 == 0)):
            out.append({
                "type": "function_call", "id": f"fc_{n}_{i}", "call_id": f"call_{n}_{i}", "name": "read_file",
                "arguments": json.dumps({"path": f"src/m{n}_{i}.py", "start_line": 1, "encoding": "utf-8"}, separators=(",", ":")),
                "status": "completed",
            })
    else:
        out.append({
            "type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": f"Read it: step {n} done.\n", "annotations": []}],
        })
    return out


def run_agent(drift: str, serializer: str, shapes: list[str], reasoning: bool, policy: Policy) -> tuple[Planner, Planner]:
    secret = b"s" * 32
    tail, full = Planner(True, secret, policy), Planner(False, secret, policy)
    root = tenant_root(secret, "Bearer sk-agent")
    dumps = SERIALIZERS[serializer]
    counter = itertools.count()

    def plan_both(request: dict[str, Any]) -> tuple[TurnPlan, TurnPlan]:
        raw = dumps(request)
        body_t, plan_t = tail.plan(raw, root)
        body_f, plan_f = full.plan(raw, root)
        assert orjson.dumps(body_t) == orjson.dumps(body_f), "the rebuilt body keeps the client's values and key order"
        same_responses_plan(plan_t, plan_f)
        return plan_t, plan_f

    async def post(request: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        n = next(counter)
        shape = shapes[n % len(shapes)]
        if drift == "instructions_stamped" and n:
            request = {**request, "instructions": f"{request['instructions']}\nNow: 2026-04-{10 + n:02d}T09:00:00Z"}
        if shape == "reasoning_tail":
            # A body that ends with a reasoning item (a client sending back a reasoning-only
            # output), then one that goes on after it: the reasoning rides along the new item.
            thought = {"type": "reasoning", "id": f"rs_t{n}", "summary": [], "encrypted_content": f"gBBB{n:04d}=="}
            plan_both({**request, "input": [*request["input"], thought]})
            request = {**request, "input": [*request["input"], thought, {"role": "user", "content": "Go on."}]}
        if shape == "retry" and request["input"][-1].get("role") == "user":
            other = copy.deepcopy(request)
            other["input"][-1]["content"] += " (asked again, differently)"
            plan_t, plan_f = plan_both(other)
            other_out = output_for(other, n, reasoning)
            tail.record(plan_t, other_out)
            full.record(plan_f, other_out)
        if shape == "resend":
            plan_both(request)  # the same bytes twice (a client retry): planned again, not recorded
        plan_t, plan_f = plan_both(request)
        output = output_for(request, n, reasoning)
        tail.record(plan_t, output)
        full.record(plan_f, output)
        return {"output": copy.deepcopy(output)}

    agent = ResponsesAgent(post=post, drift=DRIFTS[drift], reasoning=reasoning)
    asyncio.run(agent.run(len(shapes)))
    return tail, full


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    drift=st.sampled_from(sorted(DRIFTS)),
    serializer=st.sampled_from(sorted(SERIALIZERS)),
    shapes=st.lists(st.sampled_from(["step", "retry", "resend", "reasoning_tail"]), min_size=2, max_size=7),
    reasoning=st.booleans(),
    collapse=st.booleans(),
)
def test_tail_only_plan_equals_full_plan(drift: str, serializer: str, shapes: list[str], reasoning: bool, collapse: bool) -> None:
    tail, full = run_agent(drift, serializer, shapes, reasoning, Policy(collapse_duplicates=collapse))
    assert full.recalled == 0 and full.reused == 0
    assert tail.recalled == tail.continuable


def test_every_drift_class_takes_the_tail_path() -> None:
    """Each class, each serializer, with and without reasoning, a fixed run: the plans agree, and
    every request that shares its first item with a recent one is rebuilt from it, its view taking
    over the previous view's messages; without drift on the first item, that is every request
    after the first."""
    shapes = ["step", "retry", "step", "resend", "reasoning_tail", "step", "step"]
    for drift in DRIFTS:
        for serializer in SERIALIZERS:
            for reasoning in (False, True):
                tail, _ = run_agent(drift, serializer, shapes, reasoning, Policy())
                label = (drift, serializer, reasoning)
                assert tail.recalled == tail.continuable, label
                assert tail.taken == tail.recalled, label
                if drift == "instructions_stamped" and serializer == "instructions last":
                    # The instructions changed after the items: the items' messages are taken
                    # over, the match starts over -- but for a request re-sent as it was.
                    assert 0 < tail.reused < tail.recalled, label
                else:
                    assert tail.reused == tail.recalled, label
                if drift not in FIRST_ITEM_DRIFTS:
                    assert tail.recalled == tail.planned - 1, label


def test_no_drift_makes_only_the_new_view_messages() -> None:
    """On a conversation that goes on byte for byte, from the third turn on each plan starts where
    the previous one's match ended: its shared items are the remembered objects, its view's
    messages for them the previous view's, all of them known clean but the last."""
    secret = b"s" * 32
    root = tenant_root(secret, "Bearer sk-agent")
    tail = Planner(True, secret, Policy())
    plans: list[tuple[dict[str, Any], TurnPlan]] = []

    async def post(request: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        body, plan = tail.plan(orjson.dumps(request), root)
        plans.append((body, plan))
        output = output_for(request, len(plans), True)
        tail.record(plan, output)
        return {"output": copy.deepcopy(output)}

    asyncio.run(ResponsesAgent(post=post, reasoning=True).run(8))
    assert tail.recalled == len(plans) - 1
    assert tail.known == len(plans) - 2
    for (before, plan_before), (after, plan_after) in itertools.pairwise(plans):
        shared = len(before["input"])
        assert all(a is b for a, b in zip(after["input"][:shared], before["input"], strict=True))
        assert plan_before.view is not None and plan_after.view is not None
        # Every view message of the previous body is taken over: its last item is never reasoning
        # (the agent sends the tool outputs or the user's turn after it).
        assert plan_after.view.reused == len(plan_before.view.messages)
        assert plan_after.match is not None and plan_after.match.matched >= plan_after.view.reused
