"""The real Claude Code CLI (npm ``@anthropic-ai/claude-code``) as a test client: find it, run ``claude -p``.

The CLI is installed by ``.ci/install/claude.sh`` into ``$KVWARM_CLIENTS_DIR`` (default
``~/.cache/kvwarm-clients``, beside the Codex CLI). :func:`run_claude` points it at a base URL
(``ANTHROPIC_BASE_URL``: the server's root, Claude Code adds ``/v1/messages``) with a throwaway
``ANTHROPIC_API_KEY`` (sent as ``x-api-key``), telemetry and non-essential traffic off, and a
temporary ``HOME`` (the real home is never read or written), non-interactively (print mode,
``--output-format json``, the ``Bash`` tool allowed: Claude Code refuses
``--dangerously-skip-permissions`` to root), and returns what it printed.

It is a coroutine so that the servers it talks to can run on the caller's event loop.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.clients.codex import find_launcher, home_env, run_bounded

CLAUDE_VERSION = "2.1.332"
"""The version ``.ci/install/claude.sh`` pins."""
MODEL = "claude-sonnet-4-6"
THROWAWAY_KEY = "sk-test"


def find_claude() -> Path | None:
    """The ``claude`` launcher (:func:`~tests.clients.codex.find_launcher`)."""
    return find_launcher("claude")


@dataclass(frozen=True)
class ClaudeRun:
    """What one ``claude -p`` did."""

    argv: list[str]
    returncode: int | None
    """``None`` when it was killed at the timeout."""
    stdout: str
    stderr: str
    seconds: float

    @property
    def result(self) -> dict[str, Any]:
        """The ``--output-format json`` result (``session_id``, ``usage``, ``result``...); ``{}`` if none."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    value = json.loads(line)
                    if isinstance(value, dict):
                        return value
        return {}

    def summary(self) -> str:
        return (
            f"claude exit={self.returncode} in {self.seconds:.1f}s\n"
            f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-3000:]}"
        )


def claude_env(home: Path, base_url: str) -> dict[str, str]:
    """A minimal environment: nothing of the caller's keys, config or home leaks in."""
    return {
        **home_env(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": THROWAWAY_KEY,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


async def run_claude(
    base_url: str,
    prompt: str,
    *,
    home: Path,
    workdir: Path,
    extra_args: tuple[str, ...] = (),
    timeout: float = 90,  # noqa: ASYNC109 - bounds a subprocess, which is killed at the deadline
) -> ClaudeRun:
    """Run ``claude -p PROMPT`` against ``base_url`` in ``workdir`` with ``home`` as its HOME (keep it
    for ``--continue`` / ``--resume``: the sessions live there). ``extra_args`` go before the prompt."""
    binary = find_claude()
    if binary is None:
        raise FileNotFoundError("@anthropic-ai/claude-code not installed: run .ci/install/claude.sh")
    for path in (home, home / "tmp", workdir):
        path.mkdir(parents=True, exist_ok=True)
    argv = [
        str(binary), "-p", "--model", MODEL, "--output-format", "json", "--allowedTools", "Bash",
        *extra_args, "--", prompt,
    ]
    started = time.monotonic()
    returncode, out, err = await run_bounded(argv, cwd=workdir, env=claude_env(home, base_url), timeout=timeout)
    return ClaudeRun(
        argv=argv,
        returncode=returncode,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        seconds=time.monotonic() - started,
    )
