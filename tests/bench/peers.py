"""Peers for ``--peers``: LiteLLM's proxy as an OpenAI-compatible pass-through to the reference upstream.

LiteLLM is installed into its own virtualenv (``var/bench-peers/litellm-venv``, created
with ``python -m venv`` and ``pip install 'litellm[proxy]'`` on first use, reused after),
so its many dependencies never touch kvwarm's environment. Its config maps the model
name the benchmark sends (``kvwarm-sim``) to ``openai/kvwarm-sim`` at the reference
upstream's URL, with telemetry, spend logs and the database off (no ``DATABASE_URL``,
a random master key, which the client sends). It is served by its own CLI (uvicorn, one worker).
"""

from __future__ import annotations

import functools
import json
import secrets
import subprocess
import sys
from pathlib import Path

from tests.bench.servers import HOST, REPO, Server, Servers

PEERS_DIR = REPO / "var" / "bench-peers"
LITELLM_VENV = PEERS_DIR / "litellm-venv"
LITELLM_REQUIREMENT = "litellm[proxy]"
INSTALL_TIMEOUT = 1200.0
MODEL = "kvwarm-sim"


class PeerUnavailable(RuntimeError):
    """A peer could not be installed or started here; the message says why."""


@functools.cache
def master_key() -> str:
    """LiteLLM refuses to start without a strong master key; one per benchmark run."""
    return "sk-" + secrets.token_hex(32)


def _litellm_bin() -> Path:
    return LITELLM_VENV / "bin" / "litellm"


def litellm_version() -> str:
    try:
        out = subprocess.run(
            [str(LITELLM_VENV / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True, text=True, timeout=120, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip() or "?"


def ensure_litellm() -> Path:
    """The ``litellm`` CLI of the peers' virtualenv, installing it on first use."""
    binary = _litellm_bin()
    if binary.exists():
        return binary
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    log = PEERS_DIR / "litellm-install.log"
    print(f"[bench] installing {LITELLM_REQUIREMENT} into {LITELLM_VENV} (once; log: {log})", file=sys.stderr)
    python = LITELLM_VENV / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", str(LITELLM_VENV)],
        [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [str(python), "-m", "pip", "install", "--quiet", LITELLM_REQUIREMENT],
    ]
    with log.open("w") as out:
        for step in steps:
            try:
                subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT, check=True)
            except (OSError, subprocess.SubprocessError) as exc:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                raise PeerUnavailable(f"`{' '.join(step[-3:])}` failed ({exc}): {' / '.join(tail)}") from exc
    if not binary.exists():
        raise PeerUnavailable(f"{LITELLM_REQUIREMENT} installed no `litellm` command")
    return binary


def start_litellm(group: Servers, upstream_base_url: str) -> Server:
    """LiteLLM's proxy in front of ``upstream_base_url`` (raises :class:`PeerUnavailable`)."""
    binary = ensure_litellm()
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {"model": f"openai/{MODEL}", "api_base": upstream_base_url, "api_key": "sk-bench"},
            }
        ],
        "litellm_settings": {"telemetry": False, "set_verbose": False, "drop_params": False},
        "general_settings": {
            "disable_spend_logs": True,
            "disable_error_logs": True,
            "store_model_in_db": False,
        },
    }
    path = group.log_dir / "litellm-config.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    env = {
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "LITELLM_MASTER_KEY": master_key(),
        "DISABLE_ADMIN_UI": "True",
        "NO_DOCS": "True",
    }
    try:
        return group.start(
            "litellm",
            [str(binary), "--config", str(path), "--host", HOST, "--port", "{port}", "--num_workers", "1"],
            "/health/liveliness",
            env=env,
            unset=("DATABASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL"),
            timeout=180.0,
        )
    except RuntimeError as exc:
        raise PeerUnavailable(f"litellm did not start: {str(exc).splitlines()[0]}") from exc
