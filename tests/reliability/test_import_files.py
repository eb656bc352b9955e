"""``kvwarm import`` reads regular files only, up to ``store.import_max_bytes``, and never echoes a refused file.

The real command runs in a child process (with a 2 GiB address-space limit and a time limit, so
today's kvwarm, which follows ``z.md -> /dev/zero`` and reads it whole, fails the test instead
of eating the machine). The transcript directory holds one good export beside symbolic links to
``/dev/zero`` and to a file of secrets, a FIFO, a file over the size limit, and malformed files
whose offending lines are secrets. Everything but the good file is refused by name (and line),
and no secret appears in the output.
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
from pathlib import Path

from proxy.core import transcript_md
from proxy.ops import sessions
from proxy.store.local import LocalStore
from proxy.store.sqlite.store import SqliteStore
from tests.test_inspect_cli import filled_store

SECRET = "s" * 32
PASSWORD_LINE = "root:$6$saltsalt$0123456789abcdefSECRETHASH:19000:0:99999:7:::"
KEY_LINE = "OPENAI_API_KEY=sk-live-0123456789SECRETKEY"
LIMIT = 64 * 1024


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def kvwarm_import(directory: Path, db: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVWARM_STORE_SECRET": SECRET, "KVWARM_STORE_IMPORT_MAX_BYTES": str(LIMIT)}
    return subprocess.run(
        [sys.executable, "-m", "proxy", "import", str(directory), "--store", f"sqlite:{db}"],
        env=env, capture_output=True, text=True, timeout=60, preexec_fn=_limit_memory, check=False,
    )


def test_import_refuses_links_devices_fifos_and_big_files_and_quotes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "export"
    report = asyncio.run(sessions.export_sessions(LocalStore(filled_store(SECRET.encode(), 1)), source))
    (good,) = report.written
    text = good.read_text()

    secrets_file = tmp_path / "private" / "passwd"
    secrets_file.parent.mkdir()
    secrets_file.write_text(PASSWORD_LINE + "\n")
    (source / "z.md").symlink_to("/dev/zero")
    (source / "p.md").symlink_to(secrets_file)
    os.mkfifo(source / "f.md")
    (source / "big.md").write_text(text + "#" * LIMIT + "\n")
    (source / "d.md").mkdir()
    # Malformed: line 1 is a secret; and a secret line in the middle of an otherwise good file.
    (source / "first.md").write_text(PASSWORD_LINE + "\n" + text)
    lines = text.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(transcript_md.ELEMENT_OPEN))
    (source / "middle.md").write_text("\n".join([*lines[:at], KEY_LINE, *lines[at:]]))

    result = kvwarm_import(source, tmp_path / "kv.db")
    out, err = result.stdout, result.stderr
    assert result.returncode == 1, err
    assert "Traceback" not in err
    for secret in ("SECRETHASH", "SECRETKEY", "saltsalt", "sk-live"):
        assert secret not in out + err, f"a refused file's content was printed: {secret}"

    refused = {line.split(": ", 3)[2]: line for line in err.splitlines() if line.startswith("kvwarm: import: ")}
    assert "symbolic link" in refused[str(source / "z.md")]
    assert "symbolic link" in refused[str(source / "p.md")]
    assert "FIFO" in refused[str(source / "f.md")]
    assert "directory" in refused[str(source / "d.md")]
    assert "import_max_bytes" in refused[str(source / "big.md")]
    assert "line 1: " in refused[str(source / "first.md")]
    assert f"line {at + 1}: " in refused[str(source / "middle.md")]
    assert "7 files refused" in err
    assert f"{good}: imported: session " in out

    check = SqliteStore(tmp_path / "kv.db", 3600.0, 1 << 30, SECRET.encode(), set_aside_damaged=False)

    async def count() -> int:
        await check.open()
        try:
            return len(check.sessions())
        finally:
            await check.close()

    assert asyncio.run(count()) == 1


def test_a_refusal_names_path_line_and_problem_only() -> None:
    """The parser's messages quote the offending text; the refusal keeps the format's own words only."""
    cases = [
        (PASSWORD_LINE, 1),
        ("<!-- session_transcript\nversion: " + KEY_LINE, 2),
        ("<!-- session_transcript\nmodel: it's \"quoted\" \\ %zz", 2),
    ]
    for data, line in cases:
        try:
            transcript_md.parse(data)
        except transcript_md.TranscriptFormatError as exc:
            shown = sessions.refusal_problem(exc)
        else:
            raise AssertionError("the sample must be malformed")
        assert shown.startswith(f"line {line}: ")
        for secret in ("SECRETHASH", "SECRETKEY", "it's", "quoted", "%zz"):
            assert secret not in shown, shown
