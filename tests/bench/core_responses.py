"""Core processing of Responses API requests (issue 11), as a ratio to parsing.

A Codex CLI request captured from the real client (``tests/fixtures/responses/codex_turn2``,
~40 KB: developer instructions, user messages, a function call and its output, 9 tools) and
the same conversation grown to ~1 MB with more function calls and outputs. The store holds
the previous turns (the request without its last item, and without its last two) as the
pipeline records them; the request re-sends them and adds one item. Timed, interleaved with ``orjson.loads`` of the same
bytes: the Responses front-end's plan (items mapped onto the shared element view, identify,
match, repair, diagnose; ``ResponsesWire.plan``), with no drift and with drift (every re-sent
``arguments`` re-serialized by ``json.dumps`` and the tools reordered: repaired, spliced into
the client's bytes).

Aim: at most 2x ``orjson.loads`` with no drift, as for chat. The request path does less for a
conversation re-sent byte for byte (issue 15): the prefix memo (:mod:`proxy.core.prefix`) rebuilds
the body from the previous one and parses only the new item, the view takes over the previous
view's messages, and the match starts where the previous one ended: the "re-sent" column times
that (``PrefixMemo.recall`` + ``ResponsesWire.plan``) against ``orjson.loads`` of the whole body.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import orjson

from proxy.core.guard import STRICT
from proxy.core.identity import IdentityMemo
from proxy.core.model import tenant_root
from proxy.core.plan import turn_write
from proxy.core.policy import Policy
from proxy.core.prefix import PrefixMemo
from proxy.store.memory.store import MemoryStore
from proxy.wire.responses import ResponsesWire
from tests.bench.measure import interleaved, median, ratio
from tests.bench.report import Section, Table, kib, mark, us, x

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "responses" / "codex_turn2.raw.json"
AIM = 2.0
POLICY = Policy()
SECRET = b"bench-secret-bench-secret-bench!"
WIRE = ResponsesWire()


def grown(body: dict[str, Any], target: int) -> dict[str, Any]:
    """``body`` with more tool rounds (a function call and a long output each) until ~``target`` bytes."""
    out = copy.deepcopy(body)
    items: list[Any] = out["input"]
    n = 0
    while len(orjson.dumps(out)) < target:
        n += 1
        items.append({
            "type": "function_call", "call_id": f"call_{n}", "name": "exec_command",
            "arguments": json.dumps({"cmd": f"sed -n {n},{n + 40}p src/module_{n}.py"}, separators=(",", ":")),
        })
        text = "\n".join(f"{i:4d}  def f_{n}_{i}(x): return x * {i}  # line of code" for i in range(40))
        items.append({"type": "function_call_output", "call_id": f"call_{n}", "output": text})
    return out


def drifted(body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for item in out["input"]:
        if item.get("type") == "function_call":
            item["arguments"] = json.dumps(json.loads(item["arguments"]))  # spaces after : and ,
    out["tools"] = out["tools"][1:] + out["tools"][:1]
    return out


SCOPE = ("bench", "POST", "/v1/responses")


def _stored(body: dict[str, Any], root: bytes) -> tuple[MemoryStore, IdentityMemo, PrefixMemo]:
    """The store and memos as the request path leaves them after the two turns before ``body``
    (``body`` without its last item, and without its last two): each turn planned as the request
    path plans it (the second recalled from the first), recorded, and remembered."""
    store = MemoryStore(ttl_seconds=3600, max_bytes=1 << 40, secret=SECRET)
    memo = IdentityMemo()
    resent = PrefixMemo(memo)
    for cut in (2, 1):
        turn = {**body, "input": body["input"][:-cut]}
        raw = orjson.dumps(turn)
        recalled = resent.recall(SCOPE, raw)
        if recalled is not None:
            turn = recalled.body
        plan = WIRE.plan(raw, turn, root, store, POLICY, memo, STRICT, recalled)
        record = turn_write(plan, None, None, None, model="", client_gone=False, now=0.0)
        assert record is not None
        store.insert(record.nodes)
        if not resent.remember_plan(SCOPE, raw, turn, plan, recalled, array="input"):
            raise AssertionError("the previous body must be remembered")
    return store, memo, resent


def _resent_plan(raw: bytes, root: bytes, store: MemoryStore, memo: IdentityMemo, resent: PrefixMemo) -> Any:
    """What the request path does with a re-sent body: recall it, plan from the previous turn."""
    recalled = resent.recall(SCOPE, raw)
    if recalled is None:
        raise AssertionError("the re-sent body must be recalled")
    return WIRE.plan(raw, recalled.body, root, store, POLICY, memo, STRICT, recalled)


def run(quick: bool = False) -> Section:
    started = time.perf_counter()
    seconds = 0.4 if quick else 1.5
    root = tenant_root(SECRET, "Bearer sk-bench")
    captured = orjson.loads(FIXTURE.read_bytes())
    table = Table(
        "Responses front-end plan vs orjson.loads of the same body",
        ["request", "body", "orjson.loads", "no drift", "ratio", f"≤{AIM:g}x", "re-sent", "ratio", "drifted", "ratio"],
    )
    worst = 0.0
    worst_resent = 0.0
    for label, body in (("Codex CLI turn (captured)", captured), ("Codex-shaped, grown", grown(captured, 1_000_000))):
        store, memo, resent = _stored(body, root)
        raw = orjson.dumps(body)
        drift = drifted(body)
        drift_raw = orjson.dumps(drift)
        clean_plan = WIRE.plan(raw, body, root, store, POLICY, memo, STRICT)
        drift_plan = WIRE.plan(drift_raw, drift, root, store, POLICY, None, STRICT)
        if clean_plan.match is None or clean_plan.repair.repairs or not drift_plan.repair.repairs:
            raise AssertionError("the benchmark must take the paths it claims: clean unrepaired, drifted repaired")
        if drift_plan.spliced is None:
            raise AssertionError(f"the drifted repair was not spliced: {drift_plan.refused}")
        resent_plan = _resent_plan(raw, root, store, memo, resent)
        known = resent_plan.match is not None and resent_plan.match.clean > 0
        if resent_plan.view is None or not resent_plan.view.reused or not known or resent_plan.match.keys != clean_plan.match.keys:
            raise AssertionError("the re-sent path must take the previous view over and match as the full path does")
        samples = interleaved(
            {
                "loads": lambda r=raw: orjson.loads(r),  # type: ignore[misc]
                "plan": lambda b=body, r=raw, st=store, m=memo: WIRE.plan(r, b, root, st, POLICY, m, STRICT),  # type: ignore[misc]
                "resent": lambda r=raw, st=store, m=memo, p=resent: _resent_plan(r, root, st, m, p),  # type: ignore[misc]
                "loads_drift": lambda r=drift_raw: orjson.loads(r),  # type: ignore[misc]
                "plan_drift": lambda b=drift, r=drift_raw, st=store: WIRE.plan(r, b, root, st, POLICY, None, STRICT),  # type: ignore[misc]
            },
            seconds=seconds,
        )
        loads, plan = median(samples["loads"]), median(samples["plan"])
        r = ratio(plan, loads)
        worst = max(worst, r)
        r_resent = ratio(median(samples["resent"]), loads)
        worst_resent = max(worst_resent, r_resent)
        table.add(
            label, kib(len(raw)), us(loads), us(plan), x(r), mark(r <= AIM), us(median(samples["resent"])), x(r_resent),
            us(median(samples["plan_drift"])), x(ratio(median(samples["plan_drift"]), median(samples["loads_drift"]))),
        )
    table.notes.append(
        "The captured request is the Codex CLI 0.169.0's second request of a session (store: false, "
        "encrypted reasoning, 9 tools); the grown one adds tool rounds of ~1.6 KiB each. no drift: "
        "with the identity memo as the previous turn left it; drifted: without it, every re-sent "
        "`arguments` re-serialized and the tools rotated (the plan includes splicing the repair); "
        "re-sent: the bytes recalled from the previous body (the prefix memo) and planned from its "
        "view and match, as the request path does (parsing included, unlike the no-drift column)."
    )
    verdict = "met" if worst <= AIM else "missed"
    findings = [
        f"Responses no-drift planning costs at most {worst:.2f}x `orjson.loads` (aim ≤ {AIM:g}x): {verdict}.",
        f"A conversation re-sent byte for byte, parsing included, costs at most {worst_resent:.2f}x "
        "`orjson.loads` of its body on the request path: in proportion to its new item.",
    ]
    return Section("2b. Core processing, Responses API (issue 11)", [table], findings, time.perf_counter() - started)


if __name__ == "__main__":
    print(run(quick=True).markdown())
