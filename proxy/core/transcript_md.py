"""The Markdown transcript format: one session, readable by people, restorable byte for byte.

Pure: text in, values out; no I/O. :func:`render` writes a :class:`Transcript`,
:func:`parse` reads one back and verifies it whole, or raises
:class:`~proxy.errors.TranscriptFormatError` naming the 1-based line. Nothing is
returned from a file that fails any check, so a caller can never load part of one.

Layout (``ID`` is 32 lower-case hex, times are UTC with microseconds)::

    <!-- session_transcript
    version: 1
    session: 5d1c0a...            the leaf key: the session id
    tenant: 9c1e44...             the tenant root (an HMAC, never the credential)
    secret_id: 0f3a5b7c9d1e2f40   fingerprint of the server secret that keyed ``tenant``
    model: gpt-4o
    created: 2026-04-11T14:30:00.123456Z
    updated: 2026-04-11T14:35:22.000001Z
    turn_count: 3
    input_tokens: 5000
    output_tokens: 1200
    cached_input_tokens: 3500
    unknown_cache_turns: 0
    cache_hit_pct: 70.0%          derived, for people; ignored when read
    charged_usd: 0.0045           exact (Python's shortest round-trip repr)
    billed: true
    repaired: 2
    last_break: content_changed
    -->

    # Session 5d1c0a...

        model gpt-4o · turns 3 · messages 6 ...

    ## 1 · user

        Find where the cache key is computed.

    <!--kvwarm:element depth=1 role=user id=ID tokens=9 created=2026-04-11T14:30:00.120000Z flags=-
    {"role":"user","content":"Find where the cache key is computed."}
    -->

    ...one element per depth: 0 is the ``tools`` array, then every message...

    <!-- /session_transcript -->

The authoritative data of an element is the line after its ``<!--kvwarm:element``
line: the stored body (``Node.body``, canonical JSON) in a bijective escaping that
keeps it on one line and inside the comment. Exactly these characters are
escaped, as ``%XX`` (two upper-case hex digits) or ``%uXXXX``: ``%`` itself, every
character some tool treats as a line break (LF, CR, VT, FF, FS, GS, RS, NEL, LS,
PS), and the ``>`` of each ``-->``. A reader accepts only the canonical escaping
(decoding and re-escaping must give the line back), so every body has exactly one
written form and every written form one body. Header values (``model``,
``last_break``) use the same escaping; the ``role`` attribute is URL-quoted
(no spaces), since attributes are separated by spaces.

Everything else is rendering for people and is ignored when read: headings
(lines starting with ``#``) and lines indented by four spaces. Blank lines are
free. Any other line is an error: a transcript is either exactly what kvwarm
wrote, or refused.

What :func:`parse` verifies: the header (every key once, typed), each element's
attributes, escaping and JSON body, its depth (0, 1, 2, ...), its role (``tools``
at depth 0, else the body's ``role``, or ``assistant`` for a generated reply that
has none), its identity (recomputed from the body under the caller's policy, so an
edited body cannot be restored in place of the message it claims to be), the
closing ``-->`` of every element, the end marker (a cut file is refused), and the
chain: the identities chained from ``tenant`` must end at ``session``, so a
missing, extra or reordered element is refused too.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from .errors import TranscriptFormatError
from .identity import message_identity, tools_identity
from .model import ROLE_TOOLS, Node, SessionTotals, chain
from .policy import Policy
from .texts import REASONING_FIELDS, calls, content_parts

__all__ = [
    "END_MARKER",
    "FORMAT_VERSION",
    "HEADER_OPEN",
    "Transcript",
    "escape",
    "format_time",
    "parse",
    "parse_time",
    "render",
    "unescape",
]

FORMAT_VERSION = "1"
HEADER_OPEN = "<!-- session_transcript"
COMMENT_CLOSE = "-->"
ELEMENT_OPEN = "<!--kvwarm:element "
END_MARKER = "<!-- /session_transcript -->"
RENDER_INDENT = "    "

KEY_SIZE = 16
SECRET_ID_SIZE = 8

_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_ESCAPE_RX = re.compile(f"[%{_LINE_BREAKS}]|(?<=--)>")
_HEX2 = re.compile(r"[0-9A-F]{2}")
_HEX4 = re.compile(r"[0-9A-F]{4}")
_HEADER_LINE = re.compile(r"([a-z_]+):(?: (.*))?")
_COUNT = re.compile(r"0|[1-9][0-9]*")
_FLOAT = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?")
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
_FLAGS = {"-": (False, False), "generated": (True, False), "generated,partial": (True, True)}
_ATTRIBUTES = ("depth", "role", "id", "tokens", "created", "flags")


@dataclass(frozen=True, slots=True, kw_only=True)
class Transcript:
    """One session: the path of nodes from element 0 to the leaf, and its totals."""

    session: bytes
    """The leaf key (the session id)."""
    tenant: bytes
    """The tenant root every node is chained from."""
    secret_id: bytes
    """Fingerprint of the server secret that keyed ``tenant`` (8 bytes; see :mod:`proxy.ops.sessions`)."""
    totals: SessionTotals
    nodes: tuple[Node, ...]
    """Element 0 (the tools array) first; ``nodes[-1].key == session``."""


# -- escaping --------------------------------------------------------------------------------


def _code(match: re.Match[str]) -> str:
    point = ord(match.group())
    return f"%{point:02X}" if point < 0x100 else f"%u{point:04X}"


def escape(text: str) -> str:
    """``text`` on one line that holds no ``-->``: see the module docstring for the exact rule."""
    return _ESCAPE_RX.sub(_code, text)


def unescape(line: str) -> str:
    """The inverse of :func:`escape`; ``ValueError`` unless ``line`` is exactly some text's escaping."""
    pieces = line.split("%")
    out = [pieces[0]]
    for piece in pieces[1:]:
        if piece[:1] == "u":
            code, rest, valid = piece[1:5], piece[5:], _HEX4.fullmatch(piece[1:5])
        else:
            code, rest, valid = piece[:2], piece[2:], _HEX2.fullmatch(piece[:2])
        if not valid:
            raise ValueError(f"bad escape {'%' + piece[:5]!r}")
        out.append(chr(int(code, 16)))
        out.append(rest)
    text = "".join(out)
    if escape(text) != line:
        raise ValueError(
            "not the canonical escaping: only %, line breaks and the > of --> are escaped, "
            "and nothing else may be"
        )
    return text


def _quote(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _unquote(value: str) -> str:
    text = urllib.parse.unquote(value, errors="strict")
    if _quote(text) != value:
        raise ValueError(f"{value!r} is not canonically quoted")
    return text


# -- times -----------------------------------------------------------------------------------


def format_time(t: float) -> str:
    """Unix time -> ``2026-04-11T14:30:00.123456Z`` (UTC, microseconds)."""
    return datetime.fromtimestamp(t, UTC).strftime(_TIME_FORMAT)


def parse_time(text: str) -> float:
    """The inverse of :func:`format_time`; ``ValueError`` on any other spelling."""
    if not _TIME.fullmatch(text):
        raise ValueError(f"expected a UTC time like 2026-04-11T14:30:00.000000Z, got {text!r}")
    return datetime.strptime(text, _TIME_FORMAT).replace(tzinfo=UTC).timestamp()


# -- rendering -------------------------------------------------------------------------------


def cache_hit_pct(totals: SessionTotals) -> float | None:
    """Cached share of the prompt tokens in percent; None when no turn reported a cached count."""
    if totals.prompt_tokens <= 0 or totals.unknown_cache_turns >= totals.turns:
        return None
    return 100.0 * totals.cached_tokens / totals.prompt_tokens


def render(transcript: Transcript) -> str:
    """The Markdown text of ``transcript`` (ends with a newline)."""
    t = transcript.totals
    pct = cache_hit_pct(t)
    header = [
        HEADER_OPEN,
        f"version: {FORMAT_VERSION}",
        f"session: {transcript.session.hex()}",
        f"tenant: {transcript.tenant.hex()}",
        f"secret_id: {transcript.secret_id.hex()}",
        f"model: {escape(t.model)}",
        f"created: {format_time(t.created)}",
        f"updated: {format_time(t.updated)}",
        f"turn_count: {t.turns}",
        f"input_tokens: {t.prompt_tokens}",
        f"output_tokens: {t.completion_tokens}",
        f"cached_input_tokens: {t.cached_tokens}",
        f"unknown_cache_turns: {t.unknown_cache_turns}",
        f"cache_hit_pct: {'unknown' if pct is None else f'{pct:.1f}%'}",
        f"charged_usd: {t.cost_usd!r}",
        f"billed: {'true' if t.billed else 'false'}",
        f"repaired: {t.repaired}",
        f"last_break: {escape(t.last_break)}",
        COMMENT_CLOSE,
        "",
        f"# Session {transcript.session.hex()}",
        "",
        *_indent(_summary(transcript, pct)),
        "",
    ]
    lines = header
    for node in transcript.nodes:
        lines.extend(_render_node(node))
    lines.append(END_MARKER)
    lines.append("")
    return "\n".join(lines)


def _summary(transcript: Transcript, pct: float | None) -> str:
    t = transcript.totals
    hit = "unknown" if pct is None else f"{pct:.1f} %"
    messages = max(len(transcript.nodes) - 1, 0)
    return (
        f"model {t.model or '-'} · turns {t.turns} · messages {messages}\n"
        f"prompt {t.prompt_tokens} tokens, cached {t.cached_tokens} ({hit}), completion {t.completion_tokens}\n"
        f"cost ${t.cost_usd:.6f} ({'billed' if t.billed else 'estimated'}) · repaired {t.repaired}"
        f" · last break: {t.last_break or '-'}\n"
        f"created {format_time(t.created)} · updated {format_time(t.updated)}"
    )


def _render_node(node: Node) -> list[str]:
    flags = "generated,partial" if node.partial else "generated" if node.generated else "-"
    title = f"## {node.depth} · {_quote(node.role) or '(no role)'}"
    if node.generated:
        title += " · generated" + (" (partial)" if node.partial else "")
    body = node.body.decode("utf-8")
    return [
        title,
        "",
        *_indent(_readable(node.role, body)),
        "",
        f"{ELEMENT_OPEN}depth={node.depth} role={_quote(node.role)} id={node.identity.hex()} "
        f"tokens={node.tokens} created={format_time(node.created)} flags={flags}",
        escape(body),
        COMMENT_CLOSE,
        "",
    ]


def _indent(text: str) -> list[str]:
    """Rendering lines: four spaces in front, so no content line can pass for structure."""
    for ch in _LINE_BREAKS[1:]:
        text = text.replace(ch, " ")
    return [RENDER_INDENT + line for line in text.split("\n")]


def _readable(role: str, body: str) -> str:
    """What a person wants to read of an element; lossy by design (the data line is exact)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if role == ROLE_TOOLS and isinstance(value, list):
        return "\n".join(_tool_line(d) for d in value) if value else "(no tools)"
    if not isinstance(value, dict):
        return body
    out: list[str] = []
    call_id = value.get("tool_call_id")
    if isinstance(call_id, str):
        out.append(f"(result of {call_id})")
    for key in REASONING_FIELDS:
        text = value.get(key)
        if isinstance(text, str) and text:
            out.append(f"(reasoning) {text}")
    out.extend(text if is_text else f"[{text}]" for text, is_text in content_parts(value.get("content")))
    out.extend(f"→ {name}({arguments})" for name, arguments in calls(value))
    return "\n".join(out) if out else "(no content)"


def _tool_line(definition: Any) -> str:
    fn = definition.get("function") if isinstance(definition, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        description = fn.get("description")
        first = description.split("\n", 1)[0] if isinstance(description, str) else ""
        return f"{fn['name']}: {first}" if first else fn["name"]
    return orjson.dumps(definition).decode()


# -- parsing ---------------------------------------------------------------------------------


def _fail(line: int, problem: str) -> TranscriptFormatError:
    return TranscriptFormatError(line, problem)


def _count(text: str) -> int:
    if not _COUNT.fullmatch(text):
        raise ValueError(f"expected a whole number, got {text!r}")
    return int(text)


def _usd(text: str) -> float:
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"expected a non-negative number of USD, got {text!r}")
    value = float(text)
    if value == float("inf"):
        raise ValueError(f"{text!r} is out of range")
    return value


def _boolean(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text == "true"


def _key(size: int) -> Callable[[str], bytes]:
    def parse_key(text: str) -> bytes:
        if not re.fullmatch(f"[0-9a-f]{{{2 * size}}}", text):
            raise ValueError(f"expected {2 * size} lower-case hex digits, got {text!r}")
        return bytes.fromhex(text)

    return parse_key


def _version(text: str) -> str:
    if text != FORMAT_VERSION:
        raise ValueError(f"unsupported version {text!r} (this kvwarm reads version {FORMAT_VERSION})")
    return text


_HEADER: dict[str, Callable[[str], Any]] = {
    "version": _version,
    "session": _key(KEY_SIZE),
    "tenant": _key(KEY_SIZE),
    "secret_id": _key(SECRET_ID_SIZE),
    "model": unescape,
    "created": parse_time,
    "updated": parse_time,
    "turn_count": _count,
    "input_tokens": _count,
    "output_tokens": _count,
    "cached_input_tokens": _count,
    "unknown_cache_turns": _count,
    "cache_hit_pct": str,
    "charged_usd": _usd,
    "billed": _boolean,
    "repaired": _count,
    "last_break": unescape,
}
"""Every header key and its reader. ``cache_hit_pct`` is derived (written for people, not read back)."""
_OPTIONAL = frozenset({"cache_hit_pct"})


def _decode(data: bytes | str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(data[: exc.start].count(b"\n") + 1, "not UTF-8 text") from exc


def parse(data: bytes | str, policy: Policy | None = None) -> Transcript:
    """Read a transcript written by :func:`render`, verified whole (see the module docstring).

    ``policy`` must be the importing instance's (its ``pin_patterns`` shape identities).
    """
    lines = _decode(data).split("\n")
    if lines[-1] == "":
        lines.pop()
    return _Parser(lines, policy or Policy()).run()


class _Parser:
    def __init__(self, lines: Sequence[str], policy: Policy) -> None:
        self.lines = lines
        self.policy = policy

    def numbered(self, start: int) -> Iterator[tuple[int, str]]:
        for i in range(start, len(self.lines)):
            yield i + 1, self.lines[i]

    def run(self) -> Transcript:
        values, header_lines, after = self.header()
        nodes: list[Node] = []
        tenant: bytes = values["tenant"]
        parent = tenant
        ended = 0
        number = after
        while number < len(self.lines):
            number += 1
            line = self.lines[number - 1]
            if ended:
                if line.strip():
                    raise _fail(number, f"text after the end marker of line {ended}")
                continue
            if line == END_MARKER:
                ended = number
            elif line.startswith(ELEMENT_OPEN):
                node = self.element(number, len(nodes), parent, tenant)
                nodes.append(node)
                parent = node.key
                number += 2
            elif not line.strip() or line.startswith(("#", RENDER_INDENT)):
                continue
            else:
                raise _fail(number, f"unexpected line {_shown(line)}: expected an element, a heading, "
                            "an indented rendering line or the end marker")
        if not ended:
            raise _fail(len(self.lines) + 1, f"the file is truncated: no end marker {END_MARKER!r}")
        if not nodes:
            raise _fail(ended, "the transcript holds no elements")
        if parent != values["session"]:
            raise _fail(
                header_lines["session"],
                "the session id is not the chain of the element identities under the tenant: "
                "an element is missing, extra, reordered or edited",
            )
        totals = SessionTotals(
            turns=values["turn_count"],
            prompt_tokens=values["input_tokens"],
            cached_tokens=values["cached_input_tokens"],
            completion_tokens=values["output_tokens"],
            unknown_cache_turns=values["unknown_cache_turns"],
            cost_usd=values["charged_usd"],
            billed=values["billed"],
            repaired=values["repaired"],
            last_break=values["last_break"],
            model=values["model"],
            created=values["created"],
            updated=values["updated"],
        )
        return Transcript(
            session=values["session"],
            tenant=tenant,
            secret_id=values["secret_id"],
            totals=totals,
            nodes=tuple(nodes),
        )

    def header(self) -> tuple[dict[str, Any], dict[str, int], int]:
        """The header's values, the line of each key, and the number of the line that closes it."""
        first = self.lines[0] if self.lines else ""
        if first != HEADER_OPEN:
            problem = f"expected {HEADER_OPEN!r}, got {_shown(first)}: not a kvwarm session transcript"
            if first.rstrip("\r") == HEADER_OPEN:
                problem = "the file has CRLF line endings (converted after export): not as kvwarm wrote it"
            raise _fail(1, problem)
        values: dict[str, Any] = {}
        where: dict[str, int] = {}
        for number, line in self.numbered(1):
            if line == COMMENT_CLOSE:
                missing = [k for k in _HEADER if k not in values and k not in _OPTIONAL]
                if missing:
                    raise _fail(number, f"the header lacks {', '.join(missing)}")
                return values, where, number
            found = _HEADER_LINE.fullmatch(line)
            if found is None:
                raise _fail(number, f"expected 'key: value' or '-->' in the header, got {_shown(line)}")
            key, raw = found.group(1), found.group(2) or ""
            reader = _HEADER.get(key)
            if reader is None:
                raise _fail(number, f"unknown header key {key!r}")
            if key in values:
                raise _fail(number, f"header key {key!r} repeats line {where[key]}")
            try:
                values[key] = reader(raw)
            except ValueError as exc:
                raise _fail(number, f"{key}: {exc}") from None
            where[key] = number
        raise _fail(len(self.lines) + 1, "the file is truncated: the header is not closed with '-->'")

    def element(self, number: int, depth: int, parent: bytes, tenant: bytes) -> Node:
        attrs = self.attributes(number)
        if attrs["depth"] != depth:
            raise _fail(number, f"element depth {attrs['depth']} out of order: expected {depth}")
        if number + 2 > len(self.lines):
            raise _fail(number, "unterminated element: the file ends before its data line and '-->'")
        if self.lines[number + 1] != COMMENT_CLOSE:
            raise _fail(number + 2, f"expected '-->' closing the element of line {number}, got "
                        f"{_shown(self.lines[number + 1])}")
        try:
            body = unescape(self.lines[number]).encode("utf-8")
        except ValueError as exc:
            raise _fail(number + 1, str(exc)) from None
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _fail(number + 1, f"the element body is not JSON: {exc}") from None
        generated, partial = attrs["flags"]
        role = attrs["role"]
        expected = _role_of(value, depth, generated)
        if role != expected:
            raise _fail(number, f"bad role {role!r}: the element at depth {depth} is {expected!r}")
        if depth == 0 and generated:
            raise _fail(number, "the tools element cannot be generated")
        identity = tools_identity(value) if depth == 0 else message_identity(value, self.policy)
        if identity != attrs["id"]:
            raise _fail(number, "the id does not match the body: the body was edited, or the "
                        "transcript was exported under other repair.pin_patterns")
        return Node(
            key=chain(parent, identity),
            parent=parent,
            tenant=tenant,
            depth=depth,
            role=role,
            identity=identity,
            body=body,
            tokens=attrs["tokens"],
            generated=generated,
            partial=partial,
            created=attrs["created"],
        )

    def attributes(self, number: int) -> dict[str, Any]:
        line = self.lines[number - 1]
        out: dict[str, Any] = {}
        for item in line[len(ELEMENT_OPEN) :].split(" "):
            name, eq, raw = item.partition("=")
            if not eq or name not in _ATTRIBUTES:
                raise _fail(number, f"unknown element attribute {_shown(item)} (known: {', '.join(_ATTRIBUTES)})")
            if name in out:
                raise _fail(number, f"element attribute {name!r} repeats")
            try:
                out[name] = _attribute(name, raw)
            except ValueError as exc:
                raise _fail(number, f"{name}: {exc}") from None
        missing = [name for name in _ATTRIBUTES if name not in out]
        if missing:
            raise _fail(number, f"the element lacks {', '.join(missing)}")
        return out


def _attribute(name: str, raw: str) -> Any:
    if name in ("depth", "tokens"):
        return _count(raw)
    if name == "role":
        return _unquote(raw)
    if name == "id":
        return _key(KEY_SIZE)(raw)
    if name == "created":
        return parse_time(raw)
    flags = _FLAGS.get(raw)
    if flags is None:
        raise ValueError(f"expected one of {', '.join(_FLAGS)}, got {raw!r}")
    return flags


def _role_of(value: Any, depth: int, generated: bool) -> str:
    """The role a node of this body has (as :func:`proxy.core.match.new_nodes` assigns it)."""
    if depth == 0:
        return ROLE_TOOLS
    role = value.get("role") if isinstance(value, dict) else None
    if isinstance(role, str) and role:
        return role
    return "assistant" if generated else ""


def _shown(line: str, limit: int = 60) -> str:
    return repr(line if len(line) <= limit else line[:limit] + "…")
