"""Proxy overhead (issues 2 and 15): kvwarm vs direct vs a bare aiohttp pass-through, on real sockets.

Processes on loopback: an echo-like upstream (this module, ``--echo-upstream``: it reads each
request and answers a fixed small completion with usage, or a short SSE stream, without
parsing the body, so the figures measure the proxies and not a provider emulator), kvwarm
(``python -m proxy serve --store memory``, ``KVWARM_LOG_LEVEL=WARNING``), the bare pass-through
of :mod:`tests.bench.passthrough` (same event loop kind as kvwarm), the same pass-through on
kvwarm's transport (a column: kvwarm's plumbing without its own work), and with ``--peers``
LiteLLM's proxy (:mod:`tests.bench.peers`). This process is the client: aiohttp, keep-alive,
one session per target, on uvloop when installed.

Cases, as an agent sends them: one conversation re-sent every request with its last turn
changed (so kvwarm matches all but the last message, and records the new turn and the reply
every time), of ~2 KiB and of ~200 KiB; the same ~2 KiB streamed (time to the first body
byte); the same ~2 KiB answered by a stream of 200 tokens, one chunk each, as a model
streams them (to its last byte); agent loops (:class:`tests.agents.Agent`: each request re-sends the history plus
the last reply and tool results, ~10 -> 20 KiB); and a captured Codex CLI request on the
Responses API (``/v1/responses``, ~40 KiB, ``store: false``: the whole conversation every
turn) re-sent with its last turn changed and streamed as Codex asks (the API's event stream,
26 events, to its last byte). Measured, every target in rotating order
within each round (direct, bare, kvwarm / bare, kvwarm, direct / ...):

- latency (added = a target's percentile minus direct's) of each case, one request at a time;
- throughput (requests/s) with 32 concurrent clients: the ~2 KiB and ~200 KiB conversations,
  the 200-token streams, 32 agent loops, and the Codex request;
- each proxy's CPU time per request over every case, from its own process's CPU time in
  ``/proc`` (:func:`tests.bench.measure.process_cpu`): unlike latency on a shared 2-CPU
  machine, it does not depend on when a process happened to be scheduled.

The aims: kvwarm's CPU per request within 1.2x of the bare pass-through's at 2 KiB and 1.5x
at 200 KiB (issue 15), its added latency within 1.2x of the bare pass-through's, and its
throughput at least the bare pass-through's (issue 2).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.sim.events import response_events
from tests.agents import SYSTEM, Agent
from tests.bench import peers
from tests.bench.conversations import SHORT_SYSTEM, chat_body, conversation
from tests.bench.measure import median, percentile, process_cpu, ratio, rotated
from tests.bench.passthrough import loop_kind
from tests.bench.report import Section, Table, mark, ms, x
from tests.bench.servers import REPO, Servers, python_module

__all__ = ["CONCURRENCY", "CpuMeter", "echo_app", "process_cpu", "run", "varying_bodies"]

ADDED_AIM = 1.2
"""kvwarm's added latency at most this times the bare pass-through's."""
THROUGHPUT_AIM = 1.0
"""kvwarm's throughput at least this times the bare pass-through's."""
CPU_AIMS = {"small": 1.2, "large": 1.5}
"""kvwarm's CPU per request at most this times the bare pass-through's (issue 15)."""
CONCURRENCY = 32
TRANSPORT_ONLY = "bare on kvwarm's transport"
"""The bare pass-through sending on :mod:`proxy.transport.pool`: kvwarm's plumbing without its own work."""
AGENT_TURNS = 25
"""Turns of one agent session before it starts a new one (throughput)."""
STREAM_TOKENS = 200
"""Tokens of the long streamed answers: one SSE chunk each, as a model streams them."""
CHAT = "/chat/completions"
RESPONSES = "/responses"
CODEX_REQUEST = REPO / "tests" / "fixtures" / "responses" / "codex_turn2.raw.json"
"""A request the Codex CLI sent (its second turn: instructions, tools, a call and its output)."""


def headers_for(tenant: str) -> dict[str, str]:
    """Each scenario is its own tenant (API key), as separate agents would be."""
    return {"Content-Type": "application/json", "Authorization": f"Bearer sk-bench-{tenant}"}

Endpoint = tuple[str, int | None, str | None]
"""(base URL, pid of the proxy process or None, Authorization override or None)."""


@dataclass(frozen=True)
class Plan:
    """How many samples each scenario takes (``--quick`` shrinks them)."""

    small: int = 600
    large: int = 120
    stream: int = 300
    agent_runs: int = 4
    agent_turns: int = 25
    rounds: int = 5
    round_seconds: float = 2.0
    warmup: int = 15

    @classmethod
    def quick(cls) -> Plan:
        return cls(small=200, large=40, stream=100, agent_runs=2, agent_turns=15, rounds=3, round_seconds=1.0, warmup=8)


# -- the cases ----------------------------------------------------------------------------------


def _last_turn(i: int) -> str:
    """The user turn of request ``i``: new every time (a retry, an edited prompt, a new task)."""
    return f"Turn {i}: look again at case {i % 97} and report what changed."


def varying_bodies(messages: list[dict[str, Any]], n: int, *, stream: bool = False, max_tokens: int | None = None) -> list[bytes]:
    """``n`` request bodies: ``messages`` re-sent byte for byte, then a last user turn that
    changes every time (a retry, an edited prompt, a new task under the same history).
    ``max_tokens``: the echo upstream streams that many tokens, a chunk each."""
    out = []
    for i in range(n):
        turn = {"role": "user", "content": _last_turn(i)}
        body = chat_body([*messages, turn], stream=stream)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        out.append(orjson.dumps(body))
    return out


def codex_bodies(n: int) -> list[bytes]:
    """``n`` bodies of the captured Codex CLI request, streamed as Codex asks (``stream: true``):
    its items re-sent byte for byte, then a user turn that changes every time (as
    :func:`varying_bodies`)."""
    body = orjson.loads(CODEX_REQUEST.read_bytes())
    assert body["stream"] is True
    out = []
    for i in range(n):
        turn = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": _last_turn(i)}]}
        out.append(orjson.dumps({**body, "input": [*body["input"], turn]}))
    return out


def _history(n_messages: int, target_bytes: int, seed: int, system: str = SYSTEM) -> list[dict[str, Any]]:
    """A tool-using conversation without its closing user turn (the cases add their own)."""
    messages = conversation(n_messages, target_bytes, seed=seed, system=system)
    return messages[:-1] if messages[-1]["role"] == "user" else messages


# -- the echo upstream ----------------------------------------------------------------------------

_LAST_ROLE = b'"role":"'
_MAX_TOKENS = re.compile(rb'"max_tokens":(\d+)')


def _echo_message(raw: bytes, n: int) -> dict[str, Any]:
    """A reply an agent can go on with: a tool call after a user turn, text after anything else
    (the last ``"role"`` in the body, found without parsing it)."""
    at = raw.rfind(_LAST_ROLE)
    role = raw[at + len(_LAST_ROLE) : raw.find(b'"', at + len(_LAST_ROLE))] if at >= 0 else b""
    if role == b"user":
        call = {"id": f"call_echo_{n}", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"src/cache.py"}'}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "assistant", "content": f"Done: {len(raw)} bytes read."}


def echo_app() -> web.Application:
    """A minimal OpenAI-compatible upstream: ``/v1/chat/completions`` (JSON, or SSE when the
    body asks for a stream) with a usage block, ``/v1/responses`` (one output message and its
    usage: JSON, or when the body asks for a stream the API's event stream, 26 events) and
    ``/v1/models`` (readiness)."""
    counter = itertools.count()

    async def responses(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        n = next(counter)
        prompt = len(raw) // 4
        streamed = b'"stream":true' in raw
        text = f"Done: {len(raw)} bytes read." + (" Checked the case again and nothing else changed." * 6 if streamed else "")
        body = {
            "id": f"resp_{n}", "object": "response", "created_at": 0, "status": "completed", "model": "kvwarm-sim",
            "output": [{"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": prompt - prompt % 128},
                      "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + 8},
        }
        if not streamed:
            return web.Response(body=orjson.dumps(body), content_type="application/json")
        # The Responses API's event stream (the reference upstream's), each event written on its own.
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for event in response_events({**body, "status": "in_progress", "output": [], "usage": None}, body):
            await out.write(event)
        await out.write_eof()
        return out

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        n = next(counter)
        prompt = len(raw) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": 8, "total_tokens": prompt + 8,
                 "prompt_tokens_details": {"cached_tokens": prompt - prompt % 128}}
        message = _echo_message(raw, n)
        if b'"stream":true' not in raw:
            body = {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": "kvwarm-sim",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage}
            return web.Response(body=orjson.dumps(body), content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        base = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 0, "model": "kvwarm-sim"}
        tokens = _MAX_TOKENS.search(raw)
        if tokens is not None:  # a model's stream: a chunk per token, each written on its own
            deltas = [{"role": "assistant", "content": ""}, *({"content": f" tok{i}"} for i in range(int(tokens[1])))]
        else:
            deltas = [{k: v for k, v in message.items() if v is not None}]
        chunks = [
            *({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas),
            {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
        if b'"include_usage":true' in raw:
            chunks.append({**base, "choices": [], "usage": usage})
        for chunk in chunks:
            await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "kvwarm-sim", "object": "model"}]})

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    return app


# -- the client ----------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    base_url: str
    session: aiohttp.ClientSession = field(repr=False)
    pid: int | None = None
    """The proxy's process (None for direct): its CPU time is read from /proc."""
    authorization: str | None = None
    """Replaces the scenario's ``Authorization`` (a peer that checks its own key)."""
    requests: int = 0
    """Requests sent so far (warm-ups included), for CPU time per request."""

    @property
    def chat_url(self) -> str:
        return self.base_url + CHAT

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        if self.authorization is None:
            return headers
        return {**headers, "Authorization": self.authorization}


class BenchError(RuntimeError):
    """A request of the benchmark failed: the numbers would be meaningless."""


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        text = (await resp.read())[:300]
        raise BenchError(f"{resp.url} answered {resp.status}: {text!r}")


async def request_latency(target: Target, body: bytes, headers: dict[str, str], path: str = CHAT) -> float:
    """Seconds from sending a request to the last byte of its response."""
    target.requests += 1
    headers = target.headers(headers)
    t0 = time.perf_counter()
    async with target.session.post(target.base_url + path, data=body, headers=headers) as resp:
        await _check(resp)
        await resp.read()
    return time.perf_counter() - t0


async def first_byte(target: Target, body: bytes, headers: dict[str, str]) -> float:
    """Seconds from sending a streaming request to the first byte of its body (then drains it)."""
    target.requests += 1
    headers = target.headers(headers)
    t0 = time.perf_counter()
    async with target.session.post(target.chat_url, data=body, headers=headers) as resp:
        await _check(resp)
        first = await resp.content.readany()
        elapsed = time.perf_counter() - t0
        if not first:
            raise BenchError(f"{target.name}: empty stream")
        async for _ in resp.content.iter_any():
            pass
    return elapsed


async def sequential(
    targets: list[Target],
    fn: Callable[[Target, bytes, dict[str, str]], Awaitable[float]],
    bodies: list[bytes],
    n: int,
    warmup: int,
    tenant: str,
    warm: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """``n`` samples per target, one target after another in rotating order; request ``i`` of
    every target sends ``bodies[i]`` (warm-ups first, from the end of the list; then ``warm()``)."""
    headers = headers_for(tenant)

    async def one(target: Target, body: bytes) -> float:
        try:
            return await fn(target, body, headers)
        except aiohttp.ClientError as exc:
            raise BenchError(f"{target.name}: {exc!r}") from exc

    for target in targets:
        for i in range(warmup):
            await one(target, bodies[-1 - i % len(bodies)])
    warm()
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    for i in range(n):
        for target in rotated(targets, i):
            samples[target.name].append(await one(target, bodies[i % len(bodies)]))
    return samples


def _poster(target: Target, headers: dict[str, str], record: list[float] | None) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    async def post(request: dict[str, Any]) -> dict[str, Any]:
        data = orjson.dumps(request)
        target.requests += 1
        t0 = time.perf_counter()
        async with target.session.post(target.chat_url, data=data, headers=target.headers(headers)) as resp:
            await _check(resp)
            raw = await resp.read()
        if record is not None:
            record.append(time.perf_counter() - t0)
        result: dict[str, Any] = orjson.loads(raw)
        return result

    return post


async def agent_loops(
    targets: list[Target], runs: int, turns: int, warm: Callable[[], None] = lambda: None
) -> dict[str, list[float]]:
    """Per-request latency of agents whose conversations grow turn by turn, one agent per target."""
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    headers = headers_for("agents")
    # One warm-up run (not recorded), then ``warm()`` and the measured runs; each run is a new session.
    for run in range(runs + 1):
        if run == 1:
            warm()
        system = f"{SYSTEM}\nSession {run} of the benchmark."
        agents = [Agent(post=_poster(t, headers, samples[t.name] if run > 0 else None), system=system) for t in targets]
        for turn in range(turns):
            for agent in rotated(agents, turn + run):
                await agent.step()
    return samples


async def throughput(target: Target, bodies: list[bytes], seconds: float, headers: dict[str, str], path: str = CHAT) -> float:
    """Requests/s completed by :data:`CONCURRENCY` clients sending ``bodies`` in turn for ``seconds``."""
    headers = target.headers(headers)
    url = target.base_url + path
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    done = 0
    order = itertools.count()

    async def worker() -> None:
        nonlocal done
        while loop.time() < stop:
            target.requests += 1
            body = bodies[next(order) % len(bodies)]
            async with target.session.post(url, data=body, headers=headers) as resp:
                await _check(resp)
                await resp.read()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done / (time.perf_counter() - t0)


async def agent_throughput(target: Target, seconds: float, headers: dict[str, str], label: str) -> float:
    """Requests/s completed by :data:`CONCURRENCY` agent loops (new sessions every
    :data:`AGENT_TURNS` turns) for ``seconds``."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        for session in itertools.count():
            agent = Agent(post=_poster(target, headers, None), system=f"{SYSTEM}\nAgent {w}, session {session} of {label}.")
            for _ in range(AGENT_TURNS):
                if loop.time() >= stop:
                    return
                await agent.step()
                done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
    return done / (time.perf_counter() - t0)


async def throughput_rounds(
    targets: list[Target], bodies: list[bytes] | None, plan: Plan, tenant: str, warm: Callable[[], None] = lambda: None,
    path: str = CHAT,
) -> dict[str, list[float]]:
    """Rounds of :func:`throughput` (or, without bodies, of :func:`agent_throughput`), targets in
    rotating order, after a short warm-up of each (then ``warm()``)."""
    headers = headers_for(tenant)

    async def one(target: Target, seconds: float, label: str) -> float:
        if bodies is None:
            return await agent_throughput(target, seconds, headers, label)
        return await throughput(target, bodies, seconds, headers, path)

    for target in targets:
        await one(target, 0.3, "warm-up")
    warm()
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    for i in range(plan.rounds):
        for target in rotated(targets, i):
            samples[target.name].append(await one(target, plan.round_seconds, f"round {i}"))
    return samples


@dataclass
class Results:
    latency: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """scenario -> target -> seconds per request."""
    throughput: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """scenario -> target -> requests/s per round."""
    body_sizes: dict[str, str] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    """scenario -> proxy -> CPU seconds (user + system) of its process per request."""


class CpuMeter:
    """CPU time per request of each proxy process over one scenario."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = [t for t in targets if t.pid is not None]
        self.start = {t.name: (process_cpu(t.pid), t.requests) for t in self.targets if t.pid is not None}

    def per_request(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.targets:
            cpu0, n0 = self.start[t.name]
            cpu1 = process_cpu(t.pid) if t.pid is not None else None
            if cpu0 is not None and cpu1 is not None and t.requests > n0:
                out[t.name] = (cpu1 - cpu0) / (t.requests - n0)
        return out


async def _measure(urls: dict[str, Endpoint], plan: Plan, log: Callable[[str], None]) -> Results:
    results = Results()
    sessions = []
    targets: list[Target] = []
    for name, (url, pid, authorization) in urls.items():
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY * 2))
        sessions.append(session)
        targets.append(Target(name, url, session, pid, authorization))
    try:
        short = _history(8, 2048, seed=1, system=SHORT_SYSTEM)
        long = _history(100, 200 * 1024, seed=2)
        distinct = max(plan.small, plan.stream) + plan.warmup
        small = varying_bodies(short, distinct)
        stream = varying_bodies(short, distinct, stream=True)
        tokens = varying_bodies(short, distinct, stream=True, max_tokens=STREAM_TOKENS)
        large = varying_bodies(long, plan.large + plan.warmup)
        codex = codex_bodies(plan.small + plan.warmup)
        results.body_sizes = {
            "small": f"{len(small[0]) / 1024:.1f} KiB", "large": f"{len(large[0]) / 1024:.0f} KiB",
            "codex": f"{len(codex[0]) / 1024:.0f} KiB",
        }

        Run = Callable[[Callable[[], None]], Awaitable[dict[str, list[float]]]]

        async def scenario(name: str, run: Run, into: dict[str, Any]) -> None:
            """Run one case; CPU time is measured from the end of its warm-up (steady state)."""
            log(name)
            meter = [CpuMeter(targets)]
            into[name] = await run(lambda: meter.__setitem__(0, CpuMeter(targets)))
            results.cpu[name if into is results.latency else f"throughput, {name}"] = meter[0].per_request()

        await scenario("small", lambda warm: sequential(targets, request_latency, small, plan.small, plan.warmup, "small", warm), results.latency)
        await scenario("large", lambda warm: sequential(targets, request_latency, large, plan.large, plan.warmup // 3 + 2, "large", warm), results.latency)
        await scenario("ttfb", lambda warm: sequential(targets, first_byte, stream, plan.stream, plan.warmup, "stream", warm), results.latency)
        await scenario("tokens", lambda warm: sequential(targets, request_latency, tokens, plan.stream, plan.warmup, "tokens", warm), results.latency)
        await scenario("agent", lambda warm: agent_loops(targets, plan.agent_runs, plan.agent_turns, warm), results.latency)
        codex_latency = partial(request_latency, path=RESPONSES)
        await scenario("codex", lambda warm: sequential(targets, codex_latency, codex, plan.small, plan.warmup, "codex", warm), results.latency)
        log(f"throughput, concurrency {CONCURRENCY}")
        await scenario("small", lambda warm: throughput_rounds(targets, small, plan, "tput-small", warm), results.throughput)
        await scenario("large", lambda warm: throughput_rounds(targets, large, plan, "tput-large", warm), results.throughput)
        await scenario("tokens", lambda warm: throughput_rounds(targets, tokens, plan, "tput-tokens", warm), results.throughput)
        await scenario("agent", lambda warm: throughput_rounds(targets, None, plan, "tput-agent", warm), results.throughput)
        await scenario("codex", lambda warm: throughput_rounds(targets, codex, plan, "tput-codex", warm, RESPONSES), results.throughput)
    finally:
        for session in sessions:
            await session.close()
    return results


def _run_client(urls: dict[str, Endpoint], plan: Plan, log: Callable[[str], None]) -> Results:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_measure(urls, plan, log))


def _baseline_argv(tree: Path, *args: str) -> list[str]:
    """``python -m proxy ARGS`` importing kvwarm from ``tree`` (another version's ``proxy/``,
    e.g. ``git archive COMMIT proxy config | tar -x -C TREE``) ahead of this checkout."""
    code = f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); runpy.run_module('proxy', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", code, *args]


def baseline_label(tree: Path) -> str:
    """The column's name: ``kvwarm@`` and what the tree says it is (its ``.label`` file), else its name."""
    label = tree / ".label"
    name = label.read_text().strip() if label.is_file() else tree.name
    return f"kvwarm@{name}"


def run(quick: bool = False, with_peers: bool = False, baseline: Path | None = None) -> Section:
    """``baseline``: another kvwarm version's tree, measured alongside as a column (before/after
    figures of one run)."""
    started = time.perf_counter()
    plan = Plan.quick() if quick else Plan()

    def log(step: str) -> None:
        print(f"[bench] proxy overhead: {step}", file=sys.stderr, flush=True)

    peer_note: str | None = None
    log_dir = REPO / "var" / "bench"
    with Servers(log_dir) as group:
        echo = group.start(
            "echo-upstream", python_module("tests.bench.proxy_latency", "--echo-upstream", "--port", "{port}"), "/v1/models"
        )
        urls: dict[str, Endpoint] = {"direct": (echo.base_url, None, None)}
        bare = group.start(
            "passthrough",
            python_module("tests.bench.passthrough", "--port", "{port}", "--upstream", echo.base_url),
            "/v1/models",
        )
        urls["bare"] = (bare.base_url, bare.proc.pid, None)
        plumbing = group.start(
            "passthrough-kvwarm-transport",
            python_module("tests.bench.passthrough", "--port", "{port}", "--upstream", echo.base_url, "--client", "kvwarm"),
            "/v1/models",
        )
        urls[TRANSPORT_ONLY] = (plumbing.base_url, plumbing.proc.pid, None)
        kvwarm = group.start(
            "kvwarm",
            python_module("proxy", "serve", "--port", "{port}", "--upstream", echo.base_url, "--store", "memory"),
            "/readyz",
            env={"KVWARM_LOG_LEVEL": "WARNING"},
        )
        urls["kvwarm"] = (kvwarm.base_url, kvwarm.proc.pid, None)
        if baseline is not None:
            before = group.start(
                "kvwarm-baseline",
                _baseline_argv(baseline, "serve", "--port", "{port}", "--upstream", echo.base_url, "--store", "memory"),
                "/readyz",
                env={"KVWARM_LOG_LEVEL": "WARNING"},
            )
            urls[baseline_label(baseline)] = (before.base_url, before.proc.pid, None)
        if with_peers:
            try:
                log("starting LiteLLM (installs it on first use)")
                litellm = peers.start_litellm(group, echo.base_url)
                urls["litellm"] = (litellm.base_url, litellm.proc.pid, f"Bearer {peers.master_key()}")
                peer_note = f"LiteLLM {peers.litellm_version()} proxy (`litellm --num_workers 1`, its own virtualenv)."
            except peers.PeerUnavailable as exc:
                peer_note = f"LiteLLM could not be run here: {exc}"
        results = _run_client(urls, plan, log)
        for server in group.started:
            if server.proc.poll() is not None and server.name in (*urls, "echo-upstream", "kvwarm-baseline", "passthrough-kvwarm-transport"):
                raise BenchError(f"{server.name} died during the benchmark:\n{server.log_tail()}")
    return _section(results, list(urls), plan, peer_note, time.perf_counter() - started)


NOISE = 0.05e-3
"""Added latencies below 50 µs are within the noise of this machine: no ratio is taken."""


def _cell(value: float, base: float | None) -> str:
    text = ms(value)
    if base is not None:
        text += f" ({(value - base) * 1e3:+.2f})"
    return text


def _added_ratio(kvwarm: float, bare: float) -> tuple[str, str, bool | None]:
    """(ratio text, aim mark, met?) for kvwarm's added latency against bare's."""
    if bare < NOISE:
        # Negative or tiny: the percentile's noise exceeds the proxy's cost; no ratio.
        return "noise", "–", None
    r = kvwarm / bare
    return x(r), mark(r <= ADDED_AIM), r <= ADDED_AIM


def _section(results: Results, names: list[str], plan: Plan, peer_note: str | None, seconds: float) -> Section:
    proxies = [n for n in names if n != "direct"]
    others = [n for n in proxies if n not in ("bare", "kvwarm")]
    sizes = results.body_sizes
    labels = {
        "small": f"{sizes['small']} conversation, last turn changed",
        "large": f"{sizes['large']} conversation, last turn changed",
        "ttfb": f"streaming, time to first byte, {sizes['small']}",
        "tokens": f"streaming {STREAM_TOKENS} tokens, a chunk each, to the last byte, {sizes['small']}",
        "agent": "agent loop (growing conversation, ~10→20 KiB)",
        "codex": f"Responses API, a Codex CLI request ({sizes['codex']}), last turn changed, streamed",
    }
    columns = ["scenario", *names, "kvwarm / direct", "kvwarm added ÷ bare added", f"aim ≤{ADDED_AIM:g}x"]
    columns += [f"{o} added ÷ bare added" for o in others]
    table = Table("Latency, client-side (in parentheses: added vs direct, ms)", columns)
    misses: list[str] = []
    for scenario, per_target in results.latency.items():
        for q, qname in ((0.5, "p50"), (0.99, "p99")):
            stat = {n: percentile(per_target[n], q) for n in names}
            direct = stat["direct"]
            added = {n: stat[n] - direct for n in proxies}
            text, aim, ok = _added_ratio(added["kvwarm"], added["bare"])
            if ok is False:
                misses.append(f"{labels[scenario]} {qname} added latency ({text})")
            table.add(
                f"{labels[scenario]}, {qname}",
                *(_cell(stat[n], None if n == "direct" else direct) for n in names),
                x(ratio(stat["kvwarm"], direct)), text, aim,
                *(_added_ratio(added[o], added["bare"])[0] for o in others),
            )
    table.notes.append(
        f"Samples per target: {plan.small} (2 KiB and Codex), {plan.large} (200 KiB), {plan.stream} (each stream case), "
        f"{plan.agent_runs}×{plan.agent_turns} agent turns, after warm-up; targets interleaved in rotating order. "
        "Added latency = the target's percentile minus direct's; below 50 µs it is noise and no ratio is taken."
    )
    table.notes.append(
        f"kvwarm, the bare pass-through and the client (this process) run on {loop_kind()}; the echo "
        "upstream on asyncio's default loop. 2 CPUs shared by client, proxies and upstream (and whatever "
        "else runs on the machine): p99 is mostly scheduling noise."
    )
    if peer_note:
        table.notes.append(peer_note)

    cpu = Table(
        "Proxy CPU time per request (user + system of the proxy process, all threads; immune to scheduling noise)",
        ["scenario", *proxies, "kvwarm / bare", "aim", *[f"{o} / bare" for o in others]],
    )
    for scenario, per_proxy in results.cpu.items():
        if "bare" not in per_proxy or "kvwarm" not in per_proxy:
            continue
        key = scenario.removeprefix("throughput, ")
        label = labels.get(key, key) + (f", {CONCURRENCY} concurrent" if scenario.startswith("throughput, ") else "")
        r = ratio(per_proxy["kvwarm"], per_proxy["bare"])
        aim = CPU_AIMS.get(key)
        if aim is not None and not r <= aim:
            misses.append(f"CPU per request, {label} ({x(r)} of bare, aim ≤{aim:g}x)")
        cpu.add(
            label, *(ms(per_proxy[n]) if n in per_proxy else "n/a" for n in proxies),
            x(r), f"≤{aim:g}x {mark(r <= aim)}" if aim is not None else "–",
            *(x(ratio(per_proxy[o], per_proxy["bare"])) if o in per_proxy else "n/a" for o in others),
        )
    cpu.notes.append(
        "From /proc/PID/stat (10 ms ticks) over each case after its warm-up, divided by its requests: the "
        "steady state. The warm-up includes each conversation's first request, which records (and tokenizes) "
        "it whole, once; the agent loops start a new session every 25 turns, so theirs include first turns."
    )

    tcols = ["case", *[f"{n} req/s" for n in names], "kvwarm / direct", "kvwarm / bare", f"aim ≥{THROUGHPUT_AIM:g}x"]
    tcols += [f"{o} / bare" for o in others]
    tput = Table(
        f"Throughput, {CONCURRENCY} concurrent clients (median of {plan.rounds} rounds × {plan.round_seconds:g} s per target)",
        tcols,
    )
    for scenario, per_target in results.throughput.items():
        med = {n: median(per_target[n]) for n in names}
        r = ratio(med["kvwarm"], med["bare"])
        ok = r >= THROUGHPUT_AIM
        if not ok:
            misses.append(f"throughput, {labels[scenario]} ({x(r)} of bare)")
        tput.add(
            labels[scenario], *(f"{med[n]:.0f}" for n in names),
            x(ratio(med["kvwarm"], med["direct"])), x(r), mark(ok),
            *(x(ratio(med[o], med["bare"])) for o in others),
        )
    tput.notes.append(
        "On 2 CPUs the client, the upstream and the proxy share the cores: a proxy's requests/s follow the CPU "
        "the three spend per request, so a proxy that spends more CPU than the bare pass-through cannot match "
        "its throughput. Agent loops: 32 sessions at a time, each new every 25 turns."
    )
    findings: list[str] = []
    if misses:
        findings.append("kvwarm misses the aim on: " + "; ".join(misses) + ".")
    else:
        findings.append("kvwarm meets every aim that can be judged (CPU, added latency, throughput).")
    cpu_ratios = [ratio(v["kvwarm"], v["bare"]) for v in results.cpu.values() if "kvwarm" in v and "bare" in v]
    if cpu_ratios:
        findings.append(
            f"kvwarm's process uses {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}x the CPU per request of the "
            "bare pass-through (see the CPU table): that difference, not the network, is its overhead."
        )
    return Section("1. Proxy overhead (issues 2 and 15)", [table, cpu, tput], findings, seconds)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="proxy overhead only, or (--echo-upstream) the echo upstream")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--echo-upstream", action="store_true", help="serve the echo upstream on --port")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--baseline", type=Path, metavar="TREE",
        help="also measure the kvwarm in TREE (e.g. `git archive COMMIT proxy config | tar -x -C TREE`)",
    )
    args = parser.parse_args()
    if args.echo_upstream:
        web.run_app(echo_app(), host="127.0.0.1", port=args.port, access_log=None, print=None)
        return
    print(run(args.quick, args.peers, args.baseline).markdown())


if __name__ == "__main__":
    main()
