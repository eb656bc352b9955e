"""The reference upstream's Responses API endpoint: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

One request, in order:

1. the ``x-sim-*`` headers (:mod:`.steering`): a ``delay`` or ``status`` fault
   applies before anything else;
2. the body is parsed; ``input`` (a string or items), ``tools`` and
   ``previous_response_id`` are resolved into the effective input
   (:mod:`.response_store`: the previous response's input and output first);
   unknown fields are ignored;
3. the effective input is rendered with the chat template (:mod:`.items`),
   looked up in and added to the prefix cache shared with the chat endpoint
   (:mod:`.engine`); the time to first token grows with the uncached tokens;
4. the model's turn is planned (:mod:`.script`) and returned as a ``response``
   object (:mod:`.outputs`) or as SSE events (:mod:`.events`), with ``usage``
   (``input_tokens_details.cached_tokens`` and ``cache_write_tokens``,
   ``output_tokens_details.reasoning_tokens``) and, when configured,
   ``openhuman``; in openai-breakpoints mode also the ``prompt_cache_options``
   applied and, when ``comparison_response_id`` asked for them,
   ``prompt_cache_diagnostics`` (:mod:`.diagnostics`);
5. the response is stored unless ``store`` is ``false`` (and, in vLLM mode, the
   generated turn's tokens cached; in openai-breakpoints mode its cache
   fingerprint kept, stored or not) before the client can read its last event,
   so the next turn finds them. A stream cut short by ``reset_after`` stores
   and caches nothing.

Errors are OpenAI-shaped: 400 ``previous_response_not_found`` for an unknown
``previous_response_id`` (a ``store: false`` response is never stored), 404
for an unknown ``item_reference`` or a ``GET`` of an unknown id, 400 with the
offending ``param`` for an input the API refuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .accounting import Accounting
from .engine import keep_generated, prefill, wait_first_token
from .events import response_events
from .faults import drop_connection
from .items import InputError, check_tools, input_items, to_messages
from .outputs import new_id, output_items, response_object
from .prompt import (
    RESPONSES,
    THREAD_THRESHOLD_BYTES,
    InvalidJSON,
    Prompt,
    build_prompt,
    load_json,
    off_loop,
)
from .render import reply_segments
from .response_store import (
    ItemNotFound,
    PreviousResponseNotFound,
    StoredResponse,
    resolve_input,
)
from .script import plan_turn
from .state import MODEL_ID, SIM_STATE, ReceivedRequest, SimConfig, SimState
from .steering import Steering
from .wire import error_response, fault_response, json_response, write_events

ENDPOINT = "responses"


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    state = request.app[SIM_STATE]
    body = await request.read()
    state.record(
        ReceivedRequest(
            method=request.method,
            path=request.path,
            headers={name.lower(): value for name, value in request.headers.items()},
            body=body,
            endpoint=ENDPOINT,
        )
    )
    try:
        steering = Steering.from_headers(request.headers)
    except ValueError as exc:
        return error_response(400, str(exc), code="invalid_sim_header")
    if steering.faults.delay:
        await asyncio.sleep(steering.faults.delay)
    if steering.faults.status is not None:
        return fault_response(steering.faults)
    prepared = await _prepare(state, body)
    if isinstance(prepared, web.Response):
        return prepared
    prompt, items = prepared
    return await _answer(request, state, steering, prompt, items)


async def retrieve_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: a stored response; 404 when unknown or not stored."""
    response_id = request.match_info["response_id"]
    stored = request.app[SIM_STATE].responses.get(response_id)
    if stored is None:
        return error_response(404, f"Response with id '{response_id}' not found.")
    return json_response(stored.public)


async def _prepare(
    state: SimState, body: bytes
) -> tuple[Prompt, list[Mapping[str, Any]]] | web.Response:
    """The rendered prompt and the effective input, or the error response."""
    try:
        parsed = await off_loop(len(body), load_json, body)
        previous = parsed.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise InputError("'previous_response_id' must be a string", "previous_response_id")
        items = resolve_input(state.responses, input_items(parsed.get("input")), previous)
        # A chained request's prompt can be much bigger than its body: render it off the loop.
        size = len(body) if previous is None else max(len(body), THREAD_THRESHOLD_BYTES + 1)
        prompt = await off_loop(size, render_prompt, parsed, items, state.config)
    except InvalidJSON as exc:
        return error_response(400, str(exc), code="invalid_json")
    except InputError as exc:
        return error_response(400, str(exc), code="invalid_request", param=exc.param)
    except PreviousResponseNotFound as exc:
        return error_response(
            400,
            f"Previous response with id '{exc.args[0]}' not found.",
            code="previous_response_not_found",
            param="previous_response_id",
        )
    except ItemNotFound as exc:
        return error_response(
            404, f"Item with id '{exc.args[0]}' not found.", code="item_not_found", param="input"
        )
    except ValueError as exc:
        return error_response(400, str(exc), code="invalid_request")
    return prompt, items


def render_prompt(
    request: dict[str, Any], items: Sequence[Mapping[str, Any]], config: SimConfig
) -> Prompt:
    """Render, tokenize and block-hash (or cache-plan) a Responses request whose effective
    input is ``items``.

    CPU work: the handler runs it in a worker thread for big bodies.
    """
    tools = check_tools(request.get("tools"))
    messages = to_messages(request.get("instructions"), items)
    return build_prompt(config, request, messages, tools, api=RESPONSES)


async def _answer(
    request: web.Request,
    state: SimState,
    steering: Steering,
    prompt: Prompt,
    items: Sequence[Mapping[str, Any]],
) -> web.StreamResponse:
    use = prefill(state, prompt)
    turn = plan_turn(
        prompt.request,
        items,
        prompt.seed,
        reply_tokens=steering.reply_tokens,
        reasoning=steering.reasoning,
        tool_calls=steering.tool_calls,
    )
    reply_tail = reply_segments(turn.message())
    accounting = Accounting.of_reply(state.config, use, prompt, reply_tail, turn.reasoning)
    await wait_first_token(state.config, prompt, use)
    parsed = prompt.request
    outputs = output_items(turn, parsed.get("include"))
    model = parsed.get("model")
    header = _Header(
        id=new_id("resp_"),
        created_at=int(time.time()),
        model=model if isinstance(model, str) and model else MODEL_ID,
        cache_options=prompt.plan.options if prompt.plan is not None else None,
        diagnostics=use.diagnostics,
    )
    completed = header.response(parsed, "completed", outputs.public, accounting.response_usage())
    if state.config.openhuman:
        completed["openhuman"] = accounting.openhuman(state.config)

    def commit() -> None:
        keep_generated(state, prompt, reply_tail)
        if use.fingerprint is not None:
            state.fingerprints.put(header.id, use.fingerprint)
        if parsed.get("store") is not False:
            stored = StoredResponse(id=header.id, effective_input=tuple(items), output=tuple(outputs.stored), public=completed)
            state.responses.put(stored)

    faults = steering.faults
    if parsed.get("stream") is True:
        events = response_events(header.response(parsed, "in_progress", (), None), completed)
        response, done = await write_events(
            request, events, faults, state.config.chunk_delay, commit
        )
        if not done:
            state.responses.discard(header.id)
        return response
    if faults.reset_after is not None:
        drop_connection(request)
        return web.Response()
    commit()
    return json_response(completed, compress=steering.gzip)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Header:
    """What every version of one response shares: id, creation time, model, cache report."""

    id: str
    created_at: int
    model: str
    cache_options: Mapping[str, Any] | None = None
    """The ``prompt_cache_options`` applied (openai-breakpoints mode), echoed."""
    diagnostics: Mapping[str, Any] | None = None
    """``prompt_cache_diagnostics``, when asked for (on the completed response)."""

    def response(
        self,
        request: Mapping[str, Any],
        status: str,
        output: Sequence[Mapping[str, Any]],
        usage: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        response = response_object(
            request,
            response_id=self.id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output,
            usage=usage,
        )
        if self.cache_options is not None:
            response["prompt_cache_options"] = dict(self.cache_options)
        if self.diagnostics is not None and status == "completed":
            response["prompt_cache_diagnostics"] = dict(self.diagnostics)
        return response
