"""Real ``redis-server`` processes for the Redis store's tests and benchmark: a standalone
server and a 3-master Redis Cluster, each on free loopback ports in a temporary directory.

Nothing here talks to a Redis it did not start; every process is stopped by its owner.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

HOST = "127.0.0.1"
INSTALL_HINT = "redis-server not installed: run .ci/install/redis.sh"


def binaries_missing() -> str | None:
    """Why the Redis tests cannot run here, or None."""
    for name in ("redis-server", "redis-cli"):
        if shutil.which(name) is None:
            return INSTALL_HINT
    return None


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, bus: bool = False) -> int:
    """A free loopback port; with ``bus``, ``port + 10000`` is free too (a cluster node's bus)."""
    if not bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port: int = s.getsockname()[1]
            return port
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _ping(port: int, timeout: float = 0.2) -> str:
    """The first line of Redis' answer to PING on ``port`` (empty when it does not answer)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).decode(errors="replace").strip()
    except OSError:
        return ""


class RedisServer:
    """One ``redis-server`` on a fixed port (so it can be killed and started again there)."""

    def __init__(self, directory: Path, port: int | None = None, extra: Sequence[str] = ()) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / f"redis-{self.port}.log", "ab")
        args = [
            "redis-server",
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.proc.returncode}: see {self.directory}")
            if _ping(self.port) == "+PONG":
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-session, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-h", HOST, "-p", str(self.port), *args],
            capture_output=True,
            timeout=10,
            check=True,
        )
        return out.stdout.decode(errors="replace").strip()


class RedisClusterProcesses:
    """Three ``redis-server --cluster-enabled yes`` masters joined by ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                directory / f"node{i}",
                free_port(bus=True),
                ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"],
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{HOST}:{n.port}" for n in self.nodes[:2])

    def start(self, timeout: float = 20.0) -> RedisClusterProcesses:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes), "--cluster-yes"],
                capture_output=True,
                timeout=timeout,
                check=True,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                states = [n.cli("cluster", "info") for n in self.nodes]
                if all("cluster_state:ok" in s for s in states):
                    return self
                time.sleep(0.05)
            raise RuntimeError("the cluster did not reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def redis_server(directory: Path, extra: Sequence[str] = ()) -> Iterator[RedisServer]:
    server = RedisServer(directory, extra=extra).start()
    try:
        yield server
    finally:
        server.stop()


def _selftest() -> None:  # pragma: no cover - manual check: python -m tests.store.redis_server
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as server:
        print(server.url, server.cli("ping"), os.getpid())


if __name__ == "__main__":  # pragma: no cover
    _selftest()
