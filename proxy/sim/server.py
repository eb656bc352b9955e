"""The reference upstream's HTTP edge: an OpenAI-compatible aiohttp app.

Routes:

- ``POST /v1/chat/completions`` — renders the request (:mod:`.render`), looks
  the prompt up in the prefix cache (:mod:`.cache`), waits the time to first
  token, answers with a deterministic reply (:mod:`.replies`) as JSON or SSE,
  with ``usage`` (and ``openhuman`` blocks when configured).
- ``GET /v1/models`` — one model.
- ``GET /sim/requests`` — the chat requests received, most recent last.
- ``POST /sim/reset`` — clears the prefix cache and the request log.

Request headers steering one request:

- ``x-sim-fault: k=v,...`` — ``status=503`` (OpenAI-style error body),
  ``retry_after=2`` (``Retry-After`` header), ``delay=1.5`` (seconds before the
  response headers), ``reset_after=N`` (stream N chunks, then drop the TCP
  connection; non-streaming: drop it before answering), ``stall=S`` (seconds
  between chunks after the first);
- ``x-sim-reply-tokens: N`` — size of a text reply (default 40);
- ``x-sim-reasoning: 1`` — add ``reasoning_content``;
- ``x-sim-compress: gzip`` — gzip a non-streaming body.

All state lives in the app under :data:`SIM_STATE`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import hdrs, web

from .cache import PrefixCache, block_hashes
from .render import (
    Segment,
    encode_segments,
    get_encoding,
    render_segments,
    reply_segments,
    segments_text,
)
from .replies import DEFAULT_REPLY_TOKENS, Reply, make_reply, reply_deltas

logger = logging.getLogger(__name__)

CACHE_MODES = ("openai", "vllm")
MODEL_ID = "kvwarm-sim"
REQUEST_LOG_SIZE = 1000
THREAD_THRESHOLD_BYTES = 20_000
"""Bodies larger than this are parsed, rendered, tokenized and block-hashed in a worker thread."""
MAX_REPLY_TOKENS = 100_000

FAULT_HEADER = "x-sim-fault"
REPLY_TOKENS_HEADER = "x-sim-reply-tokens"
REASONING_HEADER = "x-sim-reasoning"
COMPRESS_HEADER = "x-sim-compress"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ERROR_CODES = {
    401: "invalid_api_key",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How the reference upstream behaves."""

    cache_mode: str = "openai"
    """``"openai"`` (128-token blocks, hits from 1024 tokens, prompts only) or
    ``"vllm"`` (16-token blocks, the generated reply is cached too)."""
    openhuman: bool = False
    """Add ``openhuman.usage`` / ``openhuman.billing`` blocks."""
    ttl_seconds: float = 3600.0
    """Prefix-cache TTL since last use."""
    capacity_blocks: int = 200_000
    """LRU bound of the prefix cache, in blocks."""
    ttft_base: float = 0.0
    """Seconds before the first token."""
    ttft_per_uncached_token: float = 0.0
    """Extra seconds per uncached prompt token."""
    chunk_delay: float = 0.0
    """Seconds between streamed chunks."""
    price_input: float = 2.5
    """USD per 1M uncached input tokens (openhuman billing)."""
    price_cached_input: float = 1.25
    """USD per 1M cached input tokens."""
    price_output: float = 10.0
    """USD per 1M output tokens."""

    def __post_init__(self) -> None:
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, not {self.cache_mode!r}")
        for name in ("ttft_base", "ttft_per_uncached_token", "chunk_delay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    """One chat request as the reference upstream received it."""

    method: str
    path: str
    headers: dict[str, str]
    """Header names lower-cased."""
    body: bytes


@dataclass(slots=True)
class SimState:
    """Everything the reference upstream remembers; lives in the app under :data:`SIM_STATE`."""

    config: SimConfig
    cache: PrefixCache
    requests: list[ReceivedRequest] = field(default_factory=list)
    """The last :data:`REQUEST_LOG_SIZE` chat requests, most recent last."""
    clock: Callable[[], float] = time.monotonic
    """Time source of the prefix cache (replaceable in tests)."""

    def record(self, request: ReceivedRequest) -> None:
        self.requests.append(request)
        if len(self.requests) > REQUEST_LOG_SIZE:
            del self.requests[: len(self.requests) - REQUEST_LOG_SIZE]

    def reset(self) -> None:
        self.cache.clear()
        self.requests.clear()


SIM_STATE: web.AppKey[SimState] = web.AppKey("sim_state", SimState)


@dataclass(frozen=True, slots=True)
class Faults:
    """The faults one request asked for with ``x-sim-fault``."""

    status: int | None = None
    retry_after: str | None = None
    delay: float = 0.0
    reset_after: int | None = None
    stall: float = 0.0

    @classmethod
    def parse(cls, header: str | None) -> Faults:
        """``"status=503,retry_after=2"`` -> :class:`Faults`; ``ValueError`` names a bad item."""
        values: dict[str, Any] = {}
        for item in (header or "").split(","):
            if not item.strip():
                continue
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or not raw:
                raise ValueError(f"fault {item.strip()!r} is not key=value")
            if key not in _FAULT_PARSERS:
                raise ValueError(f"unknown fault {key!r} (known: {', '.join(_FAULT_PARSERS)})")
            try:
                values[key] = _FAULT_PARSERS[key](raw)
            except ValueError:
                raise ValueError(f"invalid value for fault {key!r}: {raw!r}") from None
        return cls(**values)


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if not low <= value <= high:
            raise ValueError(raw)
        return value

    return parse


def _seconds(raw: str) -> float:
    value = float(raw)
    if not 0 <= value < float("inf"):
        raise ValueError(raw)
    return value


_FAULT_PARSERS: Mapping[str, Callable[[str], Any]] = {
    "status": _bounded_int(400, 599),
    "retry_after": str,
    "delay": _seconds,
    "reset_after": _bounded_int(0, 1_000_000),
    "stall": _seconds,
}


@dataclass(frozen=True, slots=True)
class Prompt:
    """A parsed chat request and its rendered prompt."""

    request: dict[str, Any]
    segments: list[Segment]
    tokens: list[int]
    hashes: list[bytes]
    """Chained block hashes of ``tokens`` (for the prefix cache)."""
    seed: bytes
    """Hash of the prompt text: what makes the reply deterministic."""


@dataclass(frozen=True, slots=True)
class Accounting:
    """Token counts of one exchange."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int

    def usage(self) -> dict[str, Any]:
        """The OpenAI ``usage`` block."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": self.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }

    def openhuman(self, config: SimConfig) -> dict[str, Any]:
        """The ``openhuman`` block: usage and the amount charged at the configured prices."""
        uncached = self.prompt_tokens - self.cached_tokens
        charged = (
            uncached * config.price_input
            + self.cached_tokens * config.price_cached_input
            + self.completion_tokens * config.price_output
        ) / 1_000_000
        return {
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "cached_input_tokens": self.cached_tokens,
            },
            "billing": {"charged_amount_usd": charged, "currency": "USD"},
        }


def create_sim_app(config: SimConfig | None = None) -> web.Application:
    """The reference upstream as an aiohttp application."""
    config = config or SimConfig()
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[SIM_STATE] = SimState(config=config, cache=cache_for(config))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/sim/requests", list_requests)
    app.router.add_post("/sim/reset", reset)
    app.on_startup.append(_load_encoding)
    return app


async def _load_encoding(app: web.Application) -> None:
    # Loading the tokenizer takes a moment: do it before the first request, so
    # that request's time to first token measures only what the config says.
    await asyncio.to_thread(get_encoding)


def cache_for(config: SimConfig) -> PrefixCache:
    """The prefix cache of ``config.cache_mode``."""
    if config.cache_mode == "vllm":
        return PrefixCache(16, 0, config.ttl_seconds, config.capacity_blocks)
    return PrefixCache(128, 1024, config.ttl_seconds, config.capacity_blocks)


@contextlib.asynccontextmanager
async def running_sim(
    config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve the reference upstream while the block runs; yields its base URL (``http://h:p/v1``)."""
    runner = web.AppRunner(create_sim_app(config), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        yield f"http://{host}:{bound[1]}/v1"
    finally:
        await runner.cleanup()


async def serve_sim(host: str, port: int, config: SimConfig | None = None) -> None:
    """Serve the reference upstream until cancelled (for the CLI: ``asyncio.run(serve_sim(...))``)."""
    async with running_sim(config, host, port) as url:
        logger.info("reference upstream listening on %s", url)
        await asyncio.Event().wait()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    state = request.app[SIM_STATE]
    config = state.config
    body = await request.read()
    state.record(
        ReceivedRequest(
            method=request.method,
            path=request.path,
            headers={name.lower(): value for name, value in request.headers.items()},
            body=body,
        )
    )
    try:
        faults = Faults.parse(request.headers.get(FAULT_HEADER))
        reply_tokens = _reply_tokens(request.headers.get(REPLY_TOKENS_HEADER))
    except ValueError as exc:
        return error_response(400, str(exc), code="invalid_sim_header")
    if faults.delay:
        await asyncio.sleep(faults.delay)
    if faults.status is not None:
        return _fault_response(faults)

    try:
        if len(body) > THREAD_THRESHOLD_BYTES:
            prompt = await asyncio.to_thread(parse_prompt, body, state.cache.block_size)
        else:
            prompt = parse_prompt(body, state.cache.block_size)
    except InvalidJSON as exc:
        return error_response(400, str(exc), code="invalid_json")
    except ValueError as exc:
        return error_response(400, str(exc), code="invalid_request")

    now = state.clock()
    cached = state.cache.lookup(prompt.tokens, now, prompt.hashes)
    state.cache.insert(prompt.tokens, now, prompt.hashes)

    reply = make_reply(
        prompt.request,
        prompt.seed,
        reply_tokens=reply_tokens,
        reasoning=request.headers.get(REASONING_HEADER, "").strip() in ("1", "true", "yes"),
    )
    reply_tail = reply_segments(reply.message())
    accounting = Accounting(
        prompt_tokens=len(prompt.tokens),
        cached_tokens=cached,
        completion_tokens=len(encode_segments(reply_tail[:1])),
        reasoning_tokens=len(encode_segments([reply.reasoning_content or ""])),
    )
    ttft = config.ttft_base + config.ttft_per_uncached_token * (len(prompt.tokens) - cached)
    if ttft:
        await asyncio.sleep(ttft)

    model = prompt.request.get("model")
    model = model if isinstance(model, str) and model else MODEL_ID
    completion_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    response: web.StreamResponse
    if prompt.request.get("stream") is True:
        response, completed = await _stream(
            request, config, faults, completion_id, model, reply, accounting, prompt.request
        )
    elif faults.reset_after is not None:
        _drop_connection(request)
        response, completed = web.Response(), False
    else:
        response = _json_response(request, config, completion_id, model, reply, accounting)
        completed = True
    if completed and config.cache_mode == "vllm":
        # A local engine keeps the KV of what it generated: the prompt plus the
        # reply, tokenized as the reply will be rendered in the next request.
        generated = prompt.tokens + encode_segments(reply_tail)
        hashes = state.cache.block_hashes(generated, known=prompt.hashes)
        state.cache.insert(generated, state.clock(), hashes)
    return response


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    data = [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "kvwarm"}]
    return _orjson_response({"object": "list", "data": data})


async def list_requests(request: web.Request) -> web.Response:
    """``GET /sim/requests``: the chat requests received, most recent last."""
    entries = []
    for received in request.app[SIM_STATE].requests:
        try:
            body, encoding = received.body.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            body, encoding = base64.b64encode(received.body).decode("ascii"), "base64"
        entries.append(
            {
                "method": received.method,
                "path": received.path,
                "headers": received.headers,
                "body": body,
                "body_encoding": encoding,
            }
        )
    return _orjson_response(entries)


async def reset(request: web.Request) -> web.Response:
    """``POST /sim/reset``: clear the prefix cache and the request log."""
    request.app[SIM_STATE].reset()
    return _orjson_response({"reset": True})


class InvalidJSON(ValueError):
    """The request body is not JSON."""


def parse_prompt(body: bytes, block_size: int) -> Prompt:
    """Parse, validate, render, tokenize and block-hash a chat request.

    CPU work: the handler runs it in a worker thread for big bodies.
    """
    try:
        # The stdlib parser keeps integers beyond 64 bits exact (orjson turns them
        # into floats, which would render differently from what the client sent).
        request = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidJSON(f"the body is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise ValueError("the body must be a JSON object")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    tools = request.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("'tools' must be a list")
    segments = render_segments(messages, tools)
    tokens = encode_segments(segments)
    return Prompt(
        request=request,
        segments=segments,
        tokens=tokens,
        hashes=block_hashes(tokens, block_size),
        seed=hashlib.sha256(segments_text(segments).encode()).digest(),
    )


def error_response(
    status: int, message: str, *, code: str | None = None, headers: Mapping[str, str] | None = None
) -> web.Response:
    """An OpenAI-style error: ``{"error": {"message", "type", "code"}}``."""
    error_type = _ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    payload = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return _orjson_response(payload, status=status, headers=headers)


def _fault_response(faults: Faults) -> web.Response:
    assert faults.status is not None
    headers: dict[str, str] = {}
    if faults.retry_after is not None:
        headers[str(hdrs.RETRY_AFTER)] = faults.retry_after
    return error_response(
        faults.status,
        f"simulated upstream error {faults.status} (x-sim-fault)",
        code=_ERROR_CODES.get(faults.status, "sim_fault"),
        headers=headers,
    )


def _json_response(
    request: web.Request,
    config: SimConfig,
    completion_id: str,
    model: str,
    reply: Reply,
    accounting: Accounting,
) -> web.Response:
    payload: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fp_kvwarm_sim",
        "choices": [
            {
                "index": 0,
                "message": reply.message(),
                "logprobs": None,
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": accounting.usage(),
    }
    if config.openhuman:
        payload["openhuman"] = accounting.openhuman(config)
    data = orjson.dumps(payload)
    headers: dict[str, str] = {}
    if request.headers.get(COMPRESS_HEADER, "").strip().lower() == "gzip":
        data = gzip.compress(data)
        headers[hdrs.CONTENT_ENCODING] = "gzip"
    return web.Response(body=data, content_type="application/json", headers=headers)


async def _stream(
    request: web.Request,
    config: SimConfig,
    faults: Faults,
    completion_id: str,
    model: str,
    reply: Reply,
    accounting: Accounting,
    chat: Mapping[str, Any],
) -> tuple[web.StreamResponse, bool]:
    """Stream ``reply`` as SSE; returns the response and whether the stream completed."""
    options = chat.get("stream_options")
    include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": "fp_kvwarm_sim",
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage
            if usage is not None and config.openhuman:
                payload["openhuman"] = accounting.openhuman(config)
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    events = [
        chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
        for delta in reply_deltas(reply)
    ]
    events.append(
        chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reply.finish_reason}])
    )
    if include_usage:
        events.append(chunk([], accounting.usage()))
    events.append(b"data: [DONE]\n\n")

    response = web.StreamResponse(
        headers={hdrs.CONTENT_TYPE: "text/event-stream", hdrs.CACHE_CONTROL: "no-cache"}
    )
    await response.prepare(request)
    try:
        for position, event in enumerate(events):
            if faults.reset_after is not None and position >= faults.reset_after:
                _drop_connection(request)
                return response, False
            if position > 0:
                pause = config.chunk_delay + faults.stall
                if pause:
                    await asyncio.sleep(pause)
            await response.write(event)
        await response.write_eof()
    except ConnectionError:
        logger.debug("client went away mid-stream")
        return response, False
    return response, True


def _drop_connection(request: web.Request) -> None:
    # Closing the transport flushes what was written and sends FIN without the
    # chunked terminator: the client sees a truncated body. aiohttp then fails
    # to write the end of the response and treats it as a client disconnect.
    transport = request.transport
    if transport is not None:
        transport.close()


def _reply_tokens(header: str | None) -> int:
    if header is None or not header.strip():
        return DEFAULT_REPLY_TOKENS
    try:
        value = int(header)
    except ValueError:
        raise ValueError(f"{REPLY_TOKENS_HEADER} must be an integer, not {header!r}") from None
    if not 1 <= value <= MAX_REPLY_TOKENS:
        raise ValueError(f"{REPLY_TOKENS_HEADER} must be between 1 and {MAX_REPLY_TOKENS}")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _orjson_response(
    payload: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(payload), status=status, content_type="application/json", headers=headers
    )
