"""The prefix memo never rebuilds a body other than the one sent, and stays within its bounds.

:meth:`PrefixMemo.recall` is checked against ``orjson.loads`` of the very bytes: for a remembered
body and anything a client could send after it -- the conversation going on or its last turn
changed, in any serializer; a byte changed anywhere; members after the array changed; a second
``messages`` key before or after the array; a decoy array under another key holding the same
messages; a tail that is not JSON -- it returns the body ``orjson.loads`` would (values and key
order), or None. And it does return one where a no-drift turn should be cheap.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.identity import IdentityMemo
from proxy.core.match import match_request, tenant_root
from proxy.core.policy import Policy
from proxy.core.prefix import PrefixMemo
from proxy.store.memory.store import MemoryStore

ROOT = tenant_root(b"k" * 32, "Bearer sk-test")
SCOPE = (ROOT, "POST", "/v1/chat/completions")
SERIALIZERS = {
    "orjson": orjson.dumps,
    "json.dumps": lambda v: json.dumps(v).encode(),
    "compact, ensure_ascii=False": lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode(),
    "indented": lambda v: json.dumps(v, indent=2).encode(),
    "spaced separators": lambda v: json.dumps(v, separators=(" , ", " : ")).encode(),
    "indented, CRLF": lambda v: json.dumps(v, indent=2).replace("\n", "\r\n").encode(),
    "tab separators": lambda v: json.dumps(v, separators=("\t,", ":")).encode(),
}


def remembered(memo: PrefixMemo, raw: bytes, store: MemoryStore | None = None) -> bool:
    """Plan ``raw`` as the request path does (the memo's identity memo) and remember it."""
    recalled = memo.recall(SCOPE, raw)
    body = recalled.body if recalled is not None else orjson.loads(raw)
    match = match_request(body, ROOT, store or MemoryStore(3600, 1 << 30), Policy(), memo.memo)
    return memo.remember(SCOPE, raw, body, match, recalled)


def check(memo: PrefixMemo, raw: bytes) -> bool:
    """``recall`` agrees with ``orjson.loads``; True when it rebuilt the body."""
    recalled = memo.recall(SCOPE, raw)
    try:
        expected = orjson.loads(raw)
    except orjson.JSONDecodeError:
        assert recalled is None, "a body that is no JSON was rebuilt"
        return False
    if recalled is None:
        return False
    assert recalled.body == expected
    assert orjson.dumps(recalled.body) == orjson.dumps(expected), "key order differs"
    return True


texts = st.text(alphabet=st.sampled_from('ab z\n北é"\\{}[],:09'), max_size=10)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": texts}),
    min_size=1,
    max_size=5,
)


def body_of(msgs: list[dict[str, Any]], *, tools_first: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    head: dict[str, Any] = {"model": "m"}
    if tools_first:
        head["tools"] = tools
    body = {**head, "messages": msgs}
    if not tools_first:
        body["tools"] = tools
    return {**body, **(extra or {})}


MUTATIONS = ("append", "last_changed", "flip", "after_changed", "dup_after", "dup_before", "decoy", "cut", "same")


def mutated(kind: str, raw: bytes, body: dict[str, Any], dumps: Any, new: list[dict[str, Any]], at: int) -> bytes:
    msgs = body["messages"]
    if kind == "append":
        return bytes(dumps({**body, "messages": [*msgs, *new]}))
    if kind == "last_changed":
        return bytes(dumps({**body, "messages": [*msgs[:-1], *new]}))
    if kind == "flip":
        i = at % len(raw)
        return raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1 :]
    if kind == "after_changed":  # what follows the array: a flag added, the tools (when after it) changed
        keys = list(body)
        after_tools = "tools" in keys and keys.index("tools") > keys.index("messages")
        return bytes(dumps({**body, "messages": [*msgs, *new], "stream": True, **({"tools": []} if after_tools else {})}))
    if kind == "dup_after":
        return raw[:-1] + b',"messages":' + bytes(dumps([*msgs, *new])) + b"}"
    if kind == "dup_before":
        return b'{"messages":' + bytes(dumps(new)) + b"," + raw[1:]
    if kind == "decoy":
        return b'{"metadata":{"messages":' + bytes(dumps([*msgs, *new])) + b"}," + raw[1:]
    if kind == "cut":
        return raw[: max(1, at % len(raw))]
    return raw


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    msgs=messages,
    new=messages,
    serializer=st.sampled_from(sorted(SERIALIZERS)),
    tools_first=st.booleans(),
    kinds=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=4),
    at=st.integers(0, 10**6),
)
def test_recall_is_orjson_loads_or_nothing(
    msgs: list[dict[str, Any]], new: list[dict[str, Any]], serializer: str, tools_first: bool, kinds: list[str], at: int
) -> None:
    dumps = SERIALIZERS[serializer]
    memo = PrefixMemo(IdentityMemo())
    body = body_of(msgs, tools_first=tools_first)
    raw = bytes(dumps(body))
    assert remembered(memo, raw)
    for kind in kinds:
        nxt = mutated(kind, raw, body, dumps, new, at)
        check(memo, nxt)
        try:
            parsed = orjson.loads(nxt)
        except orjson.JSONDecodeError:
            continue
        if type(parsed) is dict and type(parsed.get("messages")) is list and parsed["messages"]:
            remembered(memo, nxt)  # the next mutation may continue this one
            raw, body = nxt, parsed


@SETTINGS
@given(msgs=messages, new=messages, serializer=st.sampled_from(sorted(SERIALIZERS)), tools_first=st.booleans())
def test_a_continued_or_changed_last_turn_is_rebuilt(
    msgs: list[dict[str, Any]], new: list[dict[str, Any]], serializer: str, tools_first: bool
) -> None:
    """No drift: the conversation going on, or its last turn changed, takes the tail path in
    every serializer, and so do the members after the array changing (another tools array) and
    the same body sent again (a retry). The session is the tenant's oldest of several in
    parallel: more than the memo searches for a shared start, so only the continued body's own
    check (:meth:`_Body.continued`) finds it."""
    dumps = SERIALIZERS[serializer]
    memo = PrefixMemo(IdentityMemo())
    body = body_of(msgs, tools_first=tools_first)
    assert remembered(memo, bytes(dumps(body)))
    for other in range(PrefixMemo.SEARCHED):
        assert remembered(memo, bytes(dumps(body_of([{"role": "system", "content": f"session {other}"}], tools_first=tools_first))))
    for kind in ("append", "after_changed", "same") if len(msgs) < 2 else ("append", "last_changed", "after_changed", "same"):
        nxt = mutated(kind, bytes(dumps(body)), body, dumps, new, 0)
        assert check(memo, nxt), kind
        recalled = memo.recall(SCOPE, nxt)
        assert recalled is not None
        shared = len(msgs) if kind != "last_changed" else len(msgs) - 1
        assert recalled.shared >= shared
        assert all(a is b for a, b in zip(recalled.body["messages"][:shared], body_messages(memo), strict=False))


@pytest.mark.parametrize("serializer", sorted(SERIALIZERS))
def test_a_one_message_body_sent_again_is_rebuilt(serializer: str) -> None:
    """A retry of a one-message body, the oldest of a tenant's parallel sessions: only the
    array's ``]`` or whitespace follows its message, whichever the serializer writes."""
    dumps = SERIALIZERS[serializer]
    memo = PrefixMemo(IdentityMemo())
    raw = bytes(dumps(body_of([{"role": "user", "content": "a"}], tools_first=False)))
    assert remembered(memo, raw)
    for other in range(PrefixMemo.SEARCHED):
        assert remembered(memo, bytes(dumps(body_of([{"role": "system", "content": f"session {other}"}], tools_first=False))))
    recalled = memo.recall(SCOPE, raw)
    assert recalled is not None and recalled.shared == 1
    assert recalled.body == orjson.loads(raw)


@pytest.mark.parametrize("serializer", sorted(SERIALIZERS))
def test_every_turn_of_a_conversation_shares_all_the_turns_before(serializer: str) -> None:
    """Turn after turn, each body is rebuilt from the one before and remembered as rebuilt:
    where that one's new messages end in its bytes (its last one, before the array's end and
    any whitespace) lets the next turn share all of them."""
    dumps = SERIALIZERS[serializer]
    memo = PrefixMemo(IdentityMemo())
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert remembered(memo, bytes(dumps(body_of(msgs, tools_first=False))))
    for turn in range(4):
        before = len(msgs)
        msgs = [*msgs, {"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn} "}]
        raw = bytes(dumps(body_of(msgs, tools_first=False)))
        recalled = memo.recall(SCOPE, raw)
        assert recalled is not None and recalled.shared == before, turn
        assert recalled.body == orjson.loads(raw)
        assert remembered(memo, raw)


def body_messages(memo: PrefixMemo) -> list[Any]:
    """The messages of the oldest body remembered (the objects the memo holds)."""
    bodies = next(iter(memo._scopes.values()))
    return bodies[-1].messages


def test_decoys_and_duplicates_are_never_taken_for_the_array() -> None:
    """The same messages under another key, before the real array, and a second ``messages`` key
    after it: the body is remembered only where the real (last) array is proven, and every
    recall is what ``orjson.loads`` reads."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    decoy = orjson.dumps({"metadata": {"messages": msgs}, "messages": msgs, "model": "m"})
    memo = PrefixMemo(IdentityMemo())
    assert remembered(memo, decoy)
    recalled = memo.recall(SCOPE, decoy)
    assert recalled is not None and recalled.body == orjson.loads(decoy)
    # The array found is the top-level one: a client adding to the decoy only is not continued.
    grown_decoy = orjson.dumps({"metadata": {"messages": [*msgs, {"role": "user", "content": "x"}]}, "messages": msgs, "model": "m"})
    assert check(memo, grown_decoy) is False or memo.recall(SCOPE, grown_decoy).body == orjson.loads(grown_decoy)  # type: ignore[union-attr]
    # A later duplicate key wins (orjson keeps the last): a body that adds one after the array
    # it continues is never rebuilt from the first array.
    plain = orjson.dumps({"model": "m", "messages": msgs})
    memo = PrefixMemo(IdentityMemo())
    assert remembered(memo, plain)
    twice = plain[:-1] + b',"messages":[{"role":"user","content":"other"}]}'
    assert memo.recall(SCOPE, twice) is None
    # Remembered on its own, the array proven is the last one, and recalls agree with orjson.
    memo = PrefixMemo(IdentityMemo())
    assert remembered(memo, twice)
    assert check(memo, twice)
    assert check(memo, twice[:-2] + b',{"role":"user","content":"more"}]}')


def test_memory_stays_bounded_and_held_objects_are_released() -> None:
    identity = IdentityMemo()
    memo = PrefixMemo(identity, max_bytes=2 * 1024 * 1024)
    store = MemoryStore(3600, 1 << 30)
    big = "x" * 20_000
    for session in range(200):
        msgs = [{"role": "system", "content": f"{big} {session}"}, {"role": "user", "content": "go"}]
        for turn in range(3):
            msgs = [*msgs, {"role": "assistant", "content": f"step {turn}"}, {"role": "user", "content": f"next {turn}"}]
            scope = (ROOT, "POST", f"/session/{session % 50}")
            raw = orjson.dumps({"model": "m", "messages": msgs})
            recalled = memo.recall(scope, raw)
            body = recalled.body if recalled is not None else orjson.loads(raw)
            match = match_request(body, ROOT, store, Policy(), identity)
            memo.remember(scope, raw, body, match, recalled)
            assert memo.size <= memo.max_bytes
    held = len(identity._objects)
    kept = sum(len(b.messages) + (b.tools is not None) for bodies in memo._scopes.values() for b in bodies)
    assert 0 < held <= kept, "objects stay held only as long as a remembered body holds them"
    assert len(memo) <= 50 * PrefixMemo.MAX_BODIES


def test_parallel_answers_of_one_conversation_keep_one_body_and_exact_holds() -> None:
    """Requests answered in parallel, each the same history with its own last turn, are all
    rebuilt from one remembered body; each one kept replaces the one before (its last turn
    released, the shared messages passed over as held), so the memo holds one body whose
    message objects are held exactly once -- not one more full copy per parallel request."""
    identity = IdentityMemo()
    memo = PrefixMemo(identity)
    store = MemoryStore(3600, 1 << 30)
    history = [{"role": "system", "content": "be brief"}, *[
        {"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(1, 40)
    ]]

    def body_of(last: str) -> bytes:
        return orjson.dumps({"model": "m", "messages": [*history, {"role": "user", "content": last}]})

    assert remembered(memo, body_of("first"), store)
    planned = []
    for i in range(8):  # all recalled before any is remembered, as under concurrency
        raw = body_of(f"parallel {i}")
        recalled = memo.recall(SCOPE, raw)
        assert recalled is not None and recalled.shared == len(history)
        planned.append((raw, recalled, match_request(recalled.body, ROOT, store, Policy(), identity)))
    for raw, recalled, match in planned:
        assert memo.remember(SCOPE, raw, recalled.body, match, recalled)
    (kept,) = memo._scopes[SCOPE]
    assert kept.messages[-1]["content"] == "parallel 7"
    assert all(identity._objects[id(m)].refs == 1 for m in kept.messages)
    assert len(identity._objects) == len(kept.messages)
