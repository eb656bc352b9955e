"""A Messages API session survives a Markdown export and import exactly, and keeps being repaired.

The session holds what a Claude Code-like agent produces through the ``anthropic`` SDK: a system
prompt, user messages, signed thinking blocks, parallel tool uses and their results, text
replies; and the agent drifts (tools in another order, tool inputs with their keys reordered).
Exported with ``kvwarm export``, the transcript reads back to the same nodes and renders to the
same text; imported with ``kvwarm import`` into a new store (same server secret), it makes a new
kvwarm repair the agent's next request as the first one would have: the upstream receives what
a never-drifting client sends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from proxy.core import transcript_md
from proxy.core.policy import Policy
from proxy.wire.messages_view import messages_view
from tests.conftest import ProxyFactory, received
from tests.messages.agents import (
    Messages,
    MessagesAgent,
    Tools,
    input_keys_reordered,
    rendered,
    tools_reordered,
)
from tests.messages.conftest import Clients
from tests.responses.test_transcripts import cli, cli_settings, get, only_session

SECRET = "responses-shared-secret"  # the one tests.responses.test_transcripts.cli_settings uses
REQUESTS = 4


def drift(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    messages, system, tools = tools_reordered(messages, system, tools, turn)
    return input_keys_reordered(messages, system, tools, turn)


async def test_a_messages_session_round_trips_through_markdown(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients, tmp_path: Path
) -> None:
    options: dict[str, Any] = {"thinking": True, "parallel": True}
    sim = await make_sim(cache_mode="vllm")
    first = await make_proxy(sim, store__backend=f"sqlite:{tmp_path / 'a.db'}", store__secret=SECRET)
    agent = MessagesAgent(clients(first), drift=drift, **options)
    await agent.run(REQUESTS)
    assert sum(int(t.prefix()["repaired"]) for t in agent.turns) > 0
    session = await only_session(first)
    shown = await get(first, f"/kvwarm/sessions/{session}.md")
    await first.close()  # flushes the store: the export reads the file

    status, out, err = await cli("export", cli_settings(tmp_path / "a.db"), dir=str(tmp_path / "export"))
    assert status == 0, err
    (exported,) = (Path(p) for p in out.split())
    text = exported.read_bytes()
    assert text == shown

    transcript = transcript_md.parse(text, Policy())
    assert transcript.session.hex() == session
    assert transcript_md.render(transcript).encode() == text
    bodies = [orjson.loads(n.body) for n in transcript.nodes]
    assert [n.role for n in transcript.nodes][:3] == ["tools", "system", "user"]
    assert any("thinking_blocks" in b for b in bodies[1:]), "the signed thinking is in the transcript"
    assert any(len(b.get("tool_calls") or ()) == 2 for b in bodies[1:]), "the parallel tool uses too"
    assert sum(1 for n in transcript.nodes if n.generated) >= REQUESTS

    status, out, err = await cli("import", cli_settings(tmp_path / "b.db"), dir=str(tmp_path / "export"), tenant_key=None)
    assert status == 0, err

    # What a never-drifting client sends next: the reference for the forwarded request.
    clean_sim = await make_sim(cache_mode="vllm")
    await MessagesAgent(clients(clean_sim), **options).run(REQUESTS + 1)
    clean_next = rendered(orjson.loads(received(clean_sim)[-1].body))

    second = await make_proxy(sim, store__backend=f"sqlite:{tmp_path / 'b.db'}", store__secret=SECRET)
    assert await get(second, f"/kvwarm/sessions/{session}.md") == text
    agent.client = clients(second)
    turn = await agent.step()
    fields = turn.prefix()
    assert int(fields["repaired"]) > 0 and "break" not in fields
    # Every element an earlier request or response carried (the system, and the view elements of the
    # re-sent messages: one per tool result) is matched.
    sent = orjson.loads(received(sim)[-1].body)
    view = messages_view(sent["system"], sent["messages"], {})
    carried = sum(1 for span in view.spans if span[0] < turn.resent)
    assert fields["matched"] == f"{carried}/{len(view.messages)}"
    assert rendered(orjson.loads(received(sim)[-1].body)) == clean_next  # the stored form went upstream
    assert turn.cached > 0
