"""The inspection commands: ``kvwarm sessions``, ``show``, ``export`` and ``import``.

Each opens the configured store directly (``--store`` / ``--config``, parsed by
:mod:`proxy.cli`), does its work and closes it, in one ``asyncio.run``. The
logic is :mod:`proxy.ops.sessions`'; this module only prints.

A store in use by a running ``kvwarm serve`` can be listed, shown and exported
(sessions of the last ``store.flush_interval`` may be missing); a damaged sqlite file
makes these fail, and is moved aside only by ``serve`` and ``import``. Import into a
store no server has open: a running server would not see the imported sessions
until restarted. Exit status: 0 on success, 1 when anything failed (a session
not found, a transcript refused: each reported on stderr with its file, line and
problem, never with the file's content).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TextIO

from ..config import Settings
from ..core import transcript_md
from ..store.base import AsyncStore, SessionInfo
from ..store.factory import make_store
from ..store.tokens import TokenCounter
from . import sessions

__all__ = ["run"]

OK = 0
FAILED = 1

_Command = Callable[[AsyncStore, argparse.Namespace, Settings, TextIO, TextIO], Awaitable[int]]
"""A command: runs on an open store, between the awaited ``open()`` and ``close()``."""


def run(
    name: str,
    args: argparse.Namespace,
    settings: Settings,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run command ``name`` (``sessions``, ``show``, ``export``, ``import``); returns the exit status."""
    command = _COMMANDS.get(name)
    if command is None:
        raise ValueError(f"unknown inspection command {name!r}")
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    return asyncio.run(_with_store(command, args, settings, out, err, writes=name == "import"))


async def _with_store(
    command: _Command, args: argparse.Namespace, settings: Settings, out: TextIO, err: TextIO, *, writes: bool
) -> int:
    # Reading commands may run beside a server: a damaged sqlite file is reported, never moved
    # from under it. Import writes (into a store no server has open) and may start afresh.
    store = make_store(settings.store, set_aside_damaged=writes)
    await store.open()
    try:
        return await command(store, args, settings, out, err)
    finally:
        await store.close()


async def _sessions(store: AsyncStore, args: argparse.Namespace, settings: Settings, out: TextIO, err: TextIO) -> int:
    infos = await store.sessions()
    out.write(format_table(infos))
    return OK


def format_table(infos: list[SessionInfo]) -> str:
    """The session list as an aligned text table (full ids: ``show`` takes them, or a prefix)."""
    head = ("SESSION", "MODEL", "TURNS", "MSGS", "PROMPT", "CACHED", "HIT", "OUTPUT", "COST", "BREAK", "UPDATED")
    rows = [head]
    for i in infos:
        t = i.totals
        pct = transcript_md.cache_hit_pct(t)
        rows.append(
            (
                sessions.session_id(i.leaf),
                transcript_md.escape(t.model) or "-",
                str(t.turns),
                str(i.depth),
                str(t.prompt_tokens),
                str(t.cached_tokens),
                "?" if pct is None else f"{pct:.1f}%",
                str(t.completion_tokens),
                f"${t.cost_usd:.6f}" + ("" if t.billed else "~"),
                t.last_break or "-",
                transcript_md.format_time(t.updated)[:19].replace("T", " "),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    numeric = {2, 3, 4, 5, 6, 7, 8}
    lines = [
        "  ".join(cell.rjust(w) if c in numeric else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths, strict=True))).rstrip()
        for r in rows
    ]
    return "\n".join(lines) + "\n"


async def _show(store: AsyncStore, args: argparse.Namespace, settings: Settings, out: TextIO, err: TextIO) -> int:
    leaf = await sessions.find_session(store, args.session)
    transcript = await sessions.load_session(store, leaf, count=TokenCounter().count_body) if leaf is not None else None
    if transcript is None:
        err.write(f"kvwarm: no session {args.session!r} (or the prefix is ambiguous); see `kvwarm sessions`\n")
        return FAILED
    if args.format == "json":
        out.write(sessions.session_json(transcript).decode("utf-8") + "\n")
    else:
        out.write(transcript_md.render(transcript))
    return OK


async def _export(store: AsyncStore, args: argparse.Namespace, settings: Settings, out: TextIO, err: TextIO) -> int:
    directory = Path(args.dir)
    report = await sessions.export_sessions(store, directory, count=TokenCounter().count_body)
    for path in report.written:
        out.write(f"{path}\n")
    for sid, problem in report.failed:
        err.write(f"kvwarm: export: session {sid}: {problem}\n")
    err.write(f"kvwarm: exported {len(report.written)} sessions to {directory}\n")
    return FAILED if report.failed else OK


async def _import(store: AsyncStore, args: argparse.Namespace, settings: Settings, out: TextIO, err: TextIO) -> int:
    directory = Path(args.dir)
    if not await asyncio.to_thread(directory.is_dir):
        err.write(f"kvwarm: import: {directory} is not a directory\n")
        return FAILED
    key = getattr(args, "tenant_key", None)
    root = sessions.new_root(store, key, settings.store.tenant_header) if key else None
    policy = settings.repair.policy()
    report = await sessions.import_dir(store, directory, policy, root, max_bytes=settings.store.import_max_bytes)
    for path, outcome in report.imported:
        state = "imported" if outcome.new_session else "already present"
        out.write(f"{_printable(path)}: {state}: session {sessions.session_id(outcome.leaf)} ({outcome.new_nodes} new nodes)\n")
    for path, problem in report.refused:
        err.write(f"kvwarm: import: {_printable(path)}: {problem}; nothing of it was imported\n")
    err.write(
        f"kvwarm: imported {sum(o.new_session for _, o in report.imported)} sessions from "
        f"{len(report.imported)} files; {len(report.refused)} files refused\n"
    )
    return FAILED if report.refused else OK


def _printable(path: Path) -> str:
    """A file name for the terminal: control characters (a name may hold escape sequences) as ``\\xNN``."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in str(path))


_COMMANDS: Mapping[str, _Command] = {
    "sessions": _sessions,
    "show": _show,
    "export": _export,
    "import": _import,
}
