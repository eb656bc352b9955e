"""The reference upstream's HTTP edge: an OpenAI- and Anthropic-compatible aiohttp app, and its chat endpoint.

Routes:

- ``POST /v1/chat/completions`` — renders the request (:mod:`.render`), looks
  the prompt up in the prefix cache (:mod:`.engine`), waits the time to first
  token, answers with a deterministic reply (:mod:`.replies`) as JSON or SSE,
  with ``usage`` (and ``openhuman`` blocks when configured);
- ``POST /v1/responses``, ``GET /v1/responses/{id}`` — the Responses API
  (:mod:`.responses`);
- ``POST /v1/messages``, ``POST /v1/messages/count_tokens`` — Anthropic's
  Messages API (:mod:`.messages`);
- ``GET /v1/models`` — one model;
- ``GET /sim/requests`` — the model requests received (chat, Responses and
  Messages, each with its ``endpoint``), most recent last;
- ``POST /sim/reset`` — clears the prompt cache, the stored Responses and the
  request log;
- ``GET /sim/clock``, ``POST /sim/clock {"advance": seconds}`` — the emulator's
  clock (:mod:`.clock`), read or moved forward: every TTL elapses on it, so
  out-of-process tests and the bench expire cached prefixes without waiting.
  Answers ``{"now": t, "offset": seconds advanced in all}``.

The ``x-sim-*`` request headers steer one request (:mod:`.steering`): faults,
reply size, reasoning, compression.

All state lives in the app under :data:`SIM_STATE` (:mod:`.state`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from aiohttp import web

from .accounting import Accounting
from .engine import keep_generated, prefill, wait_first_token
from .faults import FAULT_HEADER, Faults, drop_connection
from .items import InputError
from .messages import count_tokens, create_message
from .prompt import InvalidJSON, Prompt, build_prompt, load_json, off_loop
from .render import get_encoding, reply_segments
from .replies import Reply, make_reply, reply_deltas
from .responses import create_response, retrieve_response
from .state import (
    CACHE_MODES,
    MODEL_ID,
    REQUEST_LOG_SIZE,
    SIM_STATE,
    ReceivedRequest,
    SimConfig,
    SimState,
    cache_for,
)
from .steering import COMPRESS_HEADER, REASONING_HEADER, REPLY_TOKENS_HEADER, Steering
from .wire import error_response, fault_response, json_response, write_events

__all__ = [
    "CACHE_MODES",
    "COMPRESS_HEADER",
    "FAULT_HEADER",
    "MODEL_ID",
    "REASONING_HEADER",
    "REPLY_TOKENS_HEADER",
    "REQUEST_LOG_SIZE",
    "SIM_STATE",
    "Accounting",
    "Faults",
    "ReceivedRequest",
    "SimConfig",
    "SimState",
    "cache_for",
    "create_sim_app",
    "error_response",
    "parse_prompt",
    "running_sim",
    "serve_sim",
]

logger = logging.getLogger(__name__)


def create_sim_app(config: SimConfig | None = None) -> web.Application:
    """The reference upstream as an aiohttp application."""
    config = config or SimConfig()
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[SIM_STATE] = SimState.create(config)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/sim/requests", list_requests)
    app.router.add_post("/sim/reset", reset)
    app.router.add_get("/sim/clock", read_clock)
    app.router.add_post("/sim/clock", advance_clock)
    app.on_startup.append(_load_encoding)
    return app


async def _load_encoding(app: web.Application) -> None:
    # Loading the tokenizer takes a moment: do it before the first request, so
    # that request's time to first token measures only what the config says.
    await asyncio.to_thread(get_encoding)


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
    state.record(_received(request, body, "chat.completions"))
    try:
        steering = Steering.from_headers(request.headers)
    except ValueError as exc:
        return error_response(400, str(exc), code="invalid_sim_header")
    faults = steering.faults
    if faults.delay:
        await asyncio.sleep(faults.delay)
    if faults.status is not None:
        return fault_response(faults)
    try:
        prompt = await off_loop(len(body), parse_prompt, body, config)
    except InvalidJSON as exc:
        return error_response(400, str(exc), code="invalid_json")
    except InputError as exc:
        return error_response(400, str(exc), code="invalid_request", param=exc.param)
    except ValueError as exc:
        return error_response(400, str(exc), code="invalid_request")

    use = prefill(state, prompt)
    reply = make_reply(
        prompt.request,
        prompt.seed,
        reply_tokens=steering.reply_tokens,
        reasoning=steering.reasoning,
    )
    reply_tail = reply_segments(reply.message())
    accounting = Accounting.of_reply(config, use, prompt, reply_tail, reply.reasoning_content)
    await wait_first_token(config, prompt, use)

    exchange = _ChatExchange(
        config, "chatcmpl-" + uuid.uuid4().hex[:24], _model(prompt), reply, accounting
    )
    response: web.StreamResponse
    if prompt.request.get("stream") is True:
        response, completed = await write_events(
            request, exchange.events(prompt.request), faults, config.chunk_delay
        )
    elif faults.reset_after is not None:
        drop_connection(request)
        response, completed = web.Response(), False
    else:
        response = json_response(exchange.payload(), compress=steering.gzip)
        completed = True
    if completed:
        keep_generated(state, prompt, reply_tail)
    return response


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    data = [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "kvwarm"}]
    return json_response({"object": "list", "data": data})


async def list_requests(request: web.Request) -> web.Response:
    """``GET /sim/requests``: the model requests received, most recent last."""
    entries = []
    for received in request.app[SIM_STATE].requests:
        try:
            body, encoding = received.body.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            body, encoding = base64.b64encode(received.body).decode("ascii"), "base64"
        entries.append(
            {
                "endpoint": received.endpoint,
                "method": received.method,
                "path": received.path,
                "headers": received.headers,
                "body": body,
                "body_encoding": encoding,
            }
        )
    return json_response(entries)


async def reset(request: web.Request) -> web.Response:
    """``POST /sim/reset``: clear the prefix cache, the stored Responses and the request log."""
    request.app[SIM_STATE].reset()
    return json_response({"reset": True})


async def read_clock(request: web.Request) -> web.Response:
    """``GET /sim/clock``: the emulator's time and how far it has been advanced."""
    clock = request.app[SIM_STATE].clock
    return json_response({"now": clock(), "offset": clock.offset})


async def advance_clock(request: web.Request) -> web.Response:
    """``POST /sim/clock {"advance": seconds}``: move the emulator's clock forward."""
    clock = request.app[SIM_STATE].clock
    try:
        body = load_json(await request.read() or b"{}")
    except ValueError as exc:
        return error_response(400, str(exc), code="invalid_json")
    seconds = body.get("advance", 0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return error_response(400, "'advance' must be a number of seconds", param="advance")
    try:
        clock.advance(float(seconds))
    except ValueError as exc:
        return error_response(400, str(exc), param="advance")
    return json_response({"now": clock(), "offset": clock.offset})


def parse_prompt(body: bytes, config: SimConfig) -> Prompt:
    """Parse, validate, render, tokenize and block-hash (or cache-plan) a chat request.

    CPU work: the handler runs it in a worker thread for big bodies.
    """
    request = load_json(body)
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    tools = request.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("'tools' must be a list")
    return build_prompt(config, request, messages, tools)


def _received(request: web.Request, body: bytes, endpoint: str) -> ReceivedRequest:
    return ReceivedRequest(
        method=request.method,
        path=request.path,
        headers={name.lower(): value for name, value in request.headers.items()},
        body=body,
        endpoint=endpoint,
    )


def _model(prompt: Prompt) -> str:
    model = prompt.request.get("model")
    return model if isinstance(model, str) and model else MODEL_ID


class _ChatExchange:
    """One chat completion's answer, as a JSON body or as SSE chunks."""

    __slots__ = ("accounting", "completion_id", "config", "created", "model", "reply")

    def __init__(
        self,
        config: SimConfig,
        completion_id: str,
        model: str,
        reply: Reply,
        accounting: Accounting,
    ) -> None:
        self.config = config
        self.completion_id = completion_id
        self.model = model
        self.reply = reply
        self.accounting = accounting
        self.created = int(time.time())

    def payload(self) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` body."""
        payload: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fp_kvwarm_sim",
            "choices": [
                {
                    "index": 0,
                    "message": self.reply.message(),
                    "logprobs": None,
                    "finish_reason": self.reply.finish_reason,
                }
            ],
            "usage": self.accounting.usage(),
        }
        if self.config.openhuman:
            payload["openhuman"] = self.accounting.openhuman(self.config)
        return payload

    def events(self, chat: Mapping[str, Any]) -> list[bytes]:
        """The SSE events of the streamed reply, ``[DONE]`` last."""
        options = chat.get("stream_options")
        include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
        reply = self.reply
        events = [
            self._chunk(
                [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                include_usage,
            )
            for delta in reply_deltas(reply)
        ]
        finish = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reply.finish_reason}
        events.append(self._chunk([finish], include_usage))
        if include_usage:
            events.append(self._chunk([], include_usage, self.accounting.usage()))
        events.append(b"data: [DONE]\n\n")
        return events

    def _chunk(
        self,
        choices: list[dict[str, Any]],
        include_usage: bool,
        usage: dict[str, Any] | None = None,
    ) -> bytes:
        payload: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fp_kvwarm_sim",
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage
            if usage is not None and self.config.openhuman:
                payload["openhuman"] = self.accounting.openhuman(self.config)
        return b"data: " + orjson.dumps(payload) + b"\n\n"
