"""Store flood: process memory against ``store.max_bytes`` under a flood of new sessions, and one huge request.

``python -m tests.bench.store_flood [--quick]`` prints a Markdown section (``run()`` returns it
for :mod:`tests.bench.run`).

Every case runs in a fresh interpreter, so a case's freed-but-kept heap never counts in the
next one; RSS is read from ``/proc/self/statm``. Nothing is timed.

- **Store flood**: N new sessions, each its own tenant, one turn each (tools, system, user,
  assistant, session totals), recorded the way the request path records them:
  ``plan_turn`` -> ``turn_write`` -> ``LocalStore.write_turn_now`` into a ``MemoryStore``
  (the identity memo off: it has its own table). Budgets: 8 MiB and 64 MiB (4 and 16 with
  ``--quick``), plus a baseline of 64 KiB, where the store holds almost nothing, which
  measures the driver's own memory and CPU in the same run; then the same with every
  session in one tenant (all under one system-prompt node). Reported: the peak of
  ``stats().bytes`` after any turn against the budget, the peak RSS growth, and the store
  write's CPU per turn against the baseline's; then ``RSS growth = factor x max_bytes +
  constant`` fitted on the two budgets.
- **Identity memo flood**: distinct short messages through ``identify_messages`` into a memo
  of 8 MiB and 64 MiB.
- **One huge request**: a 4 MB body of 100 000 tiny messages (30 000 with ``--quick``) through the same stages into a
  store and memo of the default sizes; tracemalloc's peak per stage (which allocations make
  the request's peak), then, without tracemalloc, the RSS peak and what is left after the
  request (and after ``malloc_trim``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson

from proxy.core.identity import IdentityMemo, identify_messages
from proxy.core.match import tenant_root
from proxy.core.plan import plan_turn, turn_write
from proxy.core.policy import Policy
from proxy.core.record import Reply
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from tests.agents import TOOLS
from tests.bench.report import Section, Table, us, x

MIB = 1024 * 1024
POLICY = Policy()
SECRET = b"bench-secret-bench-secret-bench!"
BUDGETS = (8 * MIB, 64 * MIB)
QUICK_BUDGETS = (4 * MIB, 16 * MIB)
BASELINE_BUDGET = 64 * 1024
SYSTEM = "You are a careful coding agent working in a repository. Keep changes small and run the tests."


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


def malloc_trim() -> bool:
    """Give glibc's free heap pages back to the system; False when not on glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


def _request(i: int) -> tuple[dict[str, Any], Reply]:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Session {i}: where is the cache key computed? Look in module m{i}."},
        ],
        "tools": TOOLS,
    }
    reply = Reply(message={"role": "assistant", "content": f"In m{i}.py, by key_{i}(): it hashes the prefix."},
                  finish_reason="stop", partial=False, model="m")
    return body, reply


def record(store: LocalStore, root: bytes, body: dict[str, Any], reply: Reply, memo: IdentityMemo | None,
           count: Callable[[bytes], int] = len) -> float:
    """What the pipeline does for one answered request (token counting by ``count``); returns
    the CPU seconds of the store write (insert, touch, session update, and any eviction)."""
    plan = plan_turn(body, root, store.view(), POLICY, memo)
    turn = turn_write(plan, reply, None, None, model="m", client_gone=False, now=time.time())
    if turn is None:
        raise AssertionError("a planned turn must be recorded")
    view = store.view()
    new = [replace(n, tokens=count(n.body)) for n in turn.nodes if view.get(n.key) is None]
    write = replace(turn, nodes=tuple(new))
    cpu = time.thread_time()
    store.write_turn_now(write)
    return time.thread_time() - cpu


# -- cases (each in its own interpreter) ----------------------------------------------------


def case_flood(budget: int, sessions: int, one_tenant: bool) -> dict[str, Any]:
    gc.collect()
    start = rss()
    store = MemoryStore(24 * 3600, budget, secret=SECRET)
    local = LocalStore(store)
    peak_rss = peak_bytes = 0
    cpu = time.thread_time()
    writes = 0.0
    for i in range(sessions):
        body, reply = _request(i)
        writes += record(local, tenant_root(SECRET, "Bearer sk-one" if one_tenant else f"Bearer sk-{i}"), body, reply, None)
        peak_bytes = max(peak_bytes, store.stats().bytes)
        if i % 200 == 0:
            peak_rss = max(peak_rss, rss() - start)
    cpu = time.thread_time() - cpu
    peak_rss = max(peak_rss, rss() - start)
    stats = store.stats()
    return {"budget": budget, "sessions": sessions, "peak_bytes": peak_bytes, "bytes": stats.bytes,
            "nodes": stats.nodes, "evicted": stats.evicted, "peak_rss": peak_rss, "cpu_per_turn": cpu / sessions,
            "write_per_turn": writes / sessions}


def case_memo(budget: int, messages: int) -> dict[str, Any]:
    gc.collect()
    start = rss()
    memo = IdentityMemo(max_bytes=budget)
    peak_rss = 0
    for batch in range(0, messages, 5_000):
        msgs = [{"role": "user", "content": f"message {batch + i}: a short one"} for i in range(5_000)]
        identify_messages(msgs, POLICY, memo)
        peak_rss = max(peak_rss, rss() - start)
    return {"budget": budget, "messages": messages, "entries": len(memo), "accounted": memo._size, "peak_rss": peak_rss}


def huge_body(messages: int) -> bytes:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"tiny message {i}"} for i in range(messages)]
    # A tight copy, as a body read from a socket is.
    return bytes(memoryview(orjson.dumps({"model": "m", "messages": msgs})))


def case_huge(messages: int, trace: bool) -> dict[str, Any]:
    raw = huge_body(messages)
    store = MemoryStore(24 * 3600, 512 * MIB, secret=SECRET)
    local = LocalStore(store)
    memo = IdentityMemo()
    root = tenant_root(SECRET, "Bearer sk-huge")
    reply = Reply(message={"role": "assistant", "content": "done"}, finish_reason="stop", partial=False, model="m")
    gc.collect()
    start = rss()
    stages: dict[str, int] = {}
    held: dict[str, int] = {}
    sites: dict[str, list[str]] = {}
    if trace:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0] if trace else 0
    before = tracemalloc.take_snapshot() if trace else None
    peak_rss = 0

    def mark(stage: str) -> None:
        nonlocal peak_rss, before
        peak_rss = max(peak_rss, rss() - start)
        if trace:
            current, peak = tracemalloc.get_traced_memory()
            stages[stage] = peak - base
            held[stage] = current - base
            after = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            assert before is not None
            top = [d for d in after.compare_to(before, "lineno")[:3] if d.size_diff > MIB]
            sites[stage] = [f"{_site(d.traceback[0])} {d.size_diff / MIB:+.0f} MiB" for d in top]
            before = after
            tracemalloc.reset_peak()

    body = orjson.loads(raw)
    mark("orjson.loads of the body")
    plan = plan_turn(body, root, local.view(), POLICY, memo)
    mark("plan_turn (identities, memo, Match)")
    turn = turn_write(plan, reply, None, None, model="m", client_gone=False, now=time.time())
    assert turn is not None
    mark("turn_write (new Node drafts)")
    counted = replace(turn, nodes=tuple(replace(n, tokens=len(n.body) // 4) for n in turn.nodes))
    mark("token counts (Nodes copied)")
    local.write_turn_now(counted)
    mark("store insert + session")
    del body, plan, turn, counted
    gc.collect()
    left = rss() - start
    trimmed = left
    if not trace and malloc_trim():
        trimmed = rss() - start
    stats = store.stats()
    if trace:
        tracemalloc.stop()
    return {"messages": messages, "body": len(raw), "stages": stages, "held": held, "sites": sites, "peak_rss": peak_rss,
            "left": left, "trimmed": trimmed, "store_bytes": stats.bytes, "store_nodes": stats.nodes,
            "memo_bytes": memo._size}


def _site(frame: tracemalloc.Frame) -> str:
    parts = frame.filename.replace("\\", "/").split("/")
    where = "/".join(parts[parts.index("proxy"):]) if "proxy" in parts else parts[-1]
    return f"`{where}:{frame.lineno}`"


def _in_child(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tests.bench.store_flood", "--case", *args],
                         check=True, capture_output=True, text=True, timeout=900)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- the report -----------------------------------------------------------------------------


def signed(n: float) -> str:
    return f"- {size(-n)}" if n < 0 else f"+ {size(n)}"


def size(n: float) -> str:
    return f"{n / MIB:.1f} MiB" if abs(n) >= MIB else f"{n / 1024:.0f} KiB"


def run(quick: bool = False) -> Section:
    started = time.perf_counter()
    sessions = 12_000 if quick else 40_000
    budgets = QUICK_BUDGETS if quick else BUDGETS
    findings: list[str] = []

    flood = Table(
        f"Flood of {sessions:,} new sessions into a memory store",
        ["`store.max_bytes`", "tenants", "peak `stats().bytes`", "peak / budget", "nodes at end", "evicted",
         "peak RSS growth", "RSS growth / budget", "store write CPU per turn", "ratio to baseline", "CPU per turn"],
    )
    cases = [(BASELINE_BUDGET, False), *((b, False) for b in budgets), (BASELINE_BUDGET, True), (budgets[0], True)]
    results = {c: _in_child("flood", str(c[0]), str(sessions), "one" if c[1] else "each") for c in cases}
    for (budget, one), r in results.items():
        baseline = budget == BASELINE_BUDGET
        base = results[(BASELINE_BUDGET, one)]["write_per_turn"]
        flood.add(
            size(budget), "one" if one else "one each", size(r["peak_bytes"]), x(r["peak_bytes"] / budget),
            f"{r['nodes']:,}", f"{r['evicted']:,}", size(r["peak_rss"]),
            "-" if baseline else x(r["peak_rss"] / budget), us(r["write_per_turn"]), x(r["write_per_turn"] / base),
            us(r["cpu_per_turn"]),
        )
    r1, r2 = (results[(b, False)] for b in budgets)
    b1, b2 = budgets
    if not (r1["evicted"] and r2["evicted"]):
        findings.append("A budget was not filled: the fit below is not meaningful (more sessions needed).")
    factor = (r2["peak_rss"] - r1["peak_rss"]) / (b2 - b1)
    constant = r1["peak_rss"] - factor * b1
    over = [size(b) for (b, _one), r in results.items() if r["peak_bytes"] > b]
    flood.notes.append(
        "Each session: tools, system prompt, user message, generated reply and its totals, recorded by "
        "`plan_turn` -> `turn_write` -> `LocalStore.write_turn_now` (token counts by length). Peak "
        "`stats().bytes` is read after every turn; RSS every 200 turns. The 64 KiB row is the baseline: "
        "the driver's own memory and CPU with a store that holds almost nothing (it evicts on every turn). "
        "\"one\" tenant: every session under one system-prompt node (the widest fan-out), against its own baseline. "
        "Store write CPU: `write_turn_now` alone (insert, touch, totals, eviction); CPU per turn: the whole turn."
    )
    findings.append(
        "`stats().bytes` never exceeded the budget after any turn."
        if not over else f"`stats().bytes` EXCEEDED the budget at {', '.join(over)}."
    )
    findings.append(
        f"Store: RSS growth = {factor:.2f} x `store.max_bytes` {signed(constant)} "
        f"(fitted on {size(b1)} and {size(b2)}; baseline {size(results[(BASELINE_BUDGET, False)]['peak_rss'])})."
    )
    worst = max(r["write_per_turn"] / results[(BASELINE_BUDGET, one)]["write_per_turn"] for (_b, one), r in results.items())
    findings.append(
        f"A store write costs at most {worst:.2f}x the baseline's, which evicts on every turn from a store small "
        "enough to stay in the CPU caches: eviction does no scan, its cost is per evicted node."
    )

    memo_rows = Table("Identity memo flood: distinct short messages", ["memo `max_bytes`", "entries", "accounted", "peak RSS growth", "RSS growth / budget"])
    count = 150_000 if quick else 600_000
    memo = {b: _in_child("memo", str(b), str(count)) for b in budgets}
    for budget, r in memo.items():
        memo_rows.add(size(budget), f"{r['entries']:,}", size(r["accounted"]), size(r["peak_rss"]), x(r["peak_rss"] / budget))
    memo_rows.notes.append(f"{count:,} messages of ~50 bytes, 5 000 per batch (the batch itself is in the RSS).")
    m1, m2 = (memo[b]["peak_rss"] for b in budgets)
    memo_factor = (m2 - m1) / (b2 - b1)
    findings.append(f"Identity memo: RSS growth = {memo_factor:.2f} x its `max_bytes` {signed(m1 - memo_factor * b1)}.")

    messages = 30_000 if quick else 100_000
    traced = _in_child("huge", str(messages), "trace")
    plain = _in_child("huge", str(messages), "rss")
    huge = Table(
        f"One request of {messages:,} tiny messages ({traced['body'] / 1e6:.1f} MB body)",
        ["stage", "tracemalloc peak during the stage", "held after it", "largest new allocations (by line)"],
    )
    for stage, peak in traced["stages"].items():
        huge.add(stage, size(peak), size(traced["held"][stage]), "; ".join(traced["sites"][stage]) or "-")
    huge.notes.append(
        f"Without tracemalloc: RSS peak growth {size(plain['peak_rss'])}; left after the request "
        f"{size(plain['left'])}, {size(plain['trimmed'])} after `malloc_trim(0)`; the store then holds "
        f"{size(plain['store_bytes'])} ({plain['store_nodes']:,} nodes), the memo {size(plain['memo_bytes'])}."
    )
    top = sorted(((stage, site) for stage, lines in traced["sites"].items() for site in lines[:1]),
                 key=lambda item: -float(item[1].rsplit(" ", 2)[-2]))[:2]
    findings.append(
        f"The huge request: RSS peak {size(plain['peak_rss'])} for a {traced['body'] / 1e6:.1f} MB body; the largest "
        f"allocations: " + ", ".join(f"{site} ({stage})" for stage, site in top) + "."
    )
    return Section("Store flood: memory against the byte budget", [flood, memo_rows, huge], findings,
                   time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.store_flood", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sessions and messages")
    parser.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        kind, *rest = args.case
        if kind == "flood":
            result = case_flood(int(rest[0]), int(rest[1]), rest[2] == "one")
        elif kind == "memo":
            result = case_memo(int(rest[0]), int(rest[1]))
        else:
            result = case_huge(int(rest[0]), rest[1] == "trace")
        print(json.dumps(result))
        return 0
    print(run(args.quick).markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
