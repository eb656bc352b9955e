"""Responses API agents that drift keep the upstream's cache as warm through kvwarm as agents that never drift.

Each safe drift class with a Responses analogue (``tests/responses/agents.py``) runs as a
multi-request tool-using conversation in both cache modes of the reference upstream. The
reference is the same agent without drift talking to the upstream directly: the prompts the
upstream renders from what kvwarm forwarded must be token-identical to the reference's, so
``cached_tokens`` is too (at least 99.5 % of it is the bar). The same drifting agent without
kvwarm shows that each drift really costs cache where it changes the tokens.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import PIPELINE
from proxy.sim.items import assistant_message
from proxy.sim.render import encode_segments, reply_segments
from tests.conftest import ProxyFactory, metric, received
from tests.responses.agents import (
    INSTRUCTIONS,
    PARALLEL,
    SAFE_DRIFTS,
    USER_TURNS,
    Items,
    ResponsesAgent,
    Tools,
    Turn,
    args_python_dumps,
    no_drift,
    poster,
    render_request,
    tools_reordered,
)

REQUESTS = 6
"""Three user turns: each is a request answered with function calls, then one carrying their outputs."""
TOKEN_NEUTRAL = {"content_as_parts", "null_fields", "ids_regenerated"}
"""Drifts the upstream does not render (string vs one text part, empty fields, item ids): they cost
nothing even without kvwarm."""
COSTS_PROMPT_CACHE = {
    "tools_reordered", "schema_keys_shuffled", "args_keys_reordered", "tool_outputs_reordered", "resumed",
}
"""Drifts that vary between requests (or switch once): they cost a prompt-only (OpenAI-style) cache
too. The others re-serialize an echoed reply the same way every time: they cost only an engine that
caches what it generated (vLLM mode)."""
MIN_RATIO = 0.995


def rendered(sim: TestServer) -> list[list[int]]:
    return [render_request(orjson.loads(r.body)) for r in received(sim)]


def cached(turns: list[Turn]) -> int:
    return sum(t.cached for t in turns)


def repaired(turn: Turn) -> int:
    return int(turn.prefix()["repaired"])


@pytest.mark.parametrize("mode", ["openai", "vllm"])
@pytest.mark.parametrize("drift_name", sorted(SAFE_DRIFTS))
async def test_safe_drift_is_repaired(make_sim: Any, make_proxy: ProxyFactory, mode: str, drift_name: str) -> None:
    drift = SAFE_DRIFTS[drift_name]
    parallel = drift_name in PARALLEL
    clean_sim, kv_sim, raw_sim = [await make_sim(cache_mode=mode) for _ in range(3)]
    kvwarm = await make_proxy(kv_sim)

    clean = await ResponsesAgent(poster(clean_sim), parallel=parallel).run(REQUESTS)
    warm = await ResponsesAgent(poster(kvwarm), drift=drift, parallel=parallel).run(REQUESTS)
    cold = await ResponsesAgent(poster(raw_sim), drift=drift, parallel=parallel).run(REQUESTS)

    # The upstream behind kvwarm saw exactly the prompts a never-drifting client sends ...
    assert rendered(kv_sim) == rendered(clean_sim)
    # ... so it gets the reference's cache.
    assert cached(clean) > 0
    assert cached(warm) >= MIN_RATIO * cached(clean)
    assert [t.cached for t in warm] == [t.cached for t in clean]
    if parallel:
        assert all(len(t.response["output"]) == 2 for t in clean[::2]), "the upstream made parallel calls"
    # Every re-sent item was recognised: nothing broke, the whole re-sent prefix matched.
    for t in warm[1:]:
        assert "break" not in t.prefix(), t.prefix()
        assert t.prefix()["matched"].startswith(f"{t.resent + 1}/"), (t.resent, t.prefix())

    # Without kvwarm: the upstream's template is the arbiter of what the drift costs.
    drifted = [render_request(o.request) != render_request(c.request) for o, c in zip(cold, clean, strict=True)]
    sent_drifted = [render_request(w.request) != render_request(c.request) for w, c in zip(warm, clean, strict=True)]
    if drift_name in TOKEN_NEUTRAL:
        # The upstream renders both forms the same: no cost without kvwarm, nothing to repair.
        assert not any(drifted) and not any(sent_drifted)
        assert [t.cached for t in cold] == [t.cached for t in clean]
        assert sum(map(repaired, warm)) == 0
        assert any(o.request["input"] != c.request["input"] for o, c in zip(cold, clean, strict=True))
        return
    assert any(drifted)
    # The drifting agent through kvwarm sent such requests too: there was something to repair, and kvwarm did.
    assert any(sent_drifted)
    assert sum(map(repaired, warm)) > 0
    # A client that never drifts re-sends every token the upstream computed (its prompt, and in vLLM
    # mode its reply); the drifting one makes it recompute some.
    assert lost_tokens(clean, mode) == 0
    if mode == "vllm" or drift_name in COSTS_PROMPT_CACHE:
        assert lost_tokens(cold, mode) > 0, "this drift should cost cache without kvwarm"
    else:
        # A prompt-only cache never held the echoed reply: a consistent re-serialization of it costs nothing.
        assert lost_tokens(cold, mode) == 0


def reply_tokens(response: dict[str, Any]) -> list[int]:
    """The generated turn's tokens as the upstream's template renders it (what vLLM mode keeps)."""
    output = response["output"]
    texts = [p["text"] for item in output if item["type"] == "message" for p in item["content"]]
    calls = [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]
    return encode_segments(reply_segments(assistant_message(None, "\n\n".join(texts) if texts else None, calls)))


def lost_tokens(turns: list[Turn], mode: str) -> int:
    """Tokens the upstream had computed (request ``i - 1``'s prompt, and in vLLM mode the reply it
    generated) that request ``i`` did not re-send as they were, summed over the requests.

    Token-exact, where ``cached_tokens`` counts whole blocks (a lost trailing newline may cost no block)."""
    lost = 0
    for i in range(1, len(turns)):
        seen = render_request(turns[i - 1].request)
        if mode == "vllm":
            seen += reply_tokens(turns[i - 1].response)
        now = render_request(turns[i].request)
        same = next((n for n, (a, b) in enumerate(zip(now, seen, strict=False)) if a != b), min(len(now), len(seen)))
        lost += len(seen) - same
    return lost


@pytest.mark.parametrize("mode", ["openai", "vllm"])
async def test_no_drift_is_forwarded_byte_identical(make_sim: Any, make_proxy: ProxyFactory, mode: str) -> None:
    sim = await make_sim(cache_mode=mode)
    kvwarm = await make_proxy(sim)
    agent = ResponsesAgent(poster(kvwarm), drift=no_drift, parallel=True)
    await agent.run(4)
    bodies = [r.body for r in received(sim)]
    assert bodies == [orjson.dumps(t.request) for t in agent.turns]
    for turn in agent.turns:
        assert turn.prefix()["repaired"] == "0"
        n = 1 + len(turn.request["input"])
        assert turn.prefix()["matched"] == f"{turn.resent + 1 if turn.resent else 0}/{n}"
    assert agent.turns[-1].cached > 0


def python_dumps(body: Any) -> bytes:
    """A Python client's serializer: indented, every non-ASCII character as a ``\\u`` escape."""
    return json.dumps(body, indent=1).encode()


async def test_a_repair_changes_only_the_repaired_values(make_sim: Any, make_proxy: ProxyFactory) -> None:
    sim = await make_sim()
    kvwarm = await make_proxy(sim)
    turns = ["Où est la clé du cache ? ☕", *USER_TURNS[1:]]
    agent = ResponsesAgent(poster(kvwarm, dumps=python_dumps), drift=both_drifts, user_turns=turns)
    await agent.run(3)
    client, forwarded = python_dumps(agent.turns[-1].request), received(sim)[-1].body
    assert repaired(agent.turns[-1]) > 0 and forwarded != client
    lines, sent = client.split(b"\n"), forwarded.split(b"\n")
    # Up to the tools array, line for line, only the restored argument strings differ ...
    tools = lines.index(b' "tools": [')
    changed = [i for i in range(tools) if lines[i] != sent[i]]
    assert changed and all(lines[i].lstrip().startswith(b'"arguments": ') for i in changed)
    assert b"\\u2615" in client and b"\\u2615" in forwarded and "\u2615".encode() not in forwarded  # escapes kept
    # ... the tools array is the stored one (the value only: the bytes around it are the client's) ...
    assert sent[tools].startswith(b' "tools": [{') and sent[tools].endswith(b"],")
    assert orjson.loads(sent[tools][len(b' "tools": '):-1]) == agent.tools
    # ... and the rest is the client's.
    assert sent[tools + 1:] == lines[lines.index(b" ],", tools) + 1:]


def both_drifts(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    items, tools = tools_reordered(items, tools, turn)
    return args_python_dumps(items, tools, turn)


async def test_a_repair_that_cannot_be_spliced_is_forwarded_as_sent(make_sim: Any, make_proxy: ProxyFactory) -> None:
    sim = await make_sim()
    kvwarm = await make_proxy(sim)

    def duplicate_status(body: Any) -> bytes:
        # A client whose function_call items carry "status" twice: which one a parser keeps is its own
        # business, so kvwarm cannot edit that item's arguments and keep the rest meaning the same.
        return orjson.dumps(body).replace(b'{"id":"fc_', b'{"status":null,"id":"fc_')

    agent = ResponsesAgent(poster(kvwarm, dumps=duplicate_status), drift=args_python_dumps)
    await agent.run(3)
    assert any(b'"status":null,"id":"fc_' in r.body for r in received(sim))
    for turn, got in zip(agent.turns, received(sim), strict=True):
        assert got.body == duplicate_status(turn.request)  # exactly the client's bytes
        assert repaired(turn) == 0
    assert metric(kvwarm, "kvwarm_repairs_refused_total", reason="duplicate_key") >= 1
    # Recorded as sent: the next request, drifted the same way, matches all of it.
    assert all("break" not in t.prefix() for t in agent.turns[1:])


async def test_instructions_and_a_string_input_are_restored(make_sim: Any, make_proxy: ProxyFactory) -> None:
    sim = await make_sim()
    kvwarm = await make_proxy(sim)
    post = poster(kvwarm)
    first = {"model": "kvwarm-sim", "instructions": INSTRUCTIONS + "\n", "input": "Summarise the repo.\n", "store": False}
    await post(first, {})
    # The same request from a client that trims its texts.
    again = {**first, "instructions": INSTRUCTIONS, "input": "Summarise the repo."}
    response = await post(again, {})
    assert response["_headers"]["x-kvwarm-prefix"].startswith("matched=2/2; repaired=2; ")
    assert received(sim)[-1].body == received(sim)[0].body  # both strings restored in place
    assert response["usage"]["input_tokens_details"]["cached_tokens"] > 0


async def test_a_resent_conversation_is_planned_from_the_previous_turn(make_sim: Any, make_proxy: ProxyFactory) -> None:
    """In the server, each re-sent body is rebuilt from the tenant's previous one (only its new items
    parsed), its view takes the previous view's messages over, and from the third request on the
    match starts where the previous one ended: with a reasoning client, parallel calls and the
    reference upstream's stream, as the Codex CLI talks."""
    sim = await make_sim()
    kvwarm = await make_proxy(sim)
    pipeline = kvwarm.app[PIPELINE]
    recalls: list[Any] = []
    plans: list[Any] = []
    plan = pipeline.plan

    class Recalling:  # the pipeline's prefix memo, its recalls listed (a compiled one takes no patch)
        def __init__(self, memo: Any) -> None:
            self.memo = memo

        def recall(self, scope: Any, raw: bytes) -> Any:
            recalls.append(self.memo.recall(scope, raw))
            return recalls[-1]

        def __getattr__(self, name: str) -> Any:
            return getattr(self.memo, name)

    async def planning(turn: Any) -> None:
        await plan(turn)
        plans.append(turn.plan)

    pipeline.parser.resent = Recalling(pipeline.parser.resent)
    pipeline.plan = planning  # type: ignore[method-assign]
    agent = ResponsesAgent(poster(kvwarm), drift=no_drift, parallel=True, reasoning=True)
    await agent.run(6)
    assert recalls[0] is None and all(r is not None for r in recalls[1:])
    views = [p.view for p in plans]
    assert all(v is not None for v in views)
    assert views[0].reused == 0 and all(v.reused > 0 for v in views[1:])
    assert all(p.match.clean > 0 for p in plans[2:])
    assert [r.body for r in received(sim)] == [orjson.dumps(t.request) for t in agent.turns]

    # The same conversation through a kvwarm that parses and plans every body whole: the same answers.
    whole_sim = await make_sim()
    whole = await make_proxy(whole_sim)
    class Forgetting(Recalling):  # remembers, never recalls: every body parsed and planned whole
        def recall(self, scope: Any, raw: bytes) -> Any:
            return None

    whole.app[PIPELINE].parser.resent = Forgetting(whole.app[PIPELINE].parser.resent)
    reference = ResponsesAgent(poster(whole), drift=no_drift, parallel=True, reasoning=True)
    await reference.run(6)
    assert [len(t.request["input"]) for t in agent.turns] == [len(t.request["input"]) for t in reference.turns]
    assert [t.prefix() for t in agent.turns] == [t.prefix() for t in reference.turns]
    assert all(t.prefix()["repaired"] == "0" and "break" not in t.prefix() for t in agent.turns)
