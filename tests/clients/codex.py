"""The real Codex CLI (npm ``@openai/codex``) as a test client: find it, run one ``codex exec``.

The CLI is installed by ``.ci/install/codex.sh`` into ``$KVWARM_CLIENTS_DIR``
(default ``~/.cache/kvwarm-clients``). :func:`run_codex` points it at a
``base_url`` through a custom model provider on the Responses wire API, with a
throwaway API key and a temporary ``HOME``/``CODEX_HOME`` (the real home is
never read or written), non-interactively (approval policy ``never``, the
``workspace-write`` sandbox rooted in ``workdir``), and returns what it printed.

It is a coroutine so that the servers it talks to can run on the caller's
event loop (a blocking ``subprocess.run`` would starve them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CODEX_VERSION = "0.169.0"
"""The version ``.ci/install/codex.sh`` pins."""

DEFAULT_MODEL = "kvwarm-sim"
"""A model Codex has no metadata for: it then offers classic function tools (``exec_command``) in
``tools`` and answers a ``function_call`` with a ``function_call_output``. Pass ``model=None`` for
Codex's own default model, which runs in "code mode": its tools travel in an ``additional_tools``
input item and commands go through a freeform ``exec`` tool (``custom_tool_call``)."""

THROWAWAY_KEY = "sk-kvwarm-test-codex"
PROVIDER = "kvwarm"


def clients_dir() -> Path:
    """Where ``.ci/install/codex.sh`` installs the npm clients."""
    configured = os.environ.get("KVWARM_CLIENTS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "kvwarm-clients"


def find_launcher(name: str) -> Path | None:
    """The npm client launcher ``name``: the cache directory's first, then ``PATH``'s; ``None`` when absent."""
    cached = clients_dir() / "node_modules" / ".bin" / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    found = shutil.which(name)
    return Path(found) if found else None


def find_codex() -> Path | None:
    """The ``codex`` launcher (:func:`find_launcher`)."""
    return find_launcher("codex")


def home_env(home: Path) -> dict[str, str]:
    """The part of a client's minimal environment that every client shares: ``PATH``, ``home`` as
    its HOME and XDG directories, a C.UTF-8 locale, no colour; nothing of the caller's keys,
    config or home leaks in."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "TMPDIR": str(home / "tmp"),
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        "TERM": "dumb",
    }


async def run_bounded(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float,  # noqa: ASYNC109 - bounds a subprocess, which is killed at the deadline
) -> tuple[int | None, bytes, bytes]:
    """Run ``argv`` to its end or to ``timeout``: its exit code (``None`` when it was killed at the
    timeout), stdout and stderr. It runs in its own process group, so that a timeout kills the
    launcher and whatever it started; it never outlives this call."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=str(cwd),
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    returncode: int | None
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
        returncode = process.returncode
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        out, err = await process.communicate()
        returncode = None
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    return returncode, out, err


@dataclass(frozen=True)
class CodexRun:
    """What one ``codex exec`` did."""

    argv: list[str]
    returncode: int | None
    """``None`` when it was killed at the timeout."""
    stdout: str
    stderr: str
    last_message: str | None
    """The agent's final message (``--output-last-message``), ``None`` when it wrote none."""
    seconds: float
    events: list[dict[str, Any]] = field(default_factory=list)
    """``--json``: the JSONL events printed on stdout."""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def items(self, kind: str) -> list[dict[str, Any]]:
        """The ``item.completed`` events' items of type ``kind`` (e.g. ``command_execution``)."""
        return [
            e["item"] for e in self.events
            if e.get("type") == "item.completed" and isinstance(e.get("item"), dict) and e["item"].get("type") == kind
        ]

    def summary(self) -> str:
        """For assertion messages: the exit code and the tails of both streams."""
        return (
            f"codex exit={self.returncode} in {self.seconds:.1f}s\n"
            f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-3000:]}"
        )


def provider_flags(base_url: str) -> list[str]:
    """``-c`` overrides selecting a Responses-API provider at ``base_url`` keyed by ``OPENAI_API_KEY``."""
    provider = (
        f'{{name="{PROVIDER}", base_url="{base_url}", env_key="OPENAI_API_KEY", '
        'wire_api="responses", request_max_retries=0, stream_max_retries=0}'
    )
    return ["-c", f"model_provider={PROVIDER}", "-c", f"model_providers.{PROVIDER}={provider}"]


def codex_env(home: Path, codex_home: Path) -> dict[str, str]:
    """A minimal environment: nothing of the caller's keys, config or home leaks in."""
    return {
        **home_env(home),
        "CODEX_HOME": str(codex_home),
        "OPENAI_API_KEY": THROWAWAY_KEY,
        "RUST_LOG": os.environ.get("KVWARM_CODEX_RUST_LOG", "error"),
    }


async def run_codex(
    base_url: str,
    prompt: str,
    *,
    workdir: Path,
    timeout: float = 120,  # noqa: ASYNC109 - bounds a subprocess, which is killed at the deadline
    model: str | None = DEFAULT_MODEL,
    extra_args: tuple[str, ...] = (),
) -> CodexRun:
    """Run ``codex exec PROMPT`` against ``base_url`` (ending in ``/v1``) in ``workdir``.

    ``model``: see :data:`DEFAULT_MODEL` (``None``: Codex's own default);
    ``extra_args`` go before the prompt (more ``-c`` overrides, say).
    """
    binary = find_codex()
    if binary is None:
        raise FileNotFoundError("@openai/codex not installed: run .ci/install/codex.sh")
    with tempfile.TemporaryDirectory(prefix="kvwarm-codex-") as tmp:
        home, codex_home, last_message_file = _layout(Path(tmp), workdir)
        argv = [
            str(binary), "exec",
            "--skip-git-repo-check", "--ephemeral", "--json", "--color", "never",
            "-s", "workspace-write",
            "-C", str(workdir),
            "-o", str(last_message_file),
            *provider_flags(base_url),
            "-c", 'approval_policy="never"',
            "-c", "check_for_update_on_startup=false",
            "-c", "analytics.enabled=false",
            "-c", "feedback.enabled=false",
        ]
        if model is not None:
            argv += ["-m", model]
        argv += [*extra_args, prompt]
        started = time.monotonic()
        returncode, out, err = await run_bounded(argv, cwd=workdir, env=codex_env(home, codex_home), timeout=timeout)
        stdout = out.decode("utf-8", "replace")
        last = _read_if_present(last_message_file)
        return CodexRun(
            argv=argv,
            returncode=returncode,
            stdout=stdout,
            stderr=err.decode("utf-8", "replace"),
            last_message=last,
            seconds=time.monotonic() - started,
            events=_jsonl(stdout),
        )


def _layout(tmp: Path, workdir: Path) -> tuple[Path, Path, Path]:
    """Create ``workdir`` and a private HOME and CODEX_HOME under ``tmp``; the last-message file's path."""
    workdir.mkdir(parents=True, exist_ok=True)
    home, codex_home = tmp / "home", tmp / "codex-home"
    for path in (home, home / "tmp", codex_home):
        path.mkdir(parents=True)
    return home, codex_home, tmp / "last-message.txt"


def _read_if_present(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _jsonl(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    events.append(value)
    return events
