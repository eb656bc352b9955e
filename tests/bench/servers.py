"""Starting and stopping the benchmark's server processes (loopback only).

Each server is its own process with its own log file; it is ready when an HTTP probe
answers 200. Processes are stopped by their own pid (terminate, then kill), in reverse
order of start, whatever happens in the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


class ServerFailed(RuntimeError):
    """A server process exited or never became ready."""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:P/v1``."""
        return f"http://{HOST}:{self.port}/v1"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _probe(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop(server: Server) -> None:
    proc = server.proc
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class Servers(contextlib.AbstractContextManager["Servers"]):
    """The servers of one benchmark; all stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Server] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        ready_path: str,
        *,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        unset: Sequence[str] = (),
        timeout: float = 60.0,
        tree: Path = REPO,
    ) -> Server:
        """Run ``argv`` (``{port}`` substituted) and wait until ``GET ready_path`` answers 200.

        The process inherits this environment plus ``env``, minus the variables in ``unset``. It
        runs in ``tree`` and imports from it first: this checkout, or another version's source
        tree (e.g. ``git archive COMMIT`` extracted, as :mod:`tests.bench.versus` does)."""
        port = port or free_port()
        log = self.log_dir / f"{name}.log"
        full_env = {**os.environ, "PYTHONPATH": str(tree), **(env or {})}
        for var in unset:
            full_env.pop(var, None)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [a.format(port=port) for a in argv],
                cwd=tree, env=full_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        server = Server(name, proc, port, log)
        self.started.append(server)
        deadline = time.monotonic() + timeout
        url = f"http://{HOST}:{port}{ready_path}"
        while not _probe(url):
            if proc.poll() is not None:
                raise ServerFailed(f"{name} exited with status {proc.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"{name} not ready after {timeout:.0f} s:\n{server.log_tail()}")
            time.sleep(0.1)
        return server

    def __exit__(self, *exc: object) -> None:
        for server in reversed(self.started):
            stop(server)
        self.started.clear()


def python_module(module: str, *args: str) -> list[str]:
    """``[sys.executable, "-m", module, *args]``."""
    return [sys.executable, "-m", module, *args]


@contextlib.contextmanager
def servers(log_dir: Path) -> Iterator[Servers]:
    with Servers(log_dir) as group:
        yield group
