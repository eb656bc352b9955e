"""Where each block of a rendered prompt ends, in tokens: what cache markers point at.

A *block* is what one cache marker sits on (:mod:`.markers`), in the order the
template renders them (:mod:`.render`):

- each entry of ``tools``: its line in the tools block;
- each content part of a message (a string ``content`` is one part), then each
  of its tool calls; a message with neither is one block.

A block's prefix is the prompt up to the end of the block's text, except that
the last block of a message ends after the message's ``<|im_end|>\\n``: a
marked final part caches its whole message, as a marked message does. A marker
on a message object itself (a chat message, a Responses item) marks the
message's last block.

The end of a message is a boundary between separately tokenized segments, so
its offset is exact. A boundary inside a message falls within one tokenized
text, where the tokenizer may merge across it; the block then ends at the last
token boundary within it: the tokens of the text up to the block's end, as far
as they agree with the prompt's own. Those offsets cost a tokenization of the
text before them, so they are worked out only when asked for (:meth:`Layout.offset`).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .render import Segment, body_pieces, get_encoding, tools_pieces

_SEGMENTS_PER_MESSAGE = 5
"""``<|im_start|>``, the header, the body, ``<|im_end|>``, ``"\\n"`` (:func:`.render.message_segments`)."""
_BODY = 2
"""A message's body: its third segment."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    """One block of a prompt."""

    message: int | None
    """Index of its message in the rendered messages; ``None`` for a tool."""
    role: str
    """Its message's role; ``"tools"`` for a tool."""
    segment: int
    """The prompt segment (a body) its text ends in."""
    end: int
    """Characters of that segment up to the end of the block's text."""
    closes: bool
    """The last block of its message: its prefix ends after the message."""
    sources: tuple[Any, ...]
    """What may carry its marker: its part, tool call or tool; for a message's last block, the
    message too."""


class Layout:
    """A prompt's blocks, and their ends as token offsets."""

    __slots__ = ("_offsets", "_segments", "_starts", "_tokens", "blocks")

    def __init__(
        self,
        blocks: list[Block],
        segments: Sequence[Segment],
        tokens: Sequence[int],
        starts: Sequence[int],
    ) -> None:
        self.blocks = blocks
        self._segments = segments
        self._tokens = tokens
        self._starts = starts
        self._offsets: dict[int, int] = {}

    def offset(self, index: int) -> int:
        """How many of the prompt's tokens come before the end of block ``index`` (inclusive)."""
        offset = self._offsets.get(index)
        if offset is None:
            offset = self._offsets[index] = self._resolve(self.blocks[index])
        return offset

    def message_ends(self) -> list[int]:
        """The token offset where each message ends (the tools block counts as one)."""
        return [self.offset(i) for i, block in enumerate(self.blocks) if block.closes]

    def tools_text(self) -> str:
        """The rendered tools (``""`` without tools)."""
        if self.blocks and self.blocks[0].role == "tools":
            text = self._segments[self.blocks[0].segment]
            return text if isinstance(text, str) else ""
        return ""

    def _resolve(self, block: Block) -> int:
        starts = self._starts
        if block.closes:
            after = block.segment + 3  # past <|im_end|> and "\n"
            return starts[after] if after < len(starts) else len(self._tokens)
        text = self._segments[block.segment]
        assert isinstance(text, str)
        start = starts[block.segment]
        own = self._tokens[start : starts[block.segment + 1]]
        prefix = get_encoding().encode_ordinary(text[: block.end])
        agreed = 0
        for mine, theirs in zip(prefix, own, strict=False):
            if mine != theirs:
                break
            agreed += 1
        return start + agreed


def layout(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    segments: Sequence[Segment],
    tokens: Sequence[int],
    starts: Sequence[int],
) -> Layout:
    """The blocks of the prompt that :func:`.render.render_segments` made of ``messages`` and
    ``tools`` (``segments``, their ``tokens``, and where each segment starts in them)."""
    blocks: list[Block] = []
    first = 0
    if tools:
        blocks += _blocks(tools_pieces(tools), None, "tools", _BODY, None)
        first = _SEGMENTS_PER_MESSAGE
    for index, message in enumerate(messages):
        segment = first + _SEGMENTS_PER_MESSAGE * index + _BODY
        role = message.get("role")
        blocks += _blocks(
            body_pieces(message), index, role if isinstance(role, str) else "", segment, message
        )
    return Layout(blocks, segments, tokens, starts)


def _blocks(
    pieces: Sequence[tuple[str, Any]],
    message: int | None,
    role: str,
    segment: int,
    whole: Mapping[str, Any] | None,
) -> list[Block]:
    ends: list[tuple[int, Any]] = []
    length = 0
    for text, source in pieces:
        length += len(text)
        if source is not None:
            ends.append((length, source))
    outer = () if whole is None else (whole,)
    if not ends:
        return [Block(message=message, role=role, segment=segment, end=length, closes=True, sources=outer)]
    blocks = [Block(message=message, role=role, segment=segment, end=end, closes=False, sources=(source,)) for end, source in ends[:-1]]
    last = ends[-1]
    blocks.append(Block(message=message, role=role, segment=segment, end=last[0], closes=True, sources=(last[1], *outer)))
    return blocks
