"""The Responses API's output items and response object, as the reference upstream returns them.

- :func:`output_items` turns a :class:`.script.Turn` into ``output`` items:
  ``reasoning`` (``rs_...``; ``encrypted_content`` only when the request's
  ``include`` asks for ``reasoning.encrypted_content``; the provider's own copy
  always keeps it), ``message`` (``msg_...``, one ``output_text`` part),
  ``function_call`` (``fc_...``), ``custom_tool_call`` (``ctc_...``) or
  ``local_shell_call`` (``lsh_...``). Item ids are
  random (they render nothing); call ids are deterministic (as chat's).
- :func:`response_object` is the ``response`` object: every field the official
  ``openai`` SDK's ``Response`` model requires, the request's settings echoed
  (``instructions``, ``tools``, ``tool_choice``, ``reasoning``, ``text``, ...),
  ``usage`` and, when configured, the ``openhuman`` block beside it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .script import Turn
from .sealed import seal

ENCRYPTED_REASONING = "reasoning.encrypted_content"


@dataclass(frozen=True, slots=True, kw_only=True)
class Outputs:
    """A turn's output items: as the client sees them, and as the provider keeps them."""

    public: list[dict[str, Any]]
    stored: list[dict[str, Any]]
    """Same items; ``reasoning`` always with its sealed ``encrypted_content``."""


def new_id(prefix: str) -> str:
    """``prefix`` followed by 48 random hex digits (the shape of OpenAI's ids)."""
    return prefix + uuid.uuid4().hex + uuid.uuid4().hex[:16]


def output_items(turn: Turn, include: Any) -> Outputs:
    """The output items of ``turn``; ``include``: the request's ``include`` list."""
    public: list[dict[str, Any]] = []
    stored: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        summary = [{"type": "summary_text", "text": turn.summary}] if turn.summary else []
        item: dict[str, Any] = {"id": new_id("rs_"), "type": "reasoning", "summary": summary}
        sealed = {**item, "encrypted_content": seal(turn.reasoning)}
        wanted = isinstance(include, list) and ENCRYPTED_REASONING in include
        public.append(sealed if wanted else item)
        stored.append(sealed)
    if turn.text is not None:
        part = {"type": "output_text", "text": turn.text, "annotations": [], "logprobs": []}
        message = {
            "id": new_id("msg_"),
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
        public.append(message)
        stored.append(message)
    for call in turn.calls:
        item = _call_item(call.kind, call.call_id, call.name, call.arguments)
        public.append(item)
        stored.append(item)
    return Outputs(public=public, stored=stored)


def _call_item(kind: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    if kind == "local_shell_call":
        return {
            "id": new_id("lsh_"),
            "type": "local_shell_call",
            "status": "completed",
            "call_id": call_id,
            "action": orjson.loads(arguments),
        }
    if kind == "custom_tool_call":
        return {
            "id": new_id("ctc_"),
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": call_id,
            "name": name,
            "input": arguments,
        }
    return {
        "id": new_id("fc_"),
        "type": "function_call",
        "status": "completed",
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def response_object(
    request: Mapping[str, Any],
    *,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: Sequence[Mapping[str, Any]],
    usage: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The ``response`` object (``status`` ``"in_progress"`` with no output or usage while streaming)."""
    reasoning = request.get("reasoning")
    text = request.get("text")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "completed_at": created_at if status == "completed" else None,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "model": model,
        "output": list(output),
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": request.get("previous_response_id"),
        "prompt_cache_key": request.get("prompt_cache_key"),
        "reasoning": dict(reasoning)
        if isinstance(reasoning, Mapping)
        else {"effort": None, "summary": None},
        "safety_identifier": request.get("safety_identifier"),
        "service_tier": "default",
        "store": request.get("store") is not False,
        "temperature": request.get("temperature", 1.0),
        "text": {"format": {"type": "text"}, "verbosity": "medium", **text}
        if isinstance(text, Mapping)
        else {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": list(request.get("tools") or ()),
        "top_logprobs": 0,
        "top_p": request.get("top_p", 1.0),
        "truncation": request.get("truncation") or "disabled",
        "usage": dict(usage) if usage is not None else None,
        "user": None,
        "metadata": request.get("metadata") or {},
    }
