"""Odd chat conversations through the request path's stages, each outcome printed as a line:
``python -m tests.native_fuzz SEED COUNT``. tests/test_native.py runs it compiled and as plain
Python and compares: mypyc checks annotations at run time, so a client value narrower in an
annotation than on the wire would fail (open) only in the compiled build."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import sys
import time
from typing import Any

import orjson

import proxy
from proxy.core.identity import IdentityMemo
from proxy.core.match import tenant_root
from proxy.core.plan import turn_write
from proxy.core.policy import Policy
from proxy.core.prefix import PrefixMemo
from proxy.request.failopen import FailOpen
from proxy.store.local import LocalStore
from proxy.store.memory.store import MemoryStore
from proxy.transport.traits import UpstreamTraits
from proxy.wire.chat import ChatWire

SCALARS: list[Any] = ["", "hi", " padded \n", "\u00e9\u4e2d", 0, -1, 2**53, 1.5, True, False, None]
ROLES: list[Any] = ["system", "user", "assistant", "tool", "developer", "", 3, None, ["user"]]
KEYS = ["role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content", "cache_control", "x"]


def value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.55:
        return rng.choice(SCALARS)
    if roll < 0.75:
        return [value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice([*KEYS, "type", "text", "id", "function", "arguments"]): value(rng, depth + 1) for _ in range(rng.randrange(3))}


def tool_call(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return value(rng, 1)
    arguments = rng.choice(['{"a": 1, "b": [2]}', '{"b":[2],"a":1}', "not json", "", None, 7, {"a": 1}])
    return {"id": rng.choice([f"call_{rng.randrange(9)}", None, 5]), "type": rng.choice(["function", None]),
            "function": rng.choice([{"name": rng.choice(["read", "", None, 1]), "arguments": arguments}, None, "f"])}


def message(rng: random.Random) -> Any:
    if rng.random() < 0.05:
        return value(rng, 1)
    msg: dict[str, Any] = {"role": rng.choice(ROLES)}
    content = rng.random()
    if content < 0.5:
        msg["content"] = rng.choice(["read the file", "done", "", " x ", "\u00e9"])
    elif content < 0.7:
        msg["content"] = [rng.choice([{"type": "text", "text": "read the file"}, {"type": "image_url", "image_url": {"url": "x"}}, value(rng, 2)]) for _ in range(rng.randrange(1, 3))]
    elif content < 0.85:
        msg["content"] = value(rng, 1)
    if rng.random() < 0.3:
        msg["tool_calls"] = [tool_call(rng) for _ in range(rng.randrange(3))] if rng.random() < 0.9 else value(rng, 1)
    for key in rng.sample(KEYS[3:], rng.randrange(3)):
        msg[key] = value(rng, 1)
    return msg


def drifted(rng: random.Random, msg: Any) -> Any:
    """``msg`` as an agent may re-send it: arguments re-serialized, text as parts, whitespace."""
    if type(msg) is not dict:
        return msg
    out = copy.deepcopy(msg)
    for call in out.get("tool_calls") or [] if type(out.get("tool_calls")) is list else []:
        function = call.get("function") if type(call) is dict else None
        if type(function) is dict and type(function.get("arguments")) is str:
            try:
                args = json.loads(function["arguments"])
            except ValueError:
                continue
            if type(args) is dict:
                args = dict(reversed(list(args.items())))
            function["arguments"] = json.dumps(args, separators=rng.choice([(",", ":"), (", ", ": ")]))
    content = out.get("content")
    if type(content) is str and rng.random() < 0.5:
        out["content"] = rng.choice([[{"type": "text", "text": content}], content.rstrip(), content + "\n"])
    return out


def conversation(rng: random.Random) -> list[Any]:
    """A base conversation and, re-sent, its drifted or odd continuations."""
    base = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "read the file"}]
    base += [message(rng) for _ in range(rng.randrange(4))]
    tools = rng.choice([None, [{"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}], value(rng, 1)])
    bodies = []
    for turn in range(3):
        sent = base if turn == 0 or rng.random() < 0.4 else [drifted(rng, m) for m in base]
        msgs = sent + [message(rng) for _ in range(turn)]
        body: dict[str, Any] = {"model": rng.choice(["gpt-4o", 5, None]), "messages": msgs}
        if tools is not None:
            body["tools"] = tools
        for key in rng.sample(["stream", "temperature", "metadata", "user"], rng.randrange(2)):
            body[key] = value(rng, 1)
        bodies.append(body)
    return bodies


def response(rng: random.Random, i: int) -> bytes:
    reply: Any = rng.choice([
        {"role": "assistant", "content": f"done {i}"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call(rng)]},
        message(rng),
        value(rng, 1),
    ])
    usage = rng.choice([
        {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55, "prompt_tokens_details": {"cached_tokens": rng.choice([0, 32, None, "x"])}},
        value(rng, 1),
        None,
    ])
    return orjson.dumps({"id": "c", "object": "chat.completion", "model": rng.choice(["m", 3]), "choices": rng.choice([[{"index": 0, "message": reply, "finish_reason": "stop"}], [], value(rng, 1)]), "usage": usage})


def main() -> None:
    seed, count = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)
    secret = b"s" * 32
    store = LocalStore(MemoryStore(3600, 1 << 30, secret=secret))
    memo = IdentityMemo()
    resent = PrefixMemo(memo)
    wire, traits, policy = ChatWire(), UpstreamTraits(), Policy()
    print(proxy.native.state())
    for c in range(count):
        root = tenant_root(secret, f"tenant-{c % 3}")
        scope = (root, "POST", "/v1/chat/completions")
        for i, body in enumerate(conversation(rng)):
            raw = orjson.dumps(body)
            failed: list[str] = []
            guard = FailOpen(failed.append)
            outcome: list[Any] = []
            try:
                recalled = resent.recall(scope, raw)
                parsed = recalled.body if recalled is not None else wire.parse("POST", "/v1/chat/completions", raw)
                if parsed is None:
                    print(c, i, "not parsed")
                    continue
                plan = wire.plan(raw, parsed, root, store.view(root), policy, memo, guard, recalled)
                out = wire.outgoing(raw, parsed, plan, traits)
                observer = wire.observer(out, traits, guard, success=True)
                observer.on_body(response(rng, i))
                reply = observer.end(client_gone=False)
                turn = turn_write(plan, reply, observer.usage, None, model="m", client_gone=False, now=time.time(), count_tokens=len, memo=memo)
                if turn is not None:
                    store.write_turn_now(turn)
                resent.remember_plan(scope, raw, parsed, plan, recalled, tag=wire, array="messages")
                match = plan.match
                outcome = [
                    recalled is not None,
                    hashlib.sha256(out.body).hexdigest()[:16],
                    None if match is None else (match.matched, len(match.keys), match.keys[-1].hex() if match.keys else ""),
                    sorted(r.kind for r in plan.repair.repairs),
                    None if plan.broke is None else plan.broke.reason,
                    None if reply is None else hashlib.sha256(orjson.dumps(reply.messages)).hexdigest()[:16],
                    None if observer.usage is None else (observer.usage.prompt_tokens, observer.usage.cached_tokens),
                    None if turn is None else len(turn.nodes),
                ]
            except Exception as exc:  # a stage outside a guard raised: the outcome says which
                outcome = [f"raised {type(exc).__name__}"]
            print(c, i, sorted(set(failed)), orjson.dumps(outcome).decode())


if __name__ == "__main__":
    main()
