"""Cache breakpoints: where kvwarm marks a request for the provider's prompt cache, and why. Pure.

Byte-identical prefixes are necessary, not sufficient: a provider with cache breakpoints keeps
exactly the prefixes that end at a breakpoint, and bills writing them.

``openai`` (GPT-5.6 and later)
    One implicit breakpoint at the latest user or tool message; explicit ones as
    ``"prompt_cache_breakpoint": {"mode": "explicit"}`` on system, developer, user or tool
    content (never on assistant output, never on tools). A request writes the prefixes ending at
    its latest four breakpoints, the implicit one included; a later request reads the longest
    written prefix it starts with, wherever it ends. A token is written once per request.
``cache_control`` (Anthropic-style: OpenRouter's ``anthropic/`` and ``qwen/`` models, DashScope)
    Nothing is cached without ``"cache_control": {"type": "ephemeral"}`` on a content part or a
    tool; at most four marked blocks per request (a fifth is refused with a 400). A request
    writes the prefix ending at each marked block and reads a written prefix only at a marked
    block or up to about 20 blocks before one. A write costs 1.25 times the input price, a read
    0.1 times.

So a large stable prefix followed by a changing message is never reused under the implicit
breakpoint alone, and never at all without markers. kvwarm knows where a prefix is stable: the
transcript tree shows where a tenant's sessions branch and where a session's previous turn
ended (:func:`tree_facts`). :func:`choose` places markers there, and only where the reads
expected repay the write premium:

**stem** (both dialects): the end of a prefix that at least two of the tenant's sessions share:
a matched node with two children or more, counting the request's own new branch (the tools,
system prompt and brief of parallel subagents, or of many single-shot tasks). A boundary seen
once is not worth a write; once two sessions have gone through it, a third is expected (agents
fan out in batches), and one read repays the write: with ``cache_control`` a write costs
0.25 x input above the uncached price and a read saves 0.9 x, so a stem pays from 0.28 expected
reads; with ``openai`` an explicit breakpoint inside the implicit one's prefix writes no token
the implicit one would not write, so it costs nothing but a slot. The four deepest such nodes
among the first :data:`STEM_SCAN` elements (and the request's own branch point) are candidates,
deepest first. With ``openai`` a stem at or past the implicit breakpoint is left out (the
implicit one writes it). The price of waiting for the second session is that session's read of
a new prompt (a static "mark the system prompt" policy has it); what it buys is that a prefix
seen once is never written: a system prompt carrying a date, a user's name or retrieved
documents costs a static policy 1.25 x on every request and nothing more through kvwarm.

**continuation** (``cache_control`` only; ``openai`` has the implicit breakpoint): the request's
last markable block, when its session is expected to send a next turn that starts with this
prompt: the session is on its second turn or later (its matched prefix holds a reply kvwarm
recorded); else, when sibling sessions at its stem finished a turn, when enough of them went
on to a next one (``continued * 0.9 >= finished * 0.25``: the write premium of this prompt's
new tokens against the read of them next turn); else (nothing known) when the request offers
tools (an agent loop: a tool call comes back as a next turn). A single-shot task whose siblings
all ended after one reply gets no continuation marker.

**previous** (``cache_control`` only): the end of what the session's previous turn sent (where
its continuation marker wrote), when more than :data:`LOOKBACK_BLOCKS` blocks lie between it and
this turn's continuation marker, kvwarm's or the client's own on the last block (many parallel
tool calls, results in many parts): the provider would not look back that far, and would write
the whole prompt again. It reads; it writes nothing the continuation would not.

**head** (both dialects): the end of the leading system and developer messages, the
conventional stable prefix, when the request writes past it anyway (``openai``: it lies before
the implicit breakpoint; ``cache_control``: a continuation, kvwarm's or the client's, or a stem
of this request lies past it). A request pays its write premium on the tokens between what it reads and its deepest
written boundary, each token once, so a marker inside that span costs nothing but its slot:
the first session of a system prompt already writes the prefix the next one reads, before the
tree can show that it is shared.

Budget and the client's own markers: ``cache_control`` allows four marked blocks, the client's
included (a top-level ``cache_control`` counts as one); ``openai`` writes four breakpoints, the
implicit one and the client's explicit ones included. kvwarm adds at most what is left, in the
order continuation, previous, stems (deepest first), head: a client that already sends four
markers gets none, and no request is ever refused for too many. A block the client marked is not marked
again; with ``prompt_cache_options.mode = "explicit"`` the client manages its breakpoints and
kvwarm adds none. Markers go only on blocks the dialect accepts (never assistant output); a
boundary on an element that cannot carry one moves back to the nearest element that can. A
prefix shorter than :data:`MIN_PREFIX_BYTES` bytes of JSON is certainly below the providers'
1024-token minimum and is not marked. No marker carries a TTL: the default (5 or 30 minutes) is
the one whose premium the arithmetic above assumes.

What the markers saved (:attr:`Marks.reads_ours`) is counted apart where that is sound: with
``cache_control`` and no marker of the client's, every read and write of the request happened at
kvwarm's markers (without a marker nothing is cached). With ``openai``, when the client sent no
explicit breakpoint and the request's matched prefix holds no user or tool message: no earlier
request's implicit breakpoint (at a user or tool message) ends inside it, and no earlier request
the store remembers shares more than it, so what the request reads was written at a breakpoint
kvwarm placed (assuming the store saw the requests that wrote the provider's cache: one tenant
per provider account, within the store's TTL). Its writes are the implicit breakpoint's, not
kvwarm's.

``openai`` reads only under the request's ``prompt_cache_key``: with ``routing.prompt_cache_key
= "session"`` each session has a key of its own, so a stem is read by the later turns of its
session only, not by other sessions (the key spreads sessions over the provider's machines;
without it, sessions sharing a system prompt share what it wrote).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from .match import Match
from .model import NodeReader

__all__ = [
    "AUTO",
    "AUTO_OPENAI",
    "AUTO_OPENROUTER",
    "CACHE_CONTROL",
    "CONTINUATION",
    "HEAD",
    "KINDS",
    "NO_TREE",
    "OFF",
    "OPENAI",
    "PREVIOUS",
    "SETTINGS",
    "STEM",
    "ClientMarks",
    "Elements",
    "Mark",
    "Marks",
    "Tree",
    "budget",
    "choose",
    "dialect_of",
    "host_rule",
    "reads_ours",
    "tree_facts",
]

OPENAI = "openai"
CACHE_CONTROL = "cache_control"
OFF = "off"
AUTO = "auto"
SETTINGS = (AUTO, OPENAI, CACHE_CONTROL, OFF)
"""The values of ``upstream.cache_breakpoints``."""
AUTO_OPENAI = "auto:openai"
"""The host rule of api.openai.com: ``openai`` for GPT-5.6 and later models."""
AUTO_OPENROUTER = "auto:openrouter"
"""The host rule of openrouter.ai: ``cache_control`` for ``anthropic/`` and ``qwen/`` models."""

STEM, CONTINUATION, PREVIOUS, HEAD = "stem", "continuation", "previous", "head"
KINDS = (STEM, CONTINUATION, PREVIOUS, HEAD)
"""Every :attr:`Mark.kind` (a bounded metrics label)."""

SLOTS = 4
"""Breakpoints one request may hold (``cache_control``) or writes (``openai``, the implicit one included)."""
LOOKBACK_BLOCKS = 16
"""Blocks before a marked block where a ``cache_control`` provider is counted on to find a written
prefix (Anthropic: "approximately 20"; the reference upstream: 20)."""
MIN_PREFIX_BYTES = 1024
"""A prefix of fewer JSON bytes has fewer than the providers' minimum 1024 tokens (a token is at
least one byte): not marked."""
STEM_SCAN = 64
"""Leading elements whose children are counted for stems (the request's own branch point is
counted wherever it is): shared prefixes are the tools, system prompts and briefs at the top."""
MAX_STEMS = 4
SIBLINGS = 4
"""Sibling sessions (the most recent) whose next turns are looked for."""
DESCENT = 12
"""Nodes walked down a sibling session looking for its next turn."""
PREVIOUS_SCAN = 64
"""Matched nodes walked back from the deepest looking for the session's previous reply."""
WRITE_PREMIUM = 0.25
"""A 5-minute ``cache_control`` write, above the uncached input price (1.25 x)."""
READ_SAVING = 0.9
"""A ``cache_control`` read, below the uncached input price (0.1 x)."""
_READERS = frozenset(("user", "tool"))
"""Roles the OpenAI implicit breakpoint follows."""
_HEAD_ROLES = frozenset(("system", "developer"))
_GPT = re.compile(r"gpt-(\d+)(?:\.(\d+))?")
_OPENROUTER_FAMILIES = ("anthropic/", "qwen/")


# -- which dialect an upstream speaks ---------------------------------------------------------


def host_rule(setting: str, base_url: str) -> str:
    """The dialect rule of one upstream: ``setting`` itself unless ``auto``, which the host decides:
    api.openai.com -> :data:`AUTO_OPENAI`, openrouter.ai -> :data:`AUTO_OPENROUTER`, a DashScope
    host -> ``cache_control``, any other -> ``off`` (forwarded as today)."""
    if setting != AUTO:
        return setting
    host = (urlsplit(base_url).hostname or "").lower()
    if host == "api.openai.com":
        return AUTO_OPENAI
    if host == "openrouter.ai" or host.endswith(".openrouter.ai"):
        return AUTO_OPENROUTER
    if host.startswith("dashscope") and host.endswith(".aliyuncs.com"):
        return CACHE_CONTROL
    return OFF


def dialect_of(rule: str, model: object) -> str:
    """The dialect a request for ``model`` is marked in on an upstream of ``rule``; ``""``: none."""
    if rule == OPENAI or rule == CACHE_CONTROL:
        return rule
    if not isinstance(model, str):
        return ""
    name = model.lower()
    if rule == AUTO_OPENAI:
        found = _GPT.match(name)
        if found is not None and (int(found.group(1)), int(found.group(2) or 0)) >= (5, 6):
            return OPENAI
    elif rule == AUTO_OPENROUTER and name.startswith(_OPENROUTER_FAMILIES):
        return CACHE_CONTROL
    return ""


# -- what the transcript tree knows -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Tree:
    """What the store knows about a request's matched prefix (element depths: 0 = tools)."""

    stems: tuple[int, ...] = ()
    """Depths of matched nodes at least two sessions share, deepest first (at most :data:`MAX_STEMS`)."""
    previous_end: int = -1
    """Depth of the last element the session's previous turn sent (-1: the session's first turn)."""
    finished: int = 0
    """Sibling sessions at the deepest stem known to have had a reply."""
    continued: int = 0
    """Of those, the ones known to have sent a next turn after it."""


NO_TREE = Tree()


def tree_facts(match: Match, reader: NodeReader) -> Tree:
    """Stems, the previous turn's end and the sibling sessions' behaviour, from the store.

    Bounded: children of at most :data:`STEM_SCAN` + 1 nodes, :data:`SIBLINGS` times
    :data:`DESCENT` more, whatever the request's length (a shared store's view answers what it
    holds; what it lacks counts as unknown)."""
    n = match.matched
    if n <= 0:
        return NO_TREE
    keys = match.keys
    branching = n < len(keys)
    """The request goes on past its matched prefix with an element no session sent there."""
    depths = [*range(min(n, STEM_SCAN)), *([n - 1] if n > STEM_SCAN else [])]
    stems: list[int] = []
    for d in reversed(depths):
        sharers = len(reader.children(keys[d])) + (1 if branching and d == n - 1 else 0)
        if sharers >= 2:
            stems.append(d)
            if len(stems) == MAX_STEMS:
                break
    finished = continued = 0
    if stems:
        deepest = stems[0]
        own = keys[deepest + 1] if deepest + 1 < len(keys) else b""
        # The most recent ones (children come oldest first), the request's own path left out.
        siblings = [c for c in reader.children(keys[deepest])[-SIBLINGS - 1 :] if c.key != own][-SIBLINGS:]
        for sibling in siblings:
            verdict = _went_on(sibling.key, sibling.generated, reader)
            if verdict is not None:
                finished += 1
                continued += verdict
    return Tree(stems=tuple(stems), previous_end=_previous_end(match), finished=finished, continued=continued)


def _went_on(key: bytes, replied: bool, reader: NodeReader) -> bool | None:
    """Whether the session below a sibling node sent a next turn after a reply (its most recent
    path, :data:`DESCENT` nodes at most); None: it had no reply yet (or the store does not say)."""
    for _ in range(DESCENT):
        below = reader.children(key)
        if not below:
            break
        child = below[-1]
        if replied and not child.generated:
            return True
        replied = replied or child.generated
        key = child.key
    return False if replied else None


def _previous_end(match: Match) -> int:
    """Depth of the request element just before the last run of recorded replies in the matched prefix."""
    nodes = match.nodes
    d = len(nodes) - 1
    stop = max(0, d - PREVIOUS_SCAN)
    while d >= stop and not nodes[d].generated:
        d -= 1
    if d < stop:
        return -1
    while d >= 0 and nodes[d].generated:
        d -= 1
    return d


# -- the request, as a wire API sees it ---------------------------------------------------------


class Elements(Protocol):
    """A request's elements (0 = tools, 1.. = messages, in forwarded order) as the wire API that
    marks them sees them, in one dialect."""

    def __len__(self) -> int: ...

    def role(self, depth: int) -> str:
        """``tools``, or the element's chat-shaped role."""
        ...

    def markable(self, depth: int) -> bool:
        """The element's last block can carry a marker of the dialect."""
        ...

    def marked(self, depth: int) -> bool:
        """The client marked the element's last block itself (or holds the marker's key there)."""
        ...

    def blocks(self, depth: int) -> int:
        """How many blocks the element counts for (content parts, tool calls, tools), at least 1."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientMarks:
    """The client's own markers of the dialect in one request."""

    count: int = 0
    """Marked places: parts, messages, tool calls, tools (and the top-level ``cache_control``)."""
    automatic: bool = False
    """A top-level ``cache_control`` (it marks the last block)."""
    explicit_mode: bool = False
    """``prompt_cache_options.mode`` is ``explicit`` (openai): the client manages its breakpoints."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Mark:
    """One marker kvwarm places: at the last block of the element at ``depth``."""

    depth: int
    kind: str
    """One of :data:`KINDS`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Marks:
    """What kvwarm did to one request's markers (carried by the outgoing body, reported after)."""

    dialect: str
    placed: tuple[Mark, ...] = ()
    """The markers kvwarm added (none when refused)."""
    client: int = 0
    """The client's own markers, kept where the client put them."""
    reads_ours: bool = False
    """The request's cache reads happened at breakpoints kvwarm placed (module docstring)."""
    writes_ours: bool = False
    """Its cache writes did too (``cache_control`` without client markers)."""
    refused: str = ""
    """Why nothing was added though markers were chosen: a splice refusal
    (:data:`~proxy.core.splice.REFUSALS`) or ``error``; the client's bytes went as they were."""
    error: Exception | None = None
    """The error behind ``refused == "error"``, for the request's fail-open boundary."""


def budget(dialect: str, client: ClientMarks) -> int:
    """Markers kvwarm may add to a request that holds the client's ``client``."""
    if dialect == OPENAI:
        return 0 if client.explicit_mode else max(0, SLOTS - 1 - client.count)
    return max(0, SLOTS - client.count)


def choose(dialect: str, elements: Elements, tree: Tree, match: Match, client: ClientMarks, *, tools: bool) -> tuple[Mark, ...]:
    """The markers to add, in priority order (module docstring), within the budget."""
    room = budget(dialect, client)
    n = len(elements)
    if room <= 0 or n == 0:
        return ()
    chosen: list[Mark] = []
    taken: set[int] = set()

    def add(depth: int | None, kind: str) -> bool:
        if depth is None or depth in taken or elements.marked(depth) or not _long_enough(match, depth):
            return False
        chosen.append(Mark(depth=depth, kind=kind))
        taken.add(depth)
        return True

    # The deepest element the request writes at anyway: the implicit breakpoint, a continuation
    # (kvwarm's or the client's own on the last block), a stem. A marker before it is free.
    written = _implicit(elements) if dialect == OPENAI else -1
    last = _markable_at_or_before(elements, n - 1)
    if dialect == CACHE_CONTROL and last is not None:
        if client.automatic or elements.marked(last) or (_expect_next_turn(tree, tools) and add(last, CONTINUATION)):
            written = last
        if written >= 0 and tree.previous_end >= 0:
            previous = _markable_at_or_before(elements, tree.previous_end)
            if previous is not None and previous < last and _blocks_between(elements, previous, last) > LOOKBACK_BLOCKS:
                add(previous, PREVIOUS)
    for stem in tree.stems:
        depth = _markable_at_or_before(elements, stem)
        if depth is None:
            continue
        if dialect == OPENAI:
            if depth < written:  # at or past the implicit breakpoint: the implicit one's to write
                add(depth, STEM)
        elif add(depth, STEM):
            written = max(written, depth)
    head = _head(elements)
    if head is not None and head < written:
        add(head, HEAD)
    return tuple(chosen[:room])


def reads_ours(dialect: str, client: ClientMarks, match: Match) -> bool:
    """Whether a request's cache reads can only have come from breakpoints kvwarm placed (module
    docstring); ``writes_ours`` is the same test for ``cache_control`` only."""
    if client.count or client.automatic:
        return False
    if dialect == CACHE_CONTROL:
        return True
    if match.matched >= len(match.keys):
        return False  # the whole request was sent before: its own earlier implicit breakpoint
    return not any(node.role in _READERS for node in match.nodes)


def _expect_next_turn(tree: Tree, tools: bool) -> bool:
    if tree.previous_end >= 0:
        return True
    if tree.finished:
        return tree.continued * READ_SAVING >= tree.finished * WRITE_PREMIUM
    return tools


def _markable_at_or_before(elements: Elements, depth: int) -> int | None:
    """The deepest element at or before ``depth`` that can carry a marker (an assistant reply
    cannot: a boundary there moves back to the message before it)."""
    for d in range(min(depth, len(elements) - 1), -1, -1):
        if elements.markable(d):
            return d
    return None


def _head(elements: Elements) -> int | None:
    """The last of the leading system and developer messages, when it can carry a marker."""
    d = 0
    while d + 1 < len(elements) and elements.role(d + 1) in _HEAD_ROLES:
        d += 1
    return d if d and elements.markable(d) else None


def _implicit(elements: Elements) -> int:
    """Depth of the OpenAI implicit breakpoint (the latest user or tool message); 0: none."""
    for d in range(len(elements) - 1, 0, -1):
        if elements.role(d) in _READERS:
            return d
    return 0


def _blocks_between(elements: Elements, start: int, end: int) -> int:
    """Blocks after element ``start``'s last block, up to element ``end``'s last block."""
    return sum(elements.blocks(d) for d in range(start + 1, end + 1))


def _long_enough(match: Match, depth: int) -> bool:
    """Whether the prefix through element ``depth`` may reach the providers' minimum: its JSON
    bytes, where known (stored bodies, then the request's own serializations), are at least
    :data:`MIN_PREFIX_BYTES`; unknown counts as long enough."""
    total = 0
    nodes, dumped, sizes = match.nodes, match.dumped, match.clean_sizes
    for d in range(depth + 1):
        data = dumped[d] if d < len(dumped) else None
        if d < len(nodes):
            total += len(nodes[d].body)
        elif data is not None:
            total += len(data)
        elif d < len(sizes) and sizes[d] >= 0:
            total += sizes[d]
        else:
            return True
        if total >= MIN_PREFIX_BYTES:
            return True
    return False

