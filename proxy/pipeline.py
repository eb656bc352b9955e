"""One request, top to bottom: the :class:`Exchange` and the ordered stages that fill it.

::

    read body -> parse -> fingerprint (identify, match, repair, diagnose) -> forward
      -> relay (JSON or SSE, observed on the side) -> finish (record, usage, metrics, log)

Enrichment stages fail open: an error in fingerprinting, recording or usage
parsing is logged and counted (``kvwarm_errors_total{stage}``) and the
request proceeds with the client's original bytes. Only the upstream itself
can fail a request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from aiohttp import web

from .config import Settings
from .core.breaks import Break, diagnose
from .core.identity import IdentityMemo
from .core.match import Match, match_request, new_nodes, tenant_root
from .tenancy import tenant_credential
from .core.policy import Policy
from .core.pricing import Cost, PriceTable, cost_of
from .core.record import Reply, ReplyAssembler, reply_from_body
from .core.repair import RepairPlan, plan_repair
from .core.sse import SSEEvent
from .core.usage import Usage, extract_usage, is_usage_only_chunk, merge_usage
from .errors import BodyTooLarge, ProxyError
from .metrics import ProxyMetrics
from .relay import DONE, RelayOutcome, is_event_stream, read_body, relay_events
from .store.base import Node, SessionTotals, TranscriptStore
from .tokens import TokenCounter
from .upstream import UpstreamSender, forward_request_headers, forward_response_headers

log = logging.getLogger(__name__)

PREFIX_HEADER = "x-kvwarm-prefix"
BREAK_HEADER = "x-kvwarm-break"
CHAT_SUFFIX = "/chat/completions"
INLINE_TOKENIZE_BYTES = 4096
"""New node bodies up to this many bytes in all are tokenized on the event loop (~0.1 ms);
larger ones in a worker thread."""


@dataclass(slots=True, eq=False)
class Exchange:
    """Everything kvwarm knows about one request, filled stage by stage."""

    request: web.Request
    started: float = field(default_factory=time.perf_counter)
    """perf_counter at arrival."""
    raw_body: bytes = b""
    """The client's body bytes, exactly as received."""
    body: dict[str, Any] | None = None
    """The parsed chat request; None when the body is not a JSON chat request (forwarded untouched)."""
    model: str = ""
    stream: bool = False
    match: Match | None = None
    """The stored prefix this request continues."""
    plan: RepairPlan | None = None
    """What was restored to the stored form."""
    brk: Break | None = None
    """Why the request left the stored tree, if it did."""
    forward_body: bytes = b""
    """The bytes sent upstream: the client's, unless repaired or stream usage was requested."""
    usage_injected: bool = False
    """kvwarm added ``stream_options.include_usage`` and hides the usage-only chunk from the client."""
    status: int | None = None
    """Upstream status (None when the upstream could not be reached)."""
    ttfb: float | None = None
    """Seconds from arrival to the upstream's response headers."""
    usage: Usage | None = None
    reply: Reply | None = None
    """The assistant reply as generated (or as delivered, when the client left mid-stream)."""
    cost: Cost | None = None
    client_gone: bool = False
    failed: list[str] = field(default_factory=list)
    """Stages that failed open."""

    @property
    def messages(self) -> list[Any]:
        msgs = self.body.get("messages") if self.body else None
        return msgs if isinstance(msgs, list) else []


class Pipeline:
    """The stages, wired to the app's upstream, store, metrics and price table."""

    def __init__(
        self,
        settings: Settings,
        upstream: UpstreamSender,
        store: TranscriptStore,
        metrics: ProxyMetrics,
        prices: PriceTable,
        tokens: TokenCounter,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.store = store
        self.metrics = metrics
        self.prices = prices
        self.tokens = tokens
        self.policy = Policy.build(
            repair=settings.repair.enabled,
            collapse_duplicates=settings.repair.collapse_duplicates,
            pin_patterns=settings.repair.pin_patterns,
        )
        self._roots: dict[str, bytes] = {}
        self.upstream_reports_timings = False
        """Set once a response carried llama.cpp's ``timings`` block. Such an upstream reports
        cached and prefilled tokens in every stream's finish chunk, so kvwarm stops adding
        ``include_usage`` (which would move ``timings`` into the usage chunk it hides)."""
        self.memo = IdentityMemo()

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ex = Exchange(request)
        with self.metrics.inflight():
            try:
                ex.raw_body = await self.read_request_body(request)
                self.parse(ex)
                if ex.body is not None:
                    self.fingerprint(ex)
                try:
                    ex.forward_body = self.forward_bytes(ex)
                except Exception:
                    log.exception("building the forwarded body failed; forwarding the request unchanged")
                    self.metrics.error("repair")
                    ex.failed.append("repair")
                    ex.forward_body, ex.plan, ex.usage_injected = ex.raw_body, None, False
                return await self.forward(ex)
            finally:
                if ex.body is not None:
                    self.observe(ex)

    async def read_request_body(self, request: web.Request) -> bytes:
        limit = self.settings.server.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"request body of {request.content_length} bytes exceeds the {limit}-byte limit")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise BodyTooLarge(f"request body exceeds the {limit}-byte limit") from exc

    def parse(self, ex: Exchange) -> None:
        """A JSON object with a ``messages`` list on a chat path; anything else passes untouched."""
        request = ex.request
        if request.method != "POST" or not request.path.endswith(CHAT_SUFFIX) or not ex.raw_body:
            return
        try:
            body = orjson.loads(ex.raw_body)
        except orjson.JSONDecodeError:
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return
        ex.body = body
        model = body.get("model")
        ex.model = model if isinstance(model, str) else ""
        ex.stream = body.get("stream") is True

    def fingerprint(self, ex: Exchange) -> None:
        """Identify, match, repair and diagnose; on any error, forward the original bytes."""
        assert ex.body is not None
        stage = "identify"
        try:
            root = self.tenant_of(ex.request)
            stage = "match"
            ex.match = match_request(ex.body, root, self.store, self.policy, self.memo)
            stage = "repair"
            ex.plan = plan_repair(ex.body, ex.match, self.policy)
            stage = "diagnose"
            ex.brk = diagnose(ex.body, ex.match, self.store)
        except Exception:
            log.exception("fingerprinting failed at %s; forwarding the request unchanged", stage)
            self.metrics.error(stage)
            ex.failed.append(stage)
            ex.match = ex.plan = ex.brk = None

    def tenant_of(self, request: web.Request) -> bytes:
        credential = tenant_credential(request.headers, self.settings.store.tenant_header)
        root = self._roots.get(credential)
        if root is None:
            if len(self._roots) > 10_000:
                self._roots.clear()
            root = self._roots[credential] = tenant_root(self.store.secret(), credential)
        return root

    def forward_bytes(self, ex: Exchange) -> bytes:
        """The client's bytes unless something must change; re-serialized at most once."""
        if ex.body is None:
            return ex.raw_body
        repaired = ex.plan.body if ex.plan is not None else None
        options = ex.body.get("stream_options")
        needs_usage = (
            ex.stream
            and not self.upstream_reports_timings
            and not (isinstance(options, dict) and options.get("include_usage") is True)
        )
        if needs_usage and (options is None or isinstance(options, dict)):
            ex.usage_injected = True
            if repaired is None and options is None:
                # Splice the option in front so the client's own bytes travel unchanged.
                start = ex.raw_body.index(b"{") + 1
                return ex.raw_body[:start] + b'"stream_options":{"include_usage":true},' + ex.raw_body[start:]
            body = dict(repaired if repaired is not None else ex.body)
            body["stream_options"] = {**(options or {}), "include_usage": True}
            return orjson.dumps(body)
        return orjson.dumps(repaired) if repaired is not None else ex.raw_body

    async def forward(self, ex: Exchange) -> web.StreamResponse:
        request = ex.request
        headers = forward_request_headers(request.headers, self.settings.upstream.api_key)
        try:
            upstream = await self.upstream.send(
                request.method, request.path, request.query_string, headers, ex.forward_body
            )
        except ProxyError:
            self.metrics.error("upstream")
            raise
        ex.status = upstream.status
        ex.ttfb = time.perf_counter() - ex.started
        extra = self.visibility_headers(ex)
        if is_event_stream(upstream):
            assembler = ReplyAssembler()

            def on_event(event: SSEEvent) -> bool | bytes:
                return self.observe_event(ex, assembler, event)

            async def finish(outcome: RelayOutcome) -> None:
                ex.client_gone = outcome.client_gone
                if outcome.upstream_error is not None:
                    self.metrics.error("relay")
                try:
                    ex.reply = assembler.result()
                except Exception:
                    log.exception("assembling the streamed reply failed")
                    self.metrics.error("record")
                await self.finish(ex)

            return await relay_events(request, upstream, self.upstream, extra, on_event, finish)
        try:
            data = await read_body(upstream, self.upstream)
        except ProxyError:
            self.metrics.error("upstream")
            raise
        if ex.body is not None and 200 <= upstream.status < 300:
            self.observe_body(ex, data)
        await self.finish(ex)
        response_headers = forward_response_headers(upstream.headers)
        response_headers.update(extra)
        return web.Response(status=upstream.status, reason=upstream.reason, body=data, headers=response_headers)

    # -- observing the response -----------------------------------------------------------

    def observe_body(self, ex: Exchange, data: bytes) -> None:
        try:
            payload = orjson.loads(data)
            if isinstance(payload, dict):
                ex.usage = extract_usage(payload)
                if "timings" in payload:
                    self.upstream_reports_timings = True
                ex.reply = reply_from_body(payload)
        except Exception:
            log.debug("response body is not a chat completion", exc_info=True)
            self.metrics.error("usage")

    def observe_event(self, ex: Exchange, assembler: ReplyAssembler, event: SSEEvent) -> bool | bytes:
        """Feed one SSE event to the observers; False hides it from the client."""
        if ex.body is None or event.data is None or event.data == DONE:
            if event.data == DONE:
                assembler.done()
            return True
        try:
            chunk = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            return True
        if not isinstance(chunk, dict):
            return True
        try:
            ex.usage = merge_usage(ex.usage, extract_usage(chunk))
            if "timings" in chunk:
                self.upstream_reports_timings = True
            assembler.feed(chunk)
        except Exception:
            log.exception("observing a stream chunk failed")
            self.metrics.error("usage")
            return True
        if not ex.usage_injected:
            return True
        if is_usage_only_chunk(chunk):
            return False
        if "usage" in chunk and chunk["usage"] is None:
            # include_usage makes OpenAI-style upstreams add "usage": null to every chunk; the
            # client did not ask for it, so it gets the event as it would have been without.
            return _without_null_usage(event.raw, chunk)
        return True

    # -- after the response -----------------------------------------------------------------

    async def finish(self, ex: Exchange) -> None:
        """Record the turn and compute its cost, before the response's last bytes go out."""
        if ex.body is None:
            return
        if ex.usage is not None:
            try:
                ex.cost = cost_of(ex.usage, self.prices.lookup(ex.model))
            except Exception:
                log.exception("pricing failed")
                self.metrics.error("usage")
        ok = ex.status is not None and 200 <= ex.status < 300
        if ok and ex.match is not None:
            try:
                await self.record(ex)
            except Exception:
                log.exception("recording the turn failed")
                self.metrics.error("record")
                ex.failed.append("record")

    async def record(self, ex: Exchange) -> None:
        match = ex.match
        assert match is not None and ex.body is not None
        forwarded = ex.plan.body if ex.plan is not None and ex.plan.body is not None else ex.body
        reply = ex.reply
        if reply is not None and ex.client_gone:
            reply = Reply(message=reply.message, finish_reason=reply.finish_reason, partial=True, model=reply.model)
        message = reply.message if reply is not None and _has_output(reply.message) else None
        drafts = new_nodes(
            match,
            forwarded,
            message,
            generated_partial=bool(reply is not None and reply.partial),
            now=time.time(),
            count_tokens=len,
        )
        nodes = [n for n in drafts if self.store.get(n.key) is None]
        if nodes:
            # Token counting is CPU work: inline for a typical turn's few small messages,
            # in a worker thread when the new content is large (a first turn, a resume).
            if sum(n.tokens for n in nodes) <= INLINE_TOKENIZE_BYTES:
                nodes = self.count_tokens(nodes)
            else:
                nodes = await asyncio.to_thread(self.count_tokens, nodes)
            self.store.insert(nodes)
        now = time.time()
        self.store.touch(match.keys[: match.matched], now)
        leaf = drafts[-1].key if drafts else (match.keys[-1] if match.keys else None)
        if leaf is None:
            return
        previous = next((k for k in reversed(match.keys[: match.matched]) if self.store.totals(k) is not None), None)
        usage = ex.usage
        turn = SessionTotals(
            turns=1,
            prompt_tokens=(usage.prompt_tokens or 0) if usage else 0,
            cached_tokens=(usage.cached_tokens or 0) if usage else 0,
            completion_tokens=(usage.completion_tokens or 0) if usage else 0,
            unknown_cache_turns=1 if usage is None or usage.cached_tokens is None else 0,
            cost_usd=(ex.cost.usd or 0.0) if ex.cost else 0.0,
            billed=bool(ex.cost and ex.cost.billed),
            repaired=len(ex.plan.repairs) if ex.plan else 0,
            last_break=ex.brk.reason if ex.brk and ex.brk.reason != "new_branch" else "",
            model=ex.model,
            created=now,
            updated=now,
        )
        self.store.add_turn(leaf, previous if previous != leaf else None, turn)

    def count_tokens(self, nodes: list[Node]) -> list[Node]:
        count = self.tokens.count_body
        return [replace(n, tokens=count(n.body)) for n in nodes]

    def observe(self, ex: Exchange) -> None:
        """Metrics and the per-request log line."""
        duration = time.perf_counter() - ex.started
        try:
            m = self.metrics
            m.observe_request(
                model=ex.model, status=ex.status, stream=ex.stream, duration=duration,
                ttfb=ex.ttfb, usage=ex.usage, cost=ex.cost,
            )
            if ex.match is not None:
                m.observe_match(max(ex.match.matched - 1, 0), len(ex.messages))
            if ex.plan is not None and ex.plan.repairs:
                m.observe_repairs((r.kind for r in ex.plan.repairs), ex.plan.rescued_tokens, ex.model)
            if ex.brk is not None and ex.brk.reason != "new_branch":
                m.observe_break(ex.brk.reason)
        except Exception:
            log.exception("updating metrics failed")
        if log.isEnabledFor(logging.INFO):
            u = ex.usage
            prompt = u.prompt_tokens if u else None
            cached = u.cached_tokens if u else None
            hit = f"{100.0 * cached / prompt:.1f}%" if prompt and cached is not None else "?"
            cost = f"${ex.cost.usd:.6f}{'' if ex.cost.billed else '~'}" if ex.cost and ex.cost.usd is not None else "?"
            log.info(
                "chat model=%s status=%s stream=%s prompt=%s cached=%s hit=%s repaired=%d break=%s cost=%s duration=%.3fs%s",
                ex.model or "-", ex.status, ex.stream, prompt, cached, hit,
                len(ex.plan.repairs) if ex.plan else 0,
                ex.brk.reason if ex.brk and ex.brk.reason != "new_branch" else "-", cost, duration,
                f" failed_open={','.join(ex.failed)}" if ex.failed else "",
            )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prefix %s", self.visibility_headers(ex).get(PREFIX_HEADER, "-"))

    def visibility_headers(self, ex: Exchange) -> dict[str, str]:
        """``x-kvwarm-prefix: matched=12/14; repaired=3; rescued=5120; break=content_changed@13``.

        ``matched`` counts leading messages found in the store out of the request's messages
        (the ``tools`` array is element 0 and not counted); ``break`` names the reason and the
        message index (``tools`` for the tools array).
        """
        if ex.match is None:
            return {}
        n = len(ex.messages)
        matched = max(ex.match.matched - 1, 0)
        parts = [f"matched={matched}/{n}"]
        if ex.match.matched == 0 and ex.brk is not None and ex.brk.reason == "tools_changed":
            parts[0] = f"matched=0/{n}"
        repairs = ex.plan.repairs if ex.plan else ()
        parts.append(f"repaired={len(repairs)}")
        if repairs:
            parts.append(f"rescued={ex.plan.rescued_tokens if ex.plan else 0}")
        headers: dict[str, str] = {}
        if ex.brk is not None and ex.brk.reason != "new_branch":
            where = "tools" if ex.brk.depth == 0 else str(ex.brk.depth - 1)
            parts.append(f"break={ex.brk.reason}@{where}")
            span = ex.brk.span
            if span is not None:
                where_span = "tools" if span.depth == 0 else f"messages[{span.depth - 1}]"
                headers[BREAK_HEADER] = _ascii(
                    f"{ex.brk.reason} at {where_span} offset={span.offset} length={span.length} "
                    f"shape={span.shape} hint={span.hint}"
                )
        headers[PREFIX_HEADER] = "; ".join(parts)
        return headers


_NULL_USAGE = re.compile(rb',[ \t]*"usage"[ \t]*:[ \t]*null(?=[ \t]*[,}])|"usage"[ \t]*:[ \t]*null[ \t]*,[ \t]*')


_NULL_USAGE_TAIL = b',"usage":null}'


def _without_null_usage(raw: bytes, chunk: dict[str, Any]) -> bytes | bool:
    """``raw`` minus its top-level ``"usage": null`` member, the rest byte for byte; True (as is) if unsure."""
    line = raw.rstrip(b"\r\n")
    if line.endswith(_NULL_USAGE_TAIL) and line.startswith(b"data:") and b"\n" not in line and b"\r" not in line:
        # The common shape (OpenAI, vLLM): the member closes a one-line object. Just before the
        # object's final brace it can only be a top-level member: a nested object would end in "}}".
        return line[: -len(_NULL_USAGE_TAIL)] + b"}" + raw[len(line) :]
    stripped, n = _NULL_USAGE.subn(b"", raw, count=1)
    if n != 1:
        return True
    data = b"\n".join(line[5:].lstrip(b" ") for line in stripped.splitlines() if line.startswith(b"data:"))
    try:
        ok = orjson.loads(data) == {k: v for k, v in chunk.items() if k != "usage"}
    except orjson.JSONDecodeError:
        ok = False
    return stripped if ok else True


def _has_output(message: Mapping[str, Any]) -> bool:
    return bool(message.get("content") or message.get("tool_calls") or message.get("reasoning_content"))


_CONTROL = {i: f"\\x{i:02x}" for i in (*range(32), 127)}


def _ascii(text: str) -> str:
    """A header-safe value: non-ASCII and control characters (CR, LF, TAB, ...) escaped."""
    return text.encode("ascii", "backslashreplace").decode("ascii").translate(_CONTROL)[:1000]
