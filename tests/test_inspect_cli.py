"""``kvwarm sessions / show / export / import``: through ``inspect_cli.run``, on real sqlite stores.

The round trips run a drifting agent through kvwarm, export its sessions with the CLI,
import them into a fresh store, start a new kvwarm on that store and check the next
drifted turn is repaired exactly as it would have been without the move.
``run`` calls ``asyncio.run``, so async tests call it from a worker thread.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sqlite3
import threading
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.config import Settings, load_settings
from proxy.core import transcript_md
from proxy.core.identity import message_identity, tools_identity
from proxy.core.match import chain, tenant_root
from proxy.errors import TranscriptFormatError
from proxy.ops import inspect_cli, sessions
from proxy.sim.render import render_tokens
from proxy.store.base import Node, SessionTotals
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.store.sqlite.store import SqliteStore
from proxy.store.tokens import LATER, TokenCounter
from tests.agents import Agent, args_keys_reordered, tools_reordered
from tests.conftest import ProxyFactory, poster, received

SECRET = "shared-server-secret"


def drift(msgs: Any, tools: Any, turn: int) -> Any:
    """Tools in another order and argument keys reshuffled, every turn: both cost cache upstream."""
    msgs, tools = tools_reordered(msgs, tools, turn)
    return args_keys_reordered(msgs, tools, turn)




def cli_settings(db: Path, secret: str = "") -> Settings:
    return load_settings(None, env={}, overrides={"store.backend": f"sqlite:{db}", "store.secret": secret})


def cli(name: str, settings: Settings, **args: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = inspect_cli.run(name, argparse.Namespace(**args), settings, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


async def acli(name: str, settings: Settings, **args: Any) -> tuple[int, str, str]:
    return await asyncio.to_thread(cli, name, settings, **args)


def prefix_header(turn: Any) -> dict[str, int]:
    header = turn.response["_headers"]["x-kvwarm-prefix"]
    parts = dict(p.split("=", 1) for p in header.split("; "))
    return {"matched": int(parts["matched"].split("/")[0]), "repaired": int(parts["repaired"])}


def last_rendered(sim: TestServer) -> list[int]:
    body = orjson.loads(received(sim)[-1].body)
    return render_tokens(body["messages"], body.get("tools"))


async def drifted_history(make_sim: Any, make_proxy: ProxyFactory, db: Path, secret: str) -> tuple[Agent, TestServer, list[int]]:
    """Three drifting turns through kvwarm on ``db``, stopped; and what a never-drifting
    client's fourth request renders to (the form kvwarm must forward after the move)."""
    sim = await make_sim()
    first = await make_proxy(sim, store__backend=f"sqlite:{db}", store__secret=secret)
    agent = Agent(poster(first), drift=drift)
    await agent.run(3)
    await first.close()  # flushes the store: the export reads the file
    clean_sim = await make_sim()
    await Agent(poster(clean_sim)).run(4)
    return agent, sim, last_rendered(clean_sim)


async def test_export_import_keeps_repairing_under_the_same_secret(
    make_sim: Any, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    agent, sim, clean_fourth = await drifted_history(make_sim, make_proxy, tmp_path / "a.db", SECRET)
    status, out, err = await acli("export", cli_settings(tmp_path / "a.db", SECRET), dir=str(tmp_path / "export"))
    assert status == 0, err
    (exported,) = out.split()
    assert Path(exported).parent == tmp_path / "export"

    fresh = cli_settings(tmp_path / "b.db", SECRET)
    status, out, err = await acli("import", fresh, dir=str(tmp_path / "export"), tenant_key=None)
    assert status == 0, err
    assert ": imported: session " in out

    # Control: the same drifted request to a kvwarm that never saw the session.
    control_sim = await make_sim()
    control = await make_proxy(control_sim, store__backend=f"sqlite:{tmp_path / 'c.db'}", store__secret=SECRET)
    control_turn = await poster(control)(agent.next_request())
    assert "repaired=0" in control_turn["_headers"]["x-kvwarm-prefix"]
    assert last_rendered(control_sim) != clean_fourth

    second = await make_proxy(sim, store__backend=f"sqlite:{tmp_path / 'b.db'}", store__secret=SECRET)
    agent.post = poster(second)
    turn = await agent.step()
    seen = prefix_header(turn)
    assert seen["repaired"] > 0 and seen["matched"] == turn.resent
    assert last_rendered(sim) == clean_fourth  # the upstream received the stored form
    assert turn.cached > 0


async def test_show_and_export_count_what_kvwarm_stored_uncounted_and_leave_the_file(
    make_sim: Any, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    db = tmp_path / "a.db"
    await drifted_history(make_sim, make_proxy, db, SECRET)
    before = tokens_in(db)
    assert LATER in before.values(), "kvwarm stores small nodes uncounted"
    settings = cli_settings(db, SECRET)
    status, out, _ = await acli("sessions", settings)
    sid = out.splitlines()[1].split()[0]
    counter = TokenCounter()

    status, js, err = await acli("show", settings, session=sid, format="json")
    assert status == 0, err
    elements = orjson.loads(js)["elements"]
    assert [e["tokens"] for e in elements] == [counter.count_body(orjson.dumps(e["body"])) for e in elements]
    status, md, err = await acli("show", settings, session=sid, format="md")
    assert status == 0, err
    shown = transcript_md.parse(md.encode())
    assert [n.tokens for n in shown.nodes] == [counter.count_body(n.body) for n in shown.nodes]

    status, out, err = await acli("export", settings, dir=str(tmp_path / "export"))
    assert status == 0, err
    (exported,) = out.split()
    assert transcript_md.parse(await asyncio.to_thread(Path(exported).read_bytes)).nodes == shown.nodes
    assert tokens_in(db) == before, "a reading command never writes the server's file"


def tokens_in(db: Path) -> dict[bytes, int]:
    with closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT key, tokens FROM nodes").fetchall())


async def test_import_with_a_tenant_key_into_a_store_with_another_secret(
    make_sim: Any, make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    # No configured secret: each sqlite store generates its own, as a fresh install does.
    agent, sim, clean_fourth = await drifted_history(make_sim, make_proxy, tmp_path / "a.db", "")
    status, _, err = await acli("export", cli_settings(tmp_path / "a.db"), dir=str(tmp_path / "export"))
    assert status == 0, err

    # Without a tenant key the sessions would be stored where no request can match them: refused.
    status, out, err = await acli("import", cli_settings(tmp_path / "e.db"), dir=str(tmp_path / "export"), tenant_key=None)
    assert status == 1 and "another server secret" in err and out == ""
    status, out, _ = await acli("sessions", cli_settings(tmp_path / "e.db"))
    assert out.count("\n") == 1  # the table's head only

    status, out, err = await acli("import", cli_settings(tmp_path / "d.db"), dir=str(tmp_path / "export"), tenant_key="sk-alice")
    assert status == 0, err
    assert (tmp_path / "d.db.secret").read_bytes() != (tmp_path / "a.db.secret").read_bytes()

    second = await make_proxy(sim, store__backend=f"sqlite:{tmp_path / 'd.db'}")
    agent.post = poster(second)
    turn = await agent.step()
    seen = prefix_header(turn)
    assert seen["repaired"] > 0 and seen["matched"] == turn.resent
    assert last_rendered(sim) == clean_fourth
    # Another key does not reach the imported session.
    other = await poster(second, key="sk-bob")(agent.next_request())
    assert "matched=0/" in other["_headers"]["x-kvwarm-prefix"]


# -- built stores: listing, malformed files, concurrency -----------------------------------------


def session_nodes(root: bytes, text: str, turns: int = 2) -> tuple[list[Node], SessionTotals]:
    elements: list[Any] = [[{"type": "function", "function": {"name": "f"}}], {"role": "system", "content": "sys"}]
    for i in range(turns):
        elements += [{"role": "user", "content": f"{text} {i}"}, {"role": "assistant", "content": f"reply {i}\n"}]
    nodes, parent = [], root
    for depth, e in enumerate(elements):
        identity = tools_identity(e) if depth == 0 else message_identity(e)
        key = chain(parent, identity)
        nodes.append(Node(key=key, parent=parent, tenant=root, depth=depth, role="tools" if depth == 0 else e["role"],
                          identity=identity, body=orjson.dumps(e), tokens=3, generated=e.get("role") == "assistant"
                          if isinstance(e, dict) else False, created=1_700_000_000.0 + depth))
        parent = key
    totals = SessionTotals(turns=turns, prompt_tokens=100 * turns, cached_tokens=50, completion_tokens=9, cost_usd=0.01,
                           model="gpt-4o", created=1_700_000_000.0, updated=1_700_000_050.0)
    return nodes, totals


def filled_store(secret: bytes, count: int) -> MemoryStore:
    store = MemoryStore(3600.0, 1 << 30, secret)
    root = tenant_root(secret, "Bearer sk-alice")
    for i in range(count):
        nodes, totals = session_nodes(root, f"question {i}")
        store.insert(nodes)
        store.add_turn(nodes[-1].key, None, totals)
    return store


def test_concurrent_exports_write_distinct_complete_files(tmp_path: Path) -> None:
    store = filled_store(b"x" * 32, 6)
    threads, barrier, errors = 8, threading.Barrier(8), []

    def export() -> None:
        try:
            barrier.wait()
            asyncio.run(sessions.export_sessions(LocalStore(store), tmp_path))
        except Exception as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=export) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    files = sorted(tmp_path.glob("*.md"))
    assert len(files) == threads * 6
    ids = Counter(transcript_md.parse(f.read_bytes()).session.hex() for f in files)  # each complete
    assert set(ids.values()) == {threads} and len(ids) == 6


def test_export_never_overwrites(tmp_path: Path) -> None:
    store = filled_store(b"x" * 32, 1)
    (info,) = store.sessions()
    taken = tmp_path / f"{info.leaf.hex()[:16]}_1.md"
    taken.write_text("someone else's file")
    report = asyncio.run(sessions.export_sessions(LocalStore(store), tmp_path))
    assert report.written == [tmp_path / f"{info.leaf.hex()[:16]}_2.md"]
    assert taken.read_text() == "someone else's file"


def corrupt(text: str, kind: str) -> str:
    lines = text.split("\n")
    opens = [i for i, line in enumerate(lines) if line.startswith(transcript_md.ELEMENT_OPEN)]
    if kind == "bad_header":
        return text.replace("turn_count: 2", "turn_count: two")
    if kind == "unterminated":
        del lines[opens[3] + 2]
    elif kind == "bad_role":
        lines[opens[2]] = lines[opens[2]].replace("role=user", "role=assistant")
    elif kind == "bad_escape":
        lines[opens[3] + 1] += "%G0"
    elif kind == "truncated":
        lines = lines[: opens[-1] + 2]
    return "\n".join(lines)


MALFORMED = ["bad_header", "unterminated", "bad_role", "bad_escape", "truncated"]


async def test_malformed_files_are_refused_whole_and_the_rest_import(tmp_path: Path) -> None:
    source = tmp_path / "a.db"
    # Fill the source store with 6 sessions, export them, then break 5 of the files, one way each.
    store_settings = cli_settings(source, SECRET)

    async def fill() -> None:
        store = SqliteStore(source, 3600.0, 1 << 30, SECRET.encode())
        await store.open()
        root = tenant_root(store.secret(), "Bearer sk-alice")
        for i in range(6):
            nodes, totals = session_nodes(root, f"question {i}")
            store.insert(nodes)
            store.add_turn(nodes[-1].key, None, totals)
        await store.close()

    await fill()
    status, out, err = await acli("export", store_settings, dir=str(tmp_path / "export"))
    assert status == 0, err
    files = [Path(p) for p in out.split()]
    kinds = MALFORMED
    expected_lines = {}
    for path, kind in zip(files, kinds, strict=False):
        text = path.read_text()
        broken = corrupt(text, kind)
        assert broken != text
        path.write_text(broken)
        with pytest.raises(TranscriptFormatError) as info:
            transcript_md.parse(broken)
        expected_lines[path] = info.value.line
    good = files[len(kinds)]

    target = cli_settings(tmp_path / "b.db", SECRET)
    status, out, err = await acli("import", target, dir=str(tmp_path / "export"), tenant_key=None)
    assert status == 1
    assert out.count(": imported: ") == 1 and str(good) in out
    for path, line in expected_lines.items():
        assert f"{path}: line {line}: " in err
    assert "5 files refused" in err

    check = SqliteStore(tmp_path / "b.db", 3600.0, 1 << 30, SECRET.encode())
    await check.open()
    try:
        (only,) = check.sessions()
        assert only.leaf.hex() == transcript_md.parse(good.read_bytes()).session.hex()
        # Nothing of the refused files: the good session's nodes are all the store holds.
        assert check.stats().nodes == len(check.path(only.leaf))
    finally:
        await check.close()


async def test_sessions_show_and_idempotent_import(tmp_path: Path) -> None:
    db = tmp_path / "a.db"

    async def fill() -> tuple[str, SessionTotals]:
        store = SqliteStore(db, 3600.0, 1 << 30, SECRET.encode())
        await store.open()
        nodes, totals = session_nodes(tenant_root(store.secret(), "Bearer sk-alice"), "hello -->\n%", turns=3)
        store.insert(nodes)
        store.add_turn(nodes[-1].key, None, totals)
        await store.close()
        return nodes[-1].key.hex(), totals

    sid, totals = await fill()
    s = cli_settings(db, SECRET)
    status, out, _ = await acli("sessions", s)
    head, row = out.splitlines()
    assert head.split()[:3] == ["SESSION", "MODEL", "TURNS"] and row.split()[:3] == [sid, "gpt-4o", "3"]
    assert "50.0%" not in row and "16.7%" in row  # 50 cached of 300 prompt tokens

    status, md, _ = await acli("show", s, session=sid[:6], format="md")
    assert status == 0 and transcript_md.parse(md).session.hex() == sid
    status, js, _ = await acli("show", s, session=sid, format="json")
    assert status == 0 and orjson.loads(js)["id"] == sid
    status, _, err = await acli("show", s, session="ffff", format="md")
    assert status == 1 and "no session" in err

    export = tmp_path / "export"
    assert (await acli("export", s, dir=str(export)))[0] == 0
    assert (await acli("export", s, dir=str(export)))[0] == 0  # the same session twice
    target = cli_settings(tmp_path / "b.db", SECRET)
    status, out, err = await acli("import", target, dir=str(export), tenant_key=None)
    assert status == 0 and out.count(": imported: ") == 1 and out.count(": already present: ") == 1
    status, out, err = await acli("import", target, dir=str(export), tenant_key=None)
    assert status == 0 and out.count(": already present: ") == 2
    status, js, _ = await acli("show", target, session=sid, format="json")
    shown = orjson.loads(js)
    assert (shown["turns"], shown["prompt_tokens"], shown["cost_usd"]) == (totals.turns, totals.prompt_tokens, totals.cost_usd)
