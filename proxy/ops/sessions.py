"""Sessions as people see them: ids, listing, one session's transcript, export and import.

Shared by the admin API (:mod:`proxy.ops.admin`) and the command line
(:mod:`proxy.ops.inspect_cli`); neither holds logic of its own beyond its edge.

* A session is a leaf of the transcript tree that holds :class:`SessionTotals`;
  its id is the hex of the leaf key (32 hex digits). That is no secret: keys are
  hashes chained from the tenant root, itself an HMAC of the credential.
* Export writes one Markdown transcript per session (:mod:`proxy.core.transcript_md`)
  under a name allocated atomically: ``<first 16 hex of the id>_<n>.md``, created
  with ``O_CREAT | O_EXCL`` and, when the name is taken, retried with ``n + 1``.
  Two exports running at once (threads or processes) never write the same file.
* Import parses each file whole (a malformed one raises
  :class:`~proxy.errors.TranscriptFormatError` and nothing of it is stored), then
  inserts its nodes (insert-if-absent, so importing twice changes nothing) and,
  when the leaf holds no totals yet, the session's totals.
* Import reads regular files only, at most ``store.import_max_bytes`` each
  (:func:`read_transcript_file`): a symbolic link, device, FIFO or directory is
  refused without being read (``O_NOFOLLOW``, and the file opened must be the one
  ``lstat`` saw), and the size is checked before and while reading. A refusal names
  the file, the line and the problem, never the file's content
  (:func:`refusal_problem`): whoever runs the import may be able to read files its
  author cannot.

Tenants on import: a transcript names its tenant root and a fingerprint of the
server secret that keyed it (:func:`secret_id`). Without a tenant key, the
session is restored under that same root, which only means something to an
instance sharing the secret (``store.secret``, or the ``PATH.secret`` file of
the sqlite store): an import into a store with another secret is refused
(:class:`ImportRefused`) rather than stored where no request could ever match
it. With a tenant key, every session is re-chained under the root of that key:
the identities are kept and the keys recomputed with
:func:`proxy.core.match.chain`.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from ..core import transcript_md
from ..core.match import chain, tenant_root
from ..core.policy import Policy
from ..core.transcript_md import Transcript
from ..errors import ImportRefused, TranscriptFormatError
from ..store.base import AsyncStore, Node, SessionInfo, SessionTotals

__all__ = [
    "ExportReport",
    "ImportOutcome",
    "ImportRefused",
    "ImportReport",
    "credential_for_key",
    "export_sessions",
    "find_session",
    "import_dir",
    "import_file",
    "import_transcript",
    "list_json",
    "load_session",
    "new_root",
    "read_transcript_file",
    "rechain",
    "refusal_problem",
    "secret_id",
    "session_id",
    "session_json",
    "summary",
    "write_new_file",
]

DEFAULT_IMPORT_MAX_BYTES = 64 * 1024 * 1024
"""The default of ``store.import_max_bytes``."""
ID_HEX = 32
"""Length of a session id (hex of a 16-byte leaf key)."""
MIN_PREFIX = 4
"""Shortest id prefix :func:`find_session` accepts."""
FILE_STEM_HEX = 16
MAX_NAME_TRIES = 100_000
_SECRET_ID_LABEL = b"\x00kvwarm secret id"
"""What :func:`secret_id` MACs. It holds a NUL, so no header value (no tenant credential) equals it."""
_HEX = re.compile(r"[0-9a-f]+")


# -- ids and lookups -------------------------------------------------------------------------


def session_id(leaf: bytes) -> str:
    return leaf.hex()


def secret_id(secret: bytes) -> bytes:
    """An 8-byte fingerprint of the server secret; tells an importer whether it shares the secret."""
    return hmac.new(secret, _SECRET_ID_LABEL, hashlib.sha256).digest()[: transcript_md.SECRET_ID_SIZE]


async def find_session(store: AsyncStore, text: str, tenant: bytes | None = None) -> bytes | None:
    """The leaf of the session ``text`` names: its full id, or a unique prefix of at least 4 hex digits.

    Only sessions of ``tenant`` are considered when it is given. None when nothing (or more than
    one session) matches.
    """
    wanted = text.strip().lower()
    if not MIN_PREFIX <= len(wanted) <= ID_HEX or not _HEX.fullmatch(wanted):
        return None
    if len(wanted) == ID_HEX:
        leaf = bytes.fromhex(wanted)
        return leaf if await load_session(store, leaf, tenant, with_secret=False) is not None else None
    found = [info.leaf for info in await store.sessions(tenant) if info.leaf.hex().startswith(wanted)]
    return found[0] if len(found) == 1 else None


async def load_session(
    store: AsyncStore,
    leaf: bytes,
    tenant: bytes | None = None,
    *,
    with_secret: bool = True,
    count: Callable[[bytes], int] | None = None,
) -> Transcript | None:
    """The session ending at ``leaf`` (of ``tenant`` when given), or None.

    ``with_secret=False`` leaves :attr:`Transcript.secret_id` empty (it is only needed to export).
    ``count`` (a node body's token count): the nodes stored uncounted (a local store counts
    them when read) are counted for this transcript, in a worker thread; the store is not changed.
    """
    totals = await store.totals(leaf, tenant)
    if totals is None:
        return None
    nodes = await store.path(leaf, tenant)
    if not nodes or (tenant is not None and nodes[-1].tenant != tenant):
        return None
    if count is not None and any(n.tokens < 0 for n in nodes):
        nodes = await asyncio.to_thread(with_counts, nodes, count)
    return Transcript(
        session=leaf,
        tenant=nodes[-1].tenant,
        secret_id=secret_id(store.secret()) if with_secret else b"",
        totals=totals,
        nodes=tuple(nodes),
    )


def with_counts(nodes: Sequence[Node], count: Callable[[bytes], int]) -> list[Node]:
    """``nodes``, each stored uncounted (tokens < 0) with its count."""
    return [n.with_tokens(count(n.body)) if n.tokens < 0 else n for n in nodes]


# -- JSON views ------------------------------------------------------------------------------


def summary(leaf: bytes, tenant: bytes, depth: int, totals: SessionTotals) -> dict[str, Any]:
    """One session as the list and the detail views show it."""
    pct = transcript_md.cache_hit_pct(totals)
    return {
        "id": session_id(leaf),
        "tenant": tenant.hex(),
        "model": totals.model,
        "messages": depth,
        "turns": totals.turns,
        "prompt_tokens": totals.prompt_tokens,
        "cached_tokens": totals.cached_tokens,
        "completion_tokens": totals.completion_tokens,
        "unknown_cache_turns": totals.unknown_cache_turns,
        "cache_hit_pct": None if pct is None else round(pct, 2),
        "cost_usd": totals.cost_usd,
        "cost_billed": totals.billed,
        "repaired": totals.repaired,
        "last_break": totals.last_break or None,
        "created": transcript_md.format_time(totals.created),
        "updated": transcript_md.format_time(totals.updated),
    }


def list_json(infos: Sequence[SessionInfo], limit: int) -> bytes:
    """``{"object": "list", "data": [...], "has_more": bool}``, most recently updated first."""
    data = [summary(i.leaf, i.tenant, i.depth, i.totals) for i in infos[:limit]]
    return orjson.dumps({"object": "list", "data": data, "has_more": len(infos) > limit})


def session_json(transcript: Transcript) -> bytes:
    """The session's summary and its elements; each ``body`` is the stored JSON, byte for byte."""
    last = transcript.nodes[-1]
    out = summary(transcript.session, transcript.tenant, last.depth, transcript.totals)
    out["elements"] = [
        {
            "depth": n.depth,
            "role": n.role,
            "identity": n.identity.hex(),
            "tokens": n.tokens,
            "generated": n.generated,
            "partial": n.partial,
            "created": transcript_md.format_time(n.created),
            # A Fragment is written as is: the exact stored bytes, not a re-serialization.
            "body": orjson.Fragment(n.body),
        }
        for n in transcript.nodes
    ]
    return orjson.dumps(out)


# -- export ----------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class ExportReport:
    written: list[Path] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(session id, problem) of sessions that could not be written."""


def write_new_file(directory: Path, stem: str, data: bytes) -> Path:
    """Write ``data`` to ``directory/<stem>_<n>.md`` for the lowest free ``n`` >= 1; never overwrites.

    The name is claimed with ``O_CREAT | O_EXCL`` (atomic on a local file system), so concurrent
    writers each get their own. A write that fails removes its file: no partial transcript stays.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for n in range(1, MAX_NAME_TRIES + 1):
        path = directory / f"{stem}_{n}.md"
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return path
    raise FileExistsError(f"{directory}: no free name {stem}_<n>.md below n={MAX_NAME_TRIES}")


async def export_sessions(
    store: AsyncStore, directory: Path, tenant: bytes | None = None, *, count: Callable[[bytes], int] | None = None
) -> ExportReport:
    """Write every session (of ``tenant`` when given) to ``directory`` (created if missing);
    ``count``: as :func:`load_session`'s."""
    # The command line's own loop: file work goes to a thread all the same (nothing blocks a loop).
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    report = ExportReport()
    for info in await store.sessions(tenant):
        transcript = await load_session(store, info.leaf, info.tenant, count=count)
        if transcript is None:  # evicted between listing and loading
            continue
        try:
            data = transcript_md.render(transcript).encode("utf-8")
        except ValueError as exc:  # a body that is not UTF-8 text
            report.failed.append((session_id(info.leaf), f"cannot render: {exc}"))
            continue
        report.written.append(
            await asyncio.to_thread(write_new_file, directory, session_id(info.leaf)[:FILE_STEM_HEX], data)
        )
    return report


# -- import ----------------------------------------------------------------------------------


def credential_for_key(key: str, tenant_header: str = "") -> str:
    """The credential the pipeline keys a tenant by, from what a user holds.

    Tenants keyed by ``Authorization`` (the default): the bare API key ``sk-...`` becomes
    ``Bearer sk-...``, the header value an SDK sends; a value already starting with
    ``Bearer `` is taken as is. With ``store.tenant_header`` set, ``key`` is that header's value.
    """
    if tenant_header or key[:7].lower() == "bearer ":
        return key
    return f"Bearer {key}"


def rechain(nodes: Sequence[Node], root: bytes) -> list[Node]:
    """The same elements chained under another tenant root: identities kept, keys recomputed."""
    out: list[Node] = []
    parent = root
    for node in nodes:
        key = chain(parent, node.identity)
        out.append(replace(node, key=key, parent=parent, tenant=root))
        parent = key
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportOutcome:
    leaf: bytes
    """The session id under the tenant it was imported to."""
    new_nodes: int
    new_session: bool
    """False when the store already held this session (its totals are left as they were)."""


async def import_transcript(store: AsyncStore, transcript: Transcript, root: bytes | None = None) -> ImportOutcome:
    """Store a parsed transcript: under its own tenant, or re-chained under ``root``.

    Without ``root`` the store must share the secret the transcript was exported under.
    """
    if root is None:
        if transcript.secret_id != secret_id(store.secret()):
            raise ImportRefused(
                "exported under another server secret: configure the exporting instance's "
                "store.secret, or pass --tenant-key to assign the session to a tenant of this store"
            )
        nodes = list(transcript.nodes)
    else:
        nodes = rechain(transcript.nodes, root)
    leaf = nodes[-1].key
    tenant = nodes[-1].tenant
    added = await store.insert(nodes)
    if not await store.path(leaf, tenant):
        raise ImportRefused("the store did not keep the session's nodes")
    new_session = await store.totals(leaf, tenant) is None
    if new_session:
        await store.add_turn(leaf, None, transcript.totals, tenant)
    return ImportOutcome(leaf=leaf, new_nodes=added, new_session=new_session)


_READ_CHUNK = 1 << 20
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_transcript_file(path: Path, max_bytes: int = DEFAULT_IMPORT_MAX_BYTES) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``max_bytes``; else :class:`ImportRefused`.

    Never follows a symbolic link and never reads from a device or FIFO: ``lstat`` first, then
    ``open(O_NOFOLLOW | O_NONBLOCK)`` and ``fstat`` to check the file opened is the one inspected.
    The size is checked before reading and again while reading (a file may grow meanwhile).
    """
    before = os.lstat(path)
    kind = _not_regular(before.st_mode)
    if kind is not None:
        raise ImportRefused(f"{kind}, not a regular file: only regular files are imported")
    too_big = f"larger than store.import_max_bytes ({max_bytes} bytes)"
    if before.st_size > max_bytes:
        raise ImportRefused(too_big)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise ImportRefused("a symbolic link, not a regular file: only regular files are imported") from None
        raise
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(opened.st_mode):
            raise ImportRefused("replaced while being opened: only regular files are imported")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total))
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > max_bytes:
                raise ImportRefused(too_big)
            chunks.append(chunk)
    finally:
        os.close(fd)


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'" + r'|"(?:[^"\\]|\\.)*"')
_FORMAT_WORDS = frozenset(
    repr(word)
    for word in (
        transcript_md.HEADER_OPEN,
        transcript_md.COMMENT_CLOSE,
        transcript_md.ELEMENT_OPEN,
        transcript_md.END_MARKER,
        "key: value",
        "depth", "role", "id", "tokens", "created", "flags",
        "system", "developer", "user", "assistant", "tool", "tools",
    )
)
"""Quoted words of the transcript format itself: a refusal may show these."""
WITHHELD = "'…'"


def refusal_problem(exc: TranscriptFormatError) -> str:
    """``line N: <problem>`` without anything quoted from the file.

    The parser's messages quote the offending text (``repr``); each quoted value that is not a
    word of the format is replaced by ``'…'``. A message whose quoting cannot be told apart is
    withheld whole.
    """
    unquoted = _QUOTED.sub("", exc.problem)
    if "'" in unquoted or '"' in unquoted:
        problem = "malformed (the details would quote the file)"
    else:
        problem = _QUOTED.sub(lambda m: m.group() if m.group() in _FORMAT_WORDS else WITHHELD, exc.problem)
    return f"line {exc.line}: {problem}"


async def import_file(
    store: AsyncStore,
    path: Path,
    policy: Policy,
    root: bytes | None = None,
    *,
    max_bytes: int = DEFAULT_IMPORT_MAX_BYTES,
) -> ImportOutcome:
    """Read ``path`` (:func:`read_transcript_file`), parse it whole, then store it.
    Raises TranscriptFormatError, ImportRefused or OSError."""
    transcript = transcript_md.parse(await asyncio.to_thread(read_transcript_file, path, max_bytes), policy)
    return await import_transcript(store, transcript, root)


@dataclass(slots=True, kw_only=True)
class ImportReport:
    imported: list[tuple[Path, ImportOutcome]] = field(default_factory=list)
    refused: list[tuple[Path, str]] = field(default_factory=list)
    """(file, problem): each a file of which nothing was stored."""


async def import_dir(
    store: AsyncStore,
    directory: Path,
    policy: Policy,
    root: bytes | None = None,
    *,
    max_bytes: int = DEFAULT_IMPORT_MAX_BYTES,
) -> ImportReport:
    """Import every ``*.md`` of ``directory`` (sorted by name); a bad file is refused whole, the rest import.
    A refusal never quotes the file (:func:`refusal_problem`)."""
    report = ImportReport()
    for path in await asyncio.to_thread(lambda: sorted(directory.glob("*.md"))):
        try:
            report.imported.append((path, await import_file(store, path, policy, root, max_bytes=max_bytes)))
        except TranscriptFormatError as exc:
            report.refused.append((path, refusal_problem(exc)))
        except ImportRefused as exc:
            report.refused.append((path, str(exc)))
        except OSError as exc:
            report.refused.append((path, f"cannot read: {exc.strerror or exc}"))
    return report


def new_root(store: AsyncStore, key: str, tenant_header: str = "") -> bytes:
    """The tenant root of the API key ``key`` in ``store`` (see :func:`credential_for_key`)."""
    return tenant_root(store.secret(), credential_for_key(key, tenant_header))
