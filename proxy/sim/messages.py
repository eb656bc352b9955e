"""The reference upstream's Messages API endpoint (Anthropic's): ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

What Claude Code and the ``anthropic`` SDK send is accepted as Anthropic accepts
it: the ``?beta=true`` query (the SDK's beta client, Claude Code), the key in
``x-api-key`` or ``Authorization: Bearer`` (neither is checked), the
``anthropic-version`` and ``anthropic-beta`` headers (read by nobody: every
feature the emulator has is on). One request, in order:

1. the ``x-sim-*`` headers (:mod:`.steering`): a ``delay`` or ``status`` fault
   applies before anything else (the error in Anthropic's shape);
2. the body is parsed and checked: ``model`` and ``messages`` are required
   (and ``max_tokens``, except to count tokens); unknown fields are ignored;
3. ``system``, ``tools`` and ``messages`` are rendered with the chat template
   (:mod:`.content_blocks`), then looked up in and added to the prompt cache
   shared with the other endpoints (:mod:`.engine`): in the ``anthropic`` mode
   at the ``cache_control`` breakpoints (:mod:`.markers`: at most four, 20
   blocks of lookback, 5 minutes or an hour), in the ``vllm`` mode every prefix
   in 16-token blocks as a local engine caches it (the generated turn too), in
   the ``openai`` and ``openai-breakpoints`` modes as they cache chat;
4. the model's turn is planned (:mod:`.message_script`) and returned as a
   ``message`` (:mod:`.message_events`), or streamed as Anthropic's events,
   with Anthropic's ``usage``: ``input_tokens`` (neither read nor written),
   ``cache_creation_input_tokens`` with its ``cache_creation`` split by TTL,
   ``cache_read_input_tokens``, ``output_tokens`` (:mod:`.accounting`), and,
   when configured, ``openhuman``. Every answer has a ``request-id`` header.

``count_tokens`` renders the request the same way (its markers checked the same
way) and answers ``{"input_tokens": N}``: the whole prompt, what a
``/v1/messages`` of the same request reports as ``input_tokens +
cache_creation_input_tokens + cache_read_input_tokens``. It reads and writes no
cache.

Errors are Anthropic-shaped (:func:`.wire.anthropic_error_response`): 400
``invalid_request_error`` for a body the API refuses (a fifth ``cache_control``
block, an orphaned ``tool_result``, a forged thinking ``signature``, ...).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aiohttp import web

from .accounting import Accounting
from .content_blocks import assistant_messages, check_tools, to_messages
from .engine import keep_generated, prefill, wait_first_token
from .faults import drop_connection
from .items import InputError
from .message_events import message_events, message_object
from .message_script import content_blocks, plan_message_turn, stop_reason
from .prompt import MESSAGES, InvalidJSON, Prompt, build_prompt, load_json, off_loop
from .render import reply_segments
from .state import SIM_STATE, ReceivedRequest, SimConfig, SimState
from .steering import Steering
from .wire import (
    REQUEST_ID_HEADER,
    anthropic_error_response,
    fault_response,
    json_response,
    new_request_id,
    write_events,
)

ENDPOINT = "messages"
COUNT_ENDPOINT = "messages.count_tokens"


async def create_message(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``."""
    received = await _received_prompt(request, ENDPOINT, count_only=False)
    if isinstance(received, web.Response):
        return received
    state, steering, prompt = received
    return await _answer(request, state, steering, prompt)


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, with no cache read or written."""
    received = await _received_prompt(request, COUNT_ENDPOINT, count_only=True)
    if isinstance(received, web.Response):
        return received
    _, _, prompt = received
    return json_response(
        {"input_tokens": len(prompt.tokens)}, headers={REQUEST_ID_HEADER: new_request_id()}
    )


def render_message_prompt(request: dict[str, Any], config: SimConfig, count_only: bool) -> Prompt:
    """Check, render, tokenize and block-hash (or cache-plan) a Messages request.

    CPU work: the handlers run it in a worker thread for big bodies.
    """
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise InputError("model: Field required", "model")
    if not count_only:
        max_tokens = request.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError("max_tokens: Field required (an integer of at least 1)", "max_tokens")
    tools = check_tools(request.get("tools"))
    messages = to_messages(request.get("system"), request.get("messages"))
    return build_prompt(config, request, messages, tools, api=MESSAGES)


async def _received_prompt(
    request: web.Request, endpoint: str, *, count_only: bool
) -> tuple[SimState, Steering, Prompt] | web.Response:
    """Record the request (as one to ``endpoint``), then read its steering and its prompt; the
    error response where either is refused."""
    state = request.app[SIM_STATE]
    body = await request.read()
    state.record(_received(request, body, endpoint))
    steering = await _steering(request)
    if isinstance(steering, web.Response):
        return steering
    prompt = await _prepare(state.config, body, count_only=count_only)
    if isinstance(prompt, web.Response):
        return prompt
    return state, steering, prompt


async def _steering(request: web.Request) -> Steering | web.Response:
    """The request's steering, after its ``delay`` fault; or the error it asked for."""
    try:
        steering = Steering.from_headers(request.headers)
    except ValueError as exc:
        return anthropic_error_response(400, str(exc))
    if steering.faults.delay:
        await asyncio.sleep(steering.faults.delay)
    if steering.faults.status is not None:
        return fault_response(steering.faults, anthropic=True)
    return steering


async def _prepare(config: SimConfig, body: bytes, *, count_only: bool) -> Prompt | web.Response:
    """The rendered prompt, or the error response."""
    try:
        parsed = await off_loop(len(body), load_json, body)
        return await off_loop(len(body), render_message_prompt, parsed, config, count_only)
    except InvalidJSON as exc:
        return anthropic_error_response(400, f"There was an error parsing the body: {exc}")
    except ValueError as exc:  # InputError and MarkerError among them
        return anthropic_error_response(400, str(exc))


async def _answer(
    request: web.Request, state: SimState, steering: Steering, prompt: Prompt
) -> web.StreamResponse:
    config = state.config
    use = prefill(state, prompt)
    turn = plan_message_turn(
        prompt.request,
        prompt.seed,
        reply_tokens=steering.reply_tokens,
        reasoning=steering.reasoning,
        tool_calls=steering.tool_calls,
    )
    content = content_blocks(turn)
    (generated,) = assistant_messages(content)
    reply_tail = reply_segments(generated)
    accounting = Accounting.of_reply(config, use, prompt, reply_tail, turn.reasoning)
    await wait_first_token(config, prompt, use)
    message = message_object(
        message_id="msg_" + uuid.uuid4().hex[:24],
        model=prompt.request["model"],
        content=content,
        stop_reason=stop_reason(turn),
        usage=accounting.messages_usage(),
    )
    if config.openhuman:
        message["openhuman"] = accounting.openhuman(config)
    headers = {REQUEST_ID_HEADER: new_request_id()}

    def commit() -> None:
        keep_generated(state, prompt, reply_tail)

    faults = steering.faults
    if prompt.request.get("stream") is True:
        events = message_events(message)
        response, _ = await write_events(
            request, events, faults, config.chunk_delay, commit, headers
        )
        return response
    if faults.reset_after is not None:
        drop_connection(request)
        return web.Response()
    commit()
    return json_response(message, headers=headers, compress=steering.gzip)


def _received(request: web.Request, body: bytes, endpoint: str) -> ReceivedRequest:
    # With its query: whether ``?beta=true`` reached the upstream is worth a test's look.
    return ReceivedRequest(
        method=request.method,
        path=request.path_qs,
        headers={name.lower(): value for name, value in request.headers.items()},
        body=body,
        endpoint=endpoint,
    )
