"""The tail-only path plans exactly what the full path plans, on every drift class.

Two planners see the same bytes, turn after turn, from the agents of :mod:`tests.agents`:

* **tail**: what the request path does -- :meth:`PrefixMemo.recall` (the body rebuilt from the
  tenant's previous body and its own new bytes), the plan from where the previous body's match
  left off (:class:`~proxy.core.match.KnownPrefix`), then :meth:`PrefixMemo.remember`;
* **full**: ``orjson.loads`` of the whole body, the plan with an identity memo of its own.

Each keeps its own store and records the same reply after every turn. Whatever the drift (every
safe class, the semantic edits below), the serializer (orjson's compact form, Python's
``json.dumps`` with its spaces and ``\\u`` escapes, indented JSON) and the turn's shape (the
conversation going on, its last turn changed, the same bytes again), the two plans must be
equal in everything the request path uses: the parsed body, the chain, the match, the repair,
its spliced bytes, the break. And the tail path must really have been taken.
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
from proxy.core.identity import IdentityMemo
from proxy.core.match import tenant_root
from proxy.core.plan import TurnPlan, plan_turn, turn_write
from proxy.core.policy import Policy
from proxy.core.prefix import PrefixMemo, Recalled
from proxy.core.record import Reply
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.wire.base import Wire
from tests.agents import SAFE_DRIFTS, Agent, Drift

Msgs = list[dict[str, Any]]
Tools = list[dict[str, Any]]


# -- semantic drift: never rewritten, reported -- the tail path must see it the same way ----------

def edited_old_turn(msgs: Msgs, tools: Tools, turn: int) -> tuple[Msgs, Tools]:
    """The first user message rewritten (an edited prompt, deep in the history)."""
    for m in msgs:
        if m["role"] == "user":
            m["content"] = f"{m['content']} (edited at turn {turn})"
            break
    return msgs, tools


def message_dropped(msgs: Msgs, tools: Tools, turn: int) -> tuple[Msgs, Tools]:
    """A message cut out of the middle (a summarizer, a context trimmer)."""
    if len(msgs) > 3:
        del msgs[len(msgs) // 2]
    return msgs, tools


def head_truncated(msgs: Msgs, tools: Tools, turn: int) -> tuple[Msgs, Tools]:
    """The oldest turns dropped after the system prompt (a sliding window)."""
    return (msgs[:1] + msgs[3:] if len(msgs) > 4 else msgs), tools


def duplicated(msgs: Msgs, tools: Tools, turn: int) -> tuple[Msgs, Tools]:
    """The last re-sent message sent twice (a replayed retry)."""
    return ([*msgs, copy.deepcopy(msgs[-1])] if msgs else msgs), tools


def system_stamped(msgs: Msgs, tools: Tools, turn: int) -> tuple[Msgs, Tools]:
    """A timestamp in the system prompt that changes every turn."""
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = f"{msgs[0]['content']}\nNow: 2026-04-{10 + turn:02d}T09:00:00Z"
    return msgs, tools


def reasoning_dropped(msgs: Msgs, tools: Tools, turn: int) -> tuple[Msgs, Tools]:
    """Assistant replies re-sent with their reasoning dropped."""
    for m in msgs:
        m.pop("reasoning_content", None)
    return msgs, tools


SEMANTIC_DRIFTS: dict[str, Drift] = {
    fn.__name__: fn
    for fn in (edited_old_turn, message_dropped, head_truncated, duplicated, system_stamped, reasoning_dropped)
}
DRIFTS: dict[str, Drift] = {**SAFE_DRIFTS, **SEMANTIC_DRIFTS}

SERIALIZERS: dict[str, Callable[[Any], bytes]] = {
    "orjson": orjson.dumps,
    "json.dumps": lambda body: json.dumps(body).encode(),
    "indented": lambda body: json.dumps(body, indent=1, ensure_ascii=False).encode(),
}


# -- the two planners ---------------------------------------------------------------------------

class Planner:
    """One planner of the comparison: its own store, identity memo and (for the tail path) prefix memo."""

    def __init__(self, tail: bool, secret: bytes, policy: Policy) -> None:
        self.store = LocalStore(MemoryStore(3600, 1 << 30, secret=secret))
        self.memo = IdentityMemo()
        self.resent = PrefixMemo(self.memo) if tail else None
        self.policy = policy
        self.planned = 0
        self.recalled = 0
        self.continuable = 0
        """Requests whose first message is one a recent request of the scope sent too: the tail
        path must be taken for exactly those (it needs one shared message)."""
        self._heads: list[bytes] = []
        self.known = 0
        """Plans that started from the previous turn's match (:class:`KnownPrefix`) and skipped
        repair's comparison of messages it found clean."""
        self.tools_known = 0
        """Of them, plans that skipped the comparison of the ``tools`` value too."""

    def plan(self, raw: bytes, root: bytes) -> tuple[dict[str, Any], TurnPlan]:
        recalled = self.resent.recall(("scope", root), raw) if self.resent is not None else None
        body = recalled.body if recalled is not None else orjson.loads(raw)
        self.planned += 1
        self.recalled += recalled is not None
        head = orjson.dumps(body["messages"][0]) if body["messages"] else b""
        self.continuable += head in self._heads[-PrefixMemo.MAX_BODIES :]
        self._heads.append(head)
        known = recalled.known if recalled is not None else None
        plan = plan_turn(body, root, self.store.view(root), self.policy, self.memo, raw=raw, known=known)
        self.known += known is not None and plan.match is not None and plan.match.clean > 0
        self.tools_known += known is not None and plan.match is not None and plan.match.tools_clean
        if self.resent is not None and plan.match is not None:
            self.resent.remember_plan(("scope", root), raw, body, plan, recalled)
        return body, plan

    def record(self, plan: TurnPlan, reply: dict[str, Any]) -> None:
        # The tail path records as the request path does: the reply's identity through the memo.
        memo = self.memo if self.resent is not None else None
        turn = turn_write(plan, Reply(message=reply, finish_reason="stop", partial=False, model="m"), None, None, model="m", client_gone=False, now=1.0, memo=memo)
        if turn is not None:
            self.store.write_turn_now(turn)


class ViewPlanner(Planner):
    """A planner of a wire API that plans on a view of the client's re-sent array (Messages,
    Responses): the wire's own ``plan``, and the view's reuse of the previous view checked."""

    wire: Wire
    array: str
    """The re-sent array; the members before it and its first element make a body's head."""

    def __init__(self, tail: bool, secret: bytes, policy: Policy) -> None:
        super().__init__(tail, secret, policy)
        self.reused = 0
        """Plans whose view begins with messages of the previous view (the very objects)."""

    def plan(self, raw: bytes, root: bytes) -> tuple[dict[str, Any], TurnPlan]:
        scope = ("scope", root)
        recalled = self.resent.recall(scope, raw) if self.resent is not None else None
        body = recalled.body if recalled is not None else orjson.loads(raw)
        plan = self.wire.plan(raw, body, root, self.store.view(root), self.policy, self.memo, STRICT, recalled)
        self.planned += 1
        self.recalled += recalled is not None
        # Continuable: the members before the array and its first element are a recent request's:
        # the tail path needs one shared element.
        array = self.array
        head = orjson.dumps([list(itertools.takewhile(lambda kv: kv[0] != array, body.items())), body[array][0]])
        self.continuable += head in self._heads[-PrefixMemo.MAX_BODIES :]
        self._heads.append(head)
        assert plan.view is not None
        if plan.view.reused:
            assert recalled is not None
            source = recalled.source.messages
            assert all(a is b for a, b in zip(plan.view.messages[: plan.view.reused], source, strict=False))
            self.reused += 1
        self.counted(plan, recalled)
        if self.resent is not None:
            self.resent.remember_plan(scope, raw, body, plan, recalled, array=self.wire.resends or "")
        return body, plan

    def counted(self, plan: TurnPlan, recalled: Recalled | None) -> None:
        """More counts of a plan, where a test keeps them."""


def same_plan(tail: TurnPlan, full: TurnPlan) -> None:
    assert (tail.match is None) == (full.match is None)
    if tail.match is not None and full.match is not None:
        a, b = tail.match, full.match
        assert a.keys == b.keys
        assert a.identities == b.identities
        assert a.order == b.order
        assert a.matched == b.matched
        assert [n.key for n in a.nodes] == [n.key for n in b.nodes]
        assert a.clean_sizes == b.clean_sizes
        assert a.message_ids == b.message_ids
        assert a.message_sizes == b.message_sizes
        for m in (a, b):  # kept for the later stages, never computed from what is not there
            assert m.ordered == (m.order == tuple(range(len(m.message_ids))))
    assert tail.repair.repairs == full.repair.repairs
    assert tail.repair.edits == full.repair.edits
    assert tail.repair.rescued_tokens == full.repair.rescued_tokens
    assert tail.brk == full.brk
    assert tail.spliced == full.spliced
    assert tail.refused == full.refused
    assert orjson.dumps(tail.forwarded) == orjson.dumps(full.forwarded)
    assert tail.messages == full.messages


def reply_to(request: dict[str, Any], n: int) -> dict[str, Any]:
    """The upstream's answer: a tool call (two, every third turn) after a user turn, text after tool results."""
    if request["messages"][-1]["role"] == "user":
        calls = [
            {"id": f"call_{n}_{i}", "type": "function", "function": {"name": "read_file", "arguments": f'{{"path":"src/m{n}_{i}.py"}}'}}
            for i in range(1 + (n % 3 == 0))
        ]
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
    else:
        message = {"role": "assistant", "content": f"Read it: step {n} done.\n"}
    if n % 4 == 1:
        message["reasoning_content"] = f"thinking about step {n}"
    return message


def run_agent(drift: str, serializer: str, shapes: list[str], policy: Policy) -> tuple[Planner, Planner]:
    secret = b"s" * 32
    tail, full = Planner(True, secret, policy), Planner(False, secret, policy)
    root = tenant_root(secret, "Bearer sk-agent")
    dumps = SERIALIZERS[serializer]
    counter = iter(range(10**6))

    def plan_both(request: dict[str, Any]) -> tuple[TurnPlan, TurnPlan]:
        raw = dumps(request)
        body_t, plan_t = tail.plan(raw, root)
        body_f, plan_f = full.plan(raw, root)
        assert body_t == body_f
        assert orjson.dumps(body_t) == orjson.dumps(body_f), "the rebuilt body keeps the client's key order"
        same_plan(plan_t, plan_f)
        return plan_t, plan_f

    async def post(request: dict[str, Any]) -> dict[str, Any]:
        n = next(counter)
        shape = shapes[n % len(shapes)]
        if shape == "retry" and request["messages"][-1]["role"] == "user":
            # First the same conversation with another last turn, answered and recorded too.
            other = copy.deepcopy(request)
            other["messages"][-1]["content"] += " (asked again, differently)"
            plan_t, plan_f = plan_both(other)
            tail.record(plan_t, reply_to(other, n))
            full.record(plan_f, reply_to(other, n))
        if shape == "resend":
            plan_both(request)  # the same bytes twice (a client retry): planned again, not recorded
        plan_t, plan_f = plan_both(request)
        reply = reply_to(request, n)
        tail.record(plan_t, reply)
        full.record(plan_f, reply)
        return {"choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]}

    agent = Agent(post=post, drift=DRIFTS[drift])
    asyncio.run(agent.run(len(shapes)))
    return tail, full


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    drift=st.sampled_from(sorted(DRIFTS)),
    serializer=st.sampled_from(sorted(SERIALIZERS)),
    shapes=st.lists(st.sampled_from(["step", "retry", "resend"]), min_size=2, max_size=7),
    collapse=st.booleans(),
)
def test_tail_only_plan_equals_full_plan(drift: str, serializer: str, shapes: list[str], collapse: bool) -> None:
    policy = Policy(collapse_duplicates=collapse)
    tail, full = run_agent(drift, serializer, shapes, policy)
    assert full.recalled == 0
    assert tail.recalled == tail.continuable


def test_every_drift_class_takes_the_tail_path() -> None:
    """Each class, each serializer, a fixed run: the plans agree and the tail path is taken
    (the property above samples; this one covers every pair)."""
    shapes = ["step", "retry", "step", "resend", "step", "step"]
    for drift in DRIFTS:
        for serializer in SERIALIZERS:
            tail, _ = run_agent(drift, serializer, shapes, Policy())
            assert tail.recalled == tail.continuable, (drift, serializer)
            # And past two rebuilt turns, some plan starts from the previous turn's match.
            assert tail.known > 0 or tail.recalled < 2, (drift, serializer)
            if drift not in ("system_stamped", "content_as_parts", "varying", "resumed", "whitespace_stripped"):
                # The system prompt never changes: every request after the first takes the tail path.
                assert tail.recalled == tail.planned - 1, (drift, serializer)


def test_no_drift_parses_only_the_new_messages() -> None:
    """On a conversation that goes on byte for byte, every turn after the first is rebuilt from the
    previous body: all but the new messages are the remembered objects."""
    secret = b"s" * 32
    root = tenant_root(secret, "Bearer sk-agent")
    tail = Planner(True, secret, Policy())
    assert tail.resent is not None
    bodies: list[dict[str, Any]] = []

    async def post(request: dict[str, Any]) -> dict[str, Any]:
        body, plan = tail.plan(orjson.dumps(request), root)
        bodies.append(body)
        reply = reply_to(request, len(bodies))
        tail.record(plan, reply)
        return {"choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]}

    asyncio.run(Agent(post=post).run(6))
    # From the third turn on, each plan starts where the previous one's match ended (the
    # previous turn's new messages were not stored yet when it was planned: matched here).
    assert tail.known == len(bodies) - 2
    assert tail.tools_known == len(bodies) - 2  # the same tools object, found clean: not serialized again
    for before, after in itertools.pairwise(bodies):
        shared = len(before["messages"])
        assert all(a is b for a, b in zip(after["messages"][:shared], before["messages"], strict=True))
        assert after["tools"] is before["tools"]
    assert tail.recalled == len(bodies) - 1
