"""Two versions of kvwarm side by side: each commit extracted from git and compiled in a tree of its own.

Used by the benchmarks that compare a base commit with the head in one run
(:mod:`tests.bench.versus`, :mod:`tests.bench.instructions`): a version runs as its own process,
importing from its tree, so the two never share a module (their layouts may differ). Always a
commit, never the working tree, whose edits in progress would make the figures move.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.bench.proxy_latency import BenchError
from tests.bench.servers import HOST, REPO, Server


@dataclass(frozen=True, kw_only=True)
class Version:
    name: str
    """What the benchmark calls it (``base``, ``head``...)."""
    commit: str
    subject: str
    tree: Path
    compiled: int
    """Extension modules its build left beside their sources (the shared library not counted)."""

    @property
    def label(self) -> str:
        return f"`{self.commit[:7]}` ({self.subject[:60]})"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def tree_env(tree: Path) -> dict[str, str]:
    """A process of ``tree``: imports from it, compiled modules allowed, no settings but the
    built-in defaults and those a benchmark gives (none of the caller's ``KVWARM_*`` or proxies)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWARM_") and not k.lower().endswith("_proxy")}
    return {**env, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "KVWARM_LOG_LEVEL": "WARNING"}


def prepare(name: str, commit: str, root: Path, log: Callable[[str], None]) -> Version:
    """``commit`` extracted under ``root`` (once: a tree already there is reused) and compiled in
    place (``python -m proxy.build --if-stale``, as ``make compile`` does there)."""
    sha = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    tree = root / sha
    marker = tree / ".extracted"
    if not marker.exists():
        log(f"extracting {name} {sha[:7]} into {tree}")
        archive = subprocess.run(["git", "archive", sha], cwd=REPO, check=True, capture_output=True).stdout
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        marker.touch()
    log(f"compiling {name} {sha[:7]} (python -m proxy.build --if-stale)")
    built = subprocess.run(
        [sys.executable, "-m", "proxy.build", "--if-stale"], cwd=tree, env=tree_env(tree), capture_output=True, text=True
    )
    if built.returncode != 0:
        raise BenchError(f"compiling {name} failed:\n{built.stdout[-2000:]}{built.stderr[-2000:]}")
    compiled = [p for p in (tree / "proxy").rglob("*.so") if not p.name.startswith("_native__mypyc")]
    return Version(
        name=name, commit=sha, subject=git("log", "-1", "--format=%s", sha), tree=tree, compiled=len(compiled)
    )


def native_label(server: Server) -> str:
    """``compiled`` or ``pure``, as the server's ``kvwarm_build_info`` says (``unknown`` without it)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{server.port}/metrics", timeout=60) as resp:
            text = resp.read().decode()
    except OSError:
        return "unknown"
    found = re.search(r'kvwarm_build_info\{[^}]*native="(\w+)"', text)
    return found[1] if found else "unknown"
