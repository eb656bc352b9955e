"""The breakpoint planner (proxy/core/breakpoints.py) on trees the production planner builds.

Pure: no sockets. ``Session`` (tests/core/factories.py) plans and records turns into a dict
store; the elements are chat's (proxy/wire/cache_marks.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.breakpoints import (
    AUTO_OPENAI,
    AUTO_OPENROUTER,
    CACHE_CONTROL,
    CONTINUATION,
    HEAD,
    OFF,
    OPENAI,
    PREVIOUS,
    STEM,
    ClientMarks,
    Mark,
    Tree,
    choose,
    dialect_of,
    host_rule,
    reads_ours,
    tree_facts,
)
from proxy.core.plan import TurnPlan
from proxy.wire.cache_marks import ChatElements
from tests.core.factories import TOOLS, Session, assistant, call, make_chat, result, system, user

STABLE = system("You are a careful agent. " * 200)
"""About 5 KB: above the 1024-byte floor."""


def facts(s: Session, body: dict[str, Any]) -> tuple[TurnPlan, Tree]:
    plan = s.look(body).planned
    assert plan is not None and plan.match is not None
    return plan, tree_facts(plan.match, s.store)


def marks(s: Session, body: dict[str, Any], dialect: str, client: ClientMarks | None = None) -> tuple[Mark, ...]:
    plan, tree = facts(s, body)
    assert plan.match is not None
    elements = ChatElements(plan.forwarded, dialect)
    return choose(dialect, elements, tree, plan.match, client or ClientMarks(), tools=bool(body.get("tools")))


def single_shot(s: Session, n: int, *, tools: bool = False) -> None:
    """``n`` finished single-shot tasks sharing the stable system prompt."""
    for i in range(n):
        s.turn(make_chat(STABLE, user(f"Task {i}: summarise file {i}."), tools=TOOLS if tools else None), assistant(f"Summary {i}."))


@pytest.mark.parametrize(
    ("setting", "url", "model", "dialect"),
    [
        ("auto", "https://api.openai.com/v1", "gpt-5.6", OPENAI),
        ("auto", "https://api.openai.com/v1", "gpt-5.10-mini", OPENAI),
        ("auto", "https://api.openai.com/v1", "gpt-6", OPENAI),
        ("auto", "https://api.openai.com/v1", "gpt-5.5", ""),
        ("auto", "https://api.openai.com/v1", "gpt-4o", ""),
        ("auto", "https://openrouter.ai/api/v1", "anthropic/claude-sonnet-4.5", CACHE_CONTROL),
        ("auto", "https://openrouter.ai/api/v1", "qwen/qwen3-coder", CACHE_CONTROL),
        ("auto", "https://openrouter.ai/api/v1", "openai/gpt-5.6", ""),
        ("auto", "https://dashscope-intl.aliyuncs.com/compatible-mode/v1", "qwen-max", CACHE_CONTROL),
        ("auto", "https://dashscope.aliyuncs.com/compatible-mode/v1", "qwen-plus", CACHE_CONTROL),
        ("auto", "http://127.0.0.1:8000/v1", "gpt-5.6", ""),
        ("openai", "http://127.0.0.1:8000/v1", "anything", OPENAI),
        ("cache_control", "http://127.0.0.1:8000/v1", "anything", CACHE_CONTROL),
        ("off", "https://api.openai.com/v1", "gpt-5.6", ""),
    ],
)
def test_auto_detects_the_common_providers_by_host_and_model(setting: str, url: str, model: str, dialect: str) -> None:
    assert dialect_of(host_rule(setting, url), model) == dialect


def test_host_rules() -> None:
    assert host_rule("auto", "https://api.openai.com/v1") == AUTO_OPENAI
    assert host_rule("auto", "https://openrouter.ai/api/v1") == AUTO_OPENROUTER
    assert host_rule("auto", "https://api.deepseek.com/v1") == OFF
    assert dialect_of(AUTO_OPENAI, None) == ""


def test_a_boundary_seen_once_is_not_a_stem() -> None:
    s = Session()
    _, tree = facts(s, make_chat(STABLE, user("Task 0.")))
    assert tree.stems == ()
    single_shot(s, 1)
    # The second task branches off the stored system prompt: two sessions share it.
    _, tree = facts(s, make_chat(STABLE, user("Task 1.")))
    assert tree.stems == (1,)
    assert tree.previous_end == -1
    assert marks(s, make_chat(STABLE, user("Task 1.")), OPENAI) == (Mark(depth=1, kind=STEM),)


def test_a_first_task_marks_its_system_prompt_where_that_is_free() -> None:
    """OpenAI's implicit breakpoint writes the whole prompt anyway: a marker inside it is free."""
    assert marks(Session(), make_chat(STABLE, user("Task 0.")), OPENAI) == (Mark(depth=1, kind=HEAD),)
    # cache_control without tools or evidence writes nothing: the system prompt would cost a write.
    assert marks(Session(), make_chat(STABLE, user("Task 0.")), CACHE_CONTROL) == ()


def test_the_deepest_shared_node_comes_first() -> None:
    """Subagents share the system prompt and a brief; other tasks share only the system prompt."""
    s = Session()
    brief = user("Brief: audit the repository. " * 40)
    for i in range(2):
        s.turn(make_chat(STABLE, brief, user(f"Part {i}.")), assistant(f"Done {i}."))
    s.turn(make_chat(STABLE, user("Another task.")), assistant("Done."))
    _, tree = facts(s, make_chat(STABLE, brief, user("Part 2.")))
    assert tree.stems == (2, 1)
    got = marks(s, make_chat(STABLE, brief, user("Part 2.")), CACHE_CONTROL)
    assert [m for m in got if m.kind == STEM] == [Mark(depth=2, kind=STEM), Mark(depth=1, kind=STEM)]


def test_a_continuing_session_knows_where_its_previous_turn_ended() -> None:
    s = Session()
    history = [STABLE, user("Fix the bug.")]
    reply = assistant(None, call("c1", "read_file", {"path": "a.py"}))
    s.turn(make_chat(*history, tools=TOOLS), reply)
    body = make_chat(*history, reply, result("c1", "print(1)"), tools=TOOLS)
    _, tree = facts(s, body)
    assert tree.previous_end == 2  # the user message: element 2 (0 = tools, 1 = system)
    assert marks(s, body, CACHE_CONTROL) == (Mark(depth=4, kind=CONTINUATION), Mark(depth=1, kind=HEAD))
    # The implicit breakpoint is the continuation.
    assert marks(s, body, OPENAI) == (Mark(depth=1, kind=HEAD),)


def test_continuation_on_a_first_turn_only_for_an_agent_with_tools() -> None:
    body_tools = make_chat(STABLE, user("Fix the bug."), tools=TOOLS)
    assert marks(Session(), body_tools, CACHE_CONTROL) == (Mark(depth=2, kind=CONTINUATION), Mark(depth=1, kind=HEAD))
    assert marks(Session(), make_chat(STABLE, user("Fix the bug.")), CACHE_CONTROL) == ()


def test_siblings_that_ended_after_one_reply_get_no_continuation() -> None:
    s = Session()
    single_shot(s, 3, tools=True)
    body = make_chat(STABLE, user("Task 9: summarise file 9."), tools=TOOLS)
    _, tree = facts(s, body)
    assert (tree.finished, tree.continued) == (3, 0)
    assert marks(s, body, CACHE_CONTROL) == (Mark(depth=1, kind=STEM),)


def test_siblings_that_went_on_make_a_first_turn_a_continuation() -> None:
    s = Session()
    for i in range(2):
        first = [STABLE, user(f"Job {i}.")]
        reply = assistant(None, call(f"c{i}", "read_file", {"path": f"{i}.py"}))
        s.turn(make_chat(*first), reply)
        s.turn(make_chat(*first, reply, result(f"c{i}", "x = 1")), assistant("Fixed."))
    body = make_chat(STABLE, user("Job 9."))
    _, tree = facts(s, body)
    assert (tree.finished, tree.continued) == (2, 2)
    assert marks(s, body, CACHE_CONTROL) == (Mark(depth=2, kind=CONTINUATION), Mark(depth=1, kind=STEM))


def test_never_on_assistant_output() -> None:
    """A prefill (a final assistant message) moves the continuation to the message before it."""
    body = make_chat(STABLE, user("Write a poem."), assistant("Roses are"), tools=TOOLS)
    assert marks(Session(), body, CACHE_CONTROL) == (Mark(depth=2, kind=CONTINUATION), Mark(depth=1, kind=HEAD))


def test_a_long_turn_marks_where_the_previous_one_ended() -> None:
    """More blocks than the provider looks back over since the previous turn's marker."""
    s = Session()
    history = [STABLE, user("Check every city.")]
    calls = [call(f"c{j}", "get_weather", {"city": f"City {j}"}) for j in range(12)]
    reply = assistant(None, *calls)
    s.turn(make_chat(*history, tools=TOOLS), reply)
    body = make_chat(*history, reply, *[result(f"c{j}", f"Sunny {j}") for j in range(12)], tools=TOOLS)
    # 12 tool calls + 12 results = 24 blocks after the user message (element 2).
    assert marks(s, body, CACHE_CONTROL) == (
        Mark(depth=15, kind=CONTINUATION), Mark(depth=2, kind=PREVIOUS), Mark(depth=1, kind=HEAD)
    )


@pytest.mark.parametrize(
    ("dialect", "client", "room"),
    [
        (OPENAI, ClientMarks(count=3), 0),
        (OPENAI, ClientMarks(count=2), 1),
        (OPENAI, ClientMarks(explicit_mode=True), 0),
        (CACHE_CONTROL, ClientMarks(count=4), 0),
        (CACHE_CONTROL, ClientMarks(count=3), 1),
        (CACHE_CONTROL, ClientMarks(count=3, automatic=True), 1),
    ],
)
def test_the_budget_counts_the_clients_markers(dialect: str, client: ClientMarks, room: int) -> None:
    s = Session()
    brief = user("Brief. " * 200)
    for i in range(2):
        s.turn(make_chat(STABLE, brief, user(f"Part {i}."), tools=TOOLS), assistant("ok"))
    s.turn(make_chat(STABLE, user("Other."), tools=TOOLS), assistant("ok"))
    got = marks(s, make_chat(STABLE, brief, user("Part 9."), tools=TOOLS), dialect, client)
    assert len(got) == room


def test_a_block_the_client_marked_is_not_marked_again() -> None:
    s = Session()
    single_shot(s, 1)
    marked = system(STABLE["content"], cache_control={"type": "ephemeral"})
    body = make_chat(marked, user("Task 1: summarise file 1."))
    assert marks(s, body, CACHE_CONTROL, ClientMarks(count=1)) == ()


def test_short_prefixes_are_not_marked() -> None:
    s = Session()
    for i in range(2):
        s.turn(make_chat(system("Be brief."), user(f"Q{i}")), assistant("A"))
    assert marks(s, make_chat(system("Be brief."), user("Q9")), OPENAI) == ()


def test_reads_are_kvwarms_only_where_nothing_else_could_have_written_them() -> None:
    s = Session()
    single_shot(s, 2)
    plan, _ = facts(s, make_chat(STABLE, user("Task 9.")))
    assert plan.match is not None
    assert reads_ours(OPENAI, ClientMarks(), plan.match)
    assert not reads_ours(OPENAI, ClientMarks(count=1), plan.match)
    assert reads_ours(CACHE_CONTROL, ClientMarks(), plan.match)
    assert not reads_ours(CACHE_CONTROL, ClientMarks(automatic=True), plan.match)
    # A second turn: its previous implicit breakpoint (a user message) is in the matched prefix.
    reply = assistant("Summary 0.")
    plan, _ = facts(s, make_chat(STABLE, user("Task 0: summarise file 0."), reply, user("More.")))
    assert plan.match is not None and plan.match.matched == 4
    assert not reads_ours(OPENAI, ClientMarks(), plan.match)


def test_tree_facts_stay_bounded_on_a_long_session() -> None:
    """Children lists are read for the first STEM_SCAN elements and the branch point only."""
    s = Session()
    messages: list[Any] = [STABLE]
    for i in range(150):
        messages += [user(f"Step {i}."), assistant(f"Done {i}.")]
    s.turn(make_chat(*messages), None)
    plan = s.look(make_chat(*messages, user("Next."))).planned
    assert plan is not None and plan.match is not None

    class Counting:
        calls = 0

        def children(self, key: bytes) -> Any:
            Counting.calls += 1
            return s.store.children(key)

        def get(self, key: bytes) -> Any:
            return s.store.get(key)

        def by_identity(self, tenant: bytes, identity: bytes) -> Any:
            return s.store.by_identity(tenant, identity)

    tree_facts(plan.match, Counting())
    assert Counting.calls <= 66
