"""Chain hashing, tenant roots, the longest stored prefix, tool-result groups, collapse, new nodes."""

from __future__ import annotations

import hashlib
import hmac
import itertools

import orjson

from proxy.core.identity import message_identity, tools_identity
from proxy.core.match import chain, match_request, new_nodes, tenant_root, tool_groups
from proxy.core.policy import Policy
from proxy.store.base import ROLE_TOOLS
from tests.core.factories import (
    SECRET,
    TOOLS,
    DictStore,
    Session,
    agent_history,
    assistant,
    call,
    count_tokens,
    make_chat,
    result,
    system,
    user,
)


def test_tenant_root_is_hmac_of_the_credential() -> None:
    expected = hmac.new(SECRET, b"Bearer sk-alice", hashlib.sha256).digest()[:16]
    assert tenant_root(SECRET, "Bearer sk-alice") == expected
    assert tenant_root(SECRET, "Bearer sk-bob") != expected
    assert tenant_root(b"other-secret", "Bearer sk-alice") != expected
    assert len(tenant_root(SECRET, "")) == 16


def test_chain_definition() -> None:
    parent, identity = b"p" * 16, b"i" * 16
    assert chain(parent, identity) == hashlib.blake2b(parent + identity, digest_size=16).digest()
    assert chain(identity, parent) != chain(parent, identity)


def test_empty_store_matches_nothing(session: Session) -> None:
    body = make_chat(system("s"), user("hi"), tools=TOOLS)
    t = session.look(body)
    m = t.match
    assert m.matched == 0 and m.nodes == ()
    assert len(m.keys) == len(m.identities) == 3
    assert m.identities[0] == tools_identity(TOOLS)
    assert m.identities[1] == message_identity(system("s"))
    assert m.keys[0] == chain(session.root, m.identities[0])
    assert m.keys[2] == chain(m.keys[1], m.identities[2])
    assert m.order == (0, 1)


def test_second_turn_matches_the_first_and_its_reply(session: Session) -> None:
    first = make_chat(system("s"), user("hi"), tools=TOOLS)
    reply = assistant("Hello! How can I help?")
    session.turn(first, reply)
    second = make_chat(system("s"), user("hi"), reply, user("more"), tools=TOOLS)
    m = session.look(second).match
    assert m.matched == 4
    assert [n.role for n in m.nodes] == [ROLE_TOOLS, "system", "user", "assistant"]
    assert m.nodes[3].generated
    assert not m.complete


def test_request_without_tools_matches_one_with_empty_tools(session: Session) -> None:
    session.turn(make_chat(user("hi")), assistant("yo"))
    assert session.look(make_chat(user("hi"), tools=[])).match.matched == 2
    assert session.look(make_chat(user("hi"), tools=None)).match.matched == 2


def test_tenants_never_match_each_other(store: DictStore) -> None:
    alice = Session(store=store, credential="Bearer sk-alice")
    bob = Session(store=store, credential="Bearer sk-bob")
    body = make_chat(system("shared system prompt"), user("hi"))
    alice.turn(body, assistant("hello"))
    assert alice.look(body).match.matched == 3
    t = bob.look(body)
    assert t.match.matched == 0
    assert t.brk is not None and t.brk.reason == "new_branch"
    assert not set(t.match.keys) & set(store.nodes)


def test_tool_groups() -> None:
    msgs = agent_history(turns=2, parallel=3)
    groups = tool_groups(msgs)
    assert groups == {3: 6, 9: 12}
    assert tool_groups([assistant("x"), result("c", "orphan")]) == {}


def _history_with_group() -> list[dict]:
    return [
        system("s"),
        user("two things"),
        assistant(
            None,
            call("c1", "search", {"query": "a"}),
            call("c2", "search", {"query": "b"}),
            call("c3", "search", {"query": "c"}),
        ),
        result("c1", "A"),
        result("c2", "B"),
        result("c3", "C"),
    ]


def test_tool_result_group_in_another_order_matches_in_stored_order(session: Session) -> None:
    msgs = _history_with_group()
    session.turn(make_chat(*msgs), assistant("done"))
    shuffled = [*msgs[:3], msgs[5], msgs[3], msgs[4], assistant("done")]
    m = session.look(make_chat(*shuffled)).match
    assert m.order == (0, 1, 2, 4, 5, 3, 6)
    assert m.complete
    stored = session.look(make_chat(*msgs, assistant("done"))).match
    assert m.keys == stored.keys


def test_tool_result_group_is_permuted_whole_or_not_at_all(session: Session) -> None:
    msgs = _history_with_group()
    session.turn(make_chat(*msgs), assistant("done"))
    changed = result("c1", "A, but rewritten by a hook")
    shuffled = [*msgs[:3], msgs[4], changed, msgs[5]]
    m = session.look(make_chat(*shuffled)).match
    assert m.order == tuple(range(6)), "a group that does not match whole is never reordered"
    assert m.matched == 4


def test_group_permutation_is_off_in_observe_mode(store: DictStore) -> None:
    msgs = _history_with_group()
    Session(store=store).turn(make_chat(*msgs), assistant("done"))
    observer = Session(store=store, policy=Policy(repair=False))
    m = observer.look(make_chat(*msgs[:3], msgs[5], msgs[3], msgs[4])).match
    assert m.order == tuple(range(6))
    assert m.matched == 4


def test_collapse_drops_an_exact_replay_of_the_previous_message(store: DictStore) -> None:
    collapsing = Session(store=store, policy=Policy(collapse_duplicates=True))
    msgs = [system("s"), user("fix the bug")]
    collapsing.turn(make_chat(*msgs), assistant("Which bug?"))
    replay = make_chat(*msgs, user("fix the bug"), assistant("Which bug?"), user("the crash"))
    t = collapsing.look(replay)
    # the request replays the user turn, then echoes the reply: the replay is dropped
    assert t.match.order == (0, 1, 3, 4)
    assert t.match.matched == 4
    assert "duplicate_collapsed" in t.kinds()
    assert [m["content"] for m in t.forwarded["messages"]] == [
        "s",
        "fix the bug",
        "Which bug?",
        "the crash",
    ]


def test_collapse_is_opt_in(session: Session) -> None:
    msgs = [system("s"), user("again"), user("again")]
    assert session.look(make_chat(*msgs)).match.order == (0, 1, 2)


def test_collapse_never_touches_tool_groups_or_tool_calls(store: DictStore) -> None:
    collapsing = Session(store=store, policy=Policy(collapse_duplicates=True))
    a = assistant(None, call("c1", "search", {"query": "a"}))
    msgs = [user("go"), a, a, result("c1", "same"), result("c1", "same")]
    assert collapsing.look(make_chat(*msgs)).match.order == (0, 1, 2, 3, 4)


def test_collapse_keeps_a_repeat_the_store_holds(store: DictStore) -> None:
    plain = Session(store=store)
    msgs = [user("continue"), user("continue")]
    plain.turn(make_chat(*msgs), assistant("ok"))
    collapsing = Session(store=store, policy=Policy(collapse_duplicates=True))
    m = collapsing.look(make_chat(*msgs, assistant("ok"))).match
    assert m.order == (0, 1, 2)
    assert m.complete


def test_new_nodes_chain_the_forwarded_elements_and_the_reply(session: Session) -> None:
    body = make_chat(system("s"), user("hi"))
    reply = {"role": "assistant", "content": "Hello!\n", "refusal": None}
    t = session.turn(body, reply, partial=True)
    nodes = t.nodes
    assert [n.depth for n in nodes] == [0, 1, 2, 3]
    assert (
        nodes[0].body == b"[]" and nodes[0].role == ROLE_TOOLS and nodes[0].parent == session.root
    )
    assert nodes[1].body == orjson.dumps(body["messages"][0])
    assert all(child.parent == parent.key for parent, child in itertools.pairwise(nodes))
    assert all(n.tenant == session.root for n in nodes)
    assert all(n.tokens == count_tokens(n.body) for n in nodes)
    last = nodes[-1]
    assert last.generated and last.partial and last.body == orjson.dumps(reply)
    assert last.key == chain(nodes[2].key, message_identity(reply))
    assert not any(n.generated for n in nodes[:-1])


def test_new_nodes_only_below_the_matched_prefix(session: Session) -> None:
    session.turn(make_chat(user("hi")), assistant("yo"))
    t = session.turn(make_chat(user("hi"), assistant("yo"), user("next")), None)
    assert [n.depth for n in t.nodes] == [3]
    calls: list[bytes] = []

    def counting(body: bytes) -> int:
        calls.append(body)
        return 1

    m = session.look(make_chat(user("hi"), assistant("yo"), user("next"))).match
    assert (
        new_nodes(
            m,
            make_chat(user("hi"), assistant("yo"), user("next")),
            [],
            generated_partial=False,
            now=0.0,
            count_tokens=counting,
        )
        == []
    )
    assert calls == []


def test_new_nodes_record_a_permuted_group_in_forwarded_order(session: Session) -> None:
    msgs = _history_with_group()
    session.turn(make_chat(*msgs[:3]), None)
    store_size = len(session.store.nodes)
    # The first time the results arrive, their order is what the provider sees.
    t = session.turn(make_chat(*msgs[:3], msgs[4], msgs[3], msgs[5]), assistant("ok"))
    assert len(session.store.nodes) == store_size + 4
    assert [orjson.loads(n.body).get("tool_call_id") for n in t.nodes[:3]] == ["c2", "c1", "c3"]


def test_match_uses_store_get_once_per_element_on_a_linear_history(store: DictStore) -> None:
    s = Session(store=store)
    msgs = agent_history(turns=5)
    s.turn(make_chat(*msgs), assistant("next"))
    store.lookups = 0
    m = match_request(make_chat(*msgs, assistant("next")), s.root, store, s.policy)
    assert m.complete
    assert store.lookups == len(m.keys)
