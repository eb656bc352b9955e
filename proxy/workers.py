"""``kvwarm serve --workers N``: a supervisor and N worker processes serving one port (Linux).

**Sockets.** The supervisor binds N listening sockets to ``server.host:server.port``, one per
worker slot, all with ``SO_REUSEPORT``, and hands each worker its slot's socket (an inherited
descriptor). Why this way rather than one shared socket, or workers binding their own:

* the kernel spreads new connections over the N sockets by a hash of their addresses, so the
  workers share the load whatever their timing; on one shared socket whichever worker wakes
  first takes a whole burst of connections (asyncio and uvloop accept in a loop), and
  keep-alive clients (agents) stay where they landed;
* binding happens once, in the supervisor: a port in use is one clear error at start, port 0
  works, and a restarted worker never binds again (no other process can take the port
  meanwhile);
* a socket outlives its worker: connections the kernel queued on a worker that died wait
  there for its replacement, instead of being reset as they are when a worker that bound its
  own ``SO_REUSEPORT`` socket exits (Linux moves them only with ``tcp_migrate_req``);
* a probe bind without ``SO_REUSEPORT`` first checks that nothing listens on the port yet:
  otherwise a second ``kvwarm serve --workers`` (or any ``SO_REUSEPORT`` server of the same
  user) would silently share its connections with this one.

The cost: while a worker is down, the connections the kernel hashes to its socket wait for
the restart (:data:`BACKOFF` bounds how long).

**Workers.** Each is ``python -m proxy serve`` started afresh (no ``fork``: nothing of the
supervisor's state, threads or event loop is inherited), in its own process group (a
terminal's Ctrl-C reaches the supervisor only, which stops the workers once). It reads its
orders from stdin (:class:`WorkerOrders`): the supervisor's validated settings (every worker
and every restart serves the same settings, and secrets stay off command lines), its socket
descriptors, a pipe on which it says it is ready, the supervisor's pid. The supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` to a private temporary directory in the workers' environment, so
prometheus-client (which reads it once, when first imported) keeps each worker's metric values
in files there and ``/metrics`` from any worker adds them up (:mod:`proxy.metrics`). A worker
whose supervisor disappears stops gracefully by itself.

**Supervision.** A worker that exits is restarted after a backoff (:data:`BACKOFF`, doubling;
it starts over once a worker ran :data:`STABLE_SECONDS`), with a log line; its live gauges are
dropped from the metrics files (``mark_process_dead``), its counters stay counted. When workers
keep dying before they are ready (:data:`MAX_START_FAILURES` in a row, no worker becoming ready
in between), the supervisor stops: exit status 2 when the last one failed on its configuration,
else 1. On SIGTERM or SIGINT each worker gets one SIGTERM and ``server.shutdown_timeout``
seconds to finish its requests (plus :data:`SHUTDOWN_MARGIN` to close its store); a straggler
is killed, and so is every worker at a second signal. Exit status 0 when all stopped cleanly.
The metrics directory is removed at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from .config import Settings
from .errors import ConfigError, KvwarmError
from .guard import FD_RESERVE, ConnectionCap, GuardedSite, ensure_fd_limit, runner_options

__all__ = [
    "BACKOFF",
    "MAX_START_FAILURES",
    "InheritedSite",
    "Supervisor",
    "WorkerOrders",
    "listen_sockets",
    "serve_worker",
]

log = logging.getLogger(__name__)

BACKOFF = (0.25, 10.0)
"""Seconds before restarting a worker: the first pause, doubling per failure up to the second."""
STABLE_SECONDS = 30.0
"""A worker that ran this long resets its slot's backoff."""
MAX_START_FAILURES = 5
"""Workers dying before they are ready, in a row, after which the supervisor gives up."""
START_TIMEOUT = 60.0
"""Seconds a worker may take to become ready; then it is killed (a failure at start)."""
SHUTDOWN_MARGIN = 10.0
"""Seconds beyond ``server.shutdown_timeout`` a stopping worker gets to close its store."""
PARENT_CHECK = 1.0
"""Seconds between a worker's checks that its supervisor is still there (without pidfd)."""
BACKLOG = 128
EXIT_CONFIG = 2
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


# -- sockets ---------------------------------------------------------------------------------------


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, Any]]:
    """The addresses ``host`` resolves to for listening, without duplicates (as asyncio binds them)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[tuple[socket.AddressFamily, Any]] = []
    for family, _, _, _, address in infos:
        if (family, address) not in out and family in (socket.AF_INET, socket.AF_INET6):
            out.append((family, address))
    return out


def _listener(family: socket.AddressFamily, address: Any, *, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_sockets(host: str, port: int, slots: int, backlog: int = BACKLOG) -> list[list[socket.socket]]:
    """``slots`` groups of listening sockets on ``host:port`` (one per address ``host`` resolves
    to), every socket with ``SO_REUSEPORT``. Port 0: one free port, the same for all.

    Raises :class:`OSError` when something listens there already, ``SO_REUSEPORT`` or not.
    """
    if not hasattr(socket, "SO_REUSEPORT") or not sys.platform.startswith("linux"):
        raise ConfigError("server.workers", "several workers need Linux (SO_REUSEPORT spreads connections over them)")
    addresses = _addresses(host, port)
    if not addresses:
        raise OSError(f"{host!r} resolves to no IPv4 or IPv6 address")
    groups: list[list[socket.socket]] = [[] for _ in range(slots)]
    try:
        for family, address in addresses:
            # The probe: a socket without SO_REUSEPORT cannot bind where anything listens. Port 0:
            # it picks the port every later socket binds.
            probe = _listener(family, (address[0], port, *address[2:]), reuse_port=False)
            try:
                port = port or int(probe.getsockname()[1])
            finally:
                probe.close()
            bound = (address[0], port, *address[2:])
            for group in groups:
                sock = _listener(family, bound, reuse_port=True)
                group.append(sock)
                sock.listen(backlog)
                sock.set_inheritable(False)
    except BaseException:
        for group in groups:
            for sock in group:
                sock.close()
        raise
    return groups


class InheritedSite(GuardedSite):
    """A :class:`~proxy.guard.GuardedSite` (the connection cap) on sockets the supervisor bound,
    instead of binding ``host:port`` itself; one cap over all of them."""

    def __init__(self, runner: web.BaseRunner, sockets: Sequence[socket.socket], *, max_connections: int) -> None:
        host, port = sockets[0].getsockname()[:2]
        super().__init__(runner, host, port, max_connections=max_connections, backlog=BACKLOG)
        self._sockets = list(sockets)
        self._more: list[asyncio.AbstractServer] = []

    async def start(self) -> None:
        # GuardedSite.start would bind host:port: register with the runner as it does, then serve
        # the inherited sockets through the same cap.
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self.cap = ConnectionCap(server, self._max_connections)
        loop = asyncio.get_running_loop()
        servers: list[asyncio.AbstractServer] = [await loop.create_server(self.cap, sock=s, backlog=self._backlog) for s in self._sockets]
        self._server, self._more = servers[0], servers[1:]

    async def stop(self) -> None:
        for extra in self._more:
            extra.close()
        await super().stop()


# -- the worker ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerOrders:
    """What the supervisor tells a worker, on its stdin (JSON)."""

    settings: Settings
    sockets: tuple[int, ...]
    """Descriptors of the listening sockets (inherited)."""
    ready: int
    """Write end of a pipe: one byte once the worker listens, then closed."""
    parent: int
    """The supervisor's pid: when the worker's parent is another, the supervisor is gone."""
    slot: int

    def encode(self) -> bytes:
        flat: dict[str, Any] = {}
        for section, values in asdict(self.settings).items():
            for key, value in values.items():
                flat[f"{section}.{key}"] = value
        return orjson.dumps(
            {"settings": flat, "sockets": list(self.sockets), "ready": self.ready, "parent": self.parent, "slot": self.slot}
        )

    @classmethod
    def decode(cls, data: bytes) -> WorkerOrders:
        try:
            raw = orjson.loads(data)
            return cls(
                settings=Settings().with_overrides(raw["settings"]),
                sockets=tuple(int(fd) for fd in raw["sockets"]),
                ready=int(raw["ready"]),
                parent=int(raw["parent"]),
                slot=int(raw["slot"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise KvwarmError(f"a worker's orders (stdin) are unreadable: {exc}") from None


async def serve_worker(app: web.Application, orders: WorkerOrders) -> None:
    """Serve ``app`` on the inherited sockets until cancelled (SIGTERM: ``GracefulExit``) or
    until the supervisor is gone; then stop as ``kvwarm serve`` does (in-flight requests get
    ``server.shutdown_timeout``)."""
    settings = orders.settings
    ensure_fd_limit(settings.server.max_connections + settings.upstream.max_connections + FD_RESERVE)
    sockets = [socket.socket(fileno=fd) for fd in orders.sockets]
    runner = web.AppRunner(app, handle_signals=True, **runner_options(settings.server))
    await runner.setup()
    try:
        site = InheritedSite(runner, sockets, max_connections=settings.server.max_connections)
        await site.start()
        with contextlib.suppress(OSError):  # a supervisor that stopped waiting: the parent check sees it
            os.write(orders.ready, b"r")
        os.close(orders.ready)
        await _gone(orders.parent)
        log.warning("the supervisor (pid %d) is gone: worker %d stops", orders.parent, os.getpid())
    finally:
        await runner.cleanup()
        for sock in sockets:
            sock.close()


async def _gone(parent: int) -> None:
    """Return once ``parent`` (this process's parent) has exited."""
    if os.getppid() != parent:
        return
    try:
        fd = os.pidfd_open(parent)  # readable when the process exits (Linux 5.3+)
    except OSError:
        while os.getppid() == parent:  # noqa: ASYNC110 - nothing to wait on but the clock
            await asyncio.sleep(PARENT_CHECK)
        return
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(fd, exited.set)
    try:
        if os.getppid() == parent:
            await exited.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


# -- the supervisor --------------------------------------------------------------------------------


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class Supervisor:
    """Runs ``settings.server.workers`` workers on one port until SIGTERM / SIGINT (see the module
    docstring). ``command`` starts one worker (default: this interpreter, ``-m proxy serve --worker``)."""

    def __init__(self, settings: Settings, command: Sequence[str] | None = None) -> None:
        self.settings = settings
        self.count = settings.server.workers
        self.command = list(command) if command is not None else [sys.executable, "-m", "proxy", "serve", "--worker"]
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        """Slot -> its running worker."""
        self._stop = asyncio.Event()
        self._signals = 0
        self._start_failures = 0
        self._gave_up: int | None = None
        self._unclean = False
        self._sockets: list[list[socket.socket]] = []
        self._metrics_dir = ""
        self._env: dict[str, str] = {}

    def run(self) -> int:
        """Bind, start the workers, supervise until stopped; the exit status."""
        server = self.settings.server
        try:
            self._sockets = listen_sockets(server.host, server.port, self.count)
        except OSError as exc:
            raise KvwarmError(f"cannot listen on {server.host}:{server.port}: {exc.strerror or exc}") from None
        self._metrics_dir = tempfile.mkdtemp(prefix="kvwarm-metrics-")
        package_root = str(Path(__file__).resolve().parent.parent)
        path = os.environ.get("PYTHONPATH", "")
        self._env = {
            **os.environ,
            METRICS_DIR_ENV: self._metrics_dir,
            "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
        }
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(self._main())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            for group in self._sockets:
                for sock in group:
                    sock.close()
            shutil.rmtree(self._metrics_dir, ignore_errors=True)

    @property
    def port(self) -> int:
        return int(self._sockets[0][0].getsockname()[1])

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        server = self.settings.server
        log.info(
            "kvwarm listening on http://%s:%d/v1 -> %s with %d workers",
            server.host, self.port, ", ".join(self.settings.upstream.base_url), self.count,
        )
        slots = [asyncio.create_task(self._keep(slot), name=f"kvwarm-worker-{slot}") for slot in range(self.count)]
        try:
            await self._stop.wait()
            for proc in list(self.procs.values()):
                self._send(proc, signal.SIGTERM)
            _, late = await asyncio.wait(slots, timeout=server.shutdown_timeout + SHUTDOWN_MARGIN)
            if late:
                for slot, proc in list(self.procs.items()):
                    log.error("worker %d (slot %d) did not stop in time: killed", proc.pid, slot)
                    self._send(proc, signal.SIGKILL)
                self._unclean = True
                await asyncio.wait(slots, timeout=SHUTDOWN_MARGIN)
        finally:
            for task in slots:
                task.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        if self._gave_up is not None:
            return self._gave_up
        log.info("kvwarm stopped (%d workers)", self.count)
        return 1 if self._unclean else 0

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s: stopping %d workers (in-flight requests get %gs)", sig.name, len(self.procs), self.settings.server.shutdown_timeout)
            self._stop.set()
        else:
            log.warning("%s again: killing the workers", sig.name)
            self._unclean = True
            for proc in list(self.procs.values()):
                self._send(proc, signal.SIGKILL)

    @staticmethod
    def _send(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _keep(self, slot: int) -> None:
        """Keep one worker running in ``slot`` until the supervisor stops."""
        crashes = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                proc, ready = await self._spawn(slot)
            except OSError as exc:
                log.error("cannot start a worker (slot %d): %s", slot, exc)
                self._give_up(1)
                return
            code = await proc.wait()
            self.procs.pop(slot, None)
            self._forget(proc.pid)
            if self._stop.is_set():
                if code not in (0, -signal.SIGTERM):
                    log.warning("worker %d (slot %d) stopped with %s", proc.pid, slot, _describe(code))
                    self._unclean = True
                return
            lived = time.monotonic() - started
            if not ready:
                self._start_failures += 1
                log.error(
                    "worker %d (slot %d) exited with %s before it was ready (%d in a row)",
                    proc.pid, slot, _describe(code), self._start_failures,
                )
                if self._start_failures >= MAX_START_FAILURES:
                    log.error("workers keep dying at start: kvwarm stops (see the errors above)")
                    self._give_up(EXIT_CONFIG if code == EXIT_CONFIG else 1)
                    return
            crashes = 0 if lived >= STABLE_SECONDS else crashes + 1
            delay = min(BACKOFF[1], BACKOFF[0] * 2 ** max(0, crashes - 1))
            if ready:
                log.warning("worker %d (slot %d) died with %s after %.0fs: restarting in %.2gs", proc.pid, slot, _describe(code), lived, delay)
            await self._pause(delay)

    def _give_up(self, status: int) -> None:
        if self._gave_up is None:
            self._gave_up = status
        self._stop.set()

    async def _spawn(self, slot: int) -> tuple[asyncio.subprocess.Process, bool]:
        """Start a worker in ``slot``; once it is running, wait until it is ready or gone. Returns
        the process and whether it became ready."""
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe()
        fds = tuple(s.fileno() for s in self._sockets[slot])
        orders = WorkerOrders(self.settings, fds, write_end, os.getpid(), slot)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(*fds, write_end),
                env=self._env,
                process_group=0,
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self.procs[slot] = proc
        if self._stop.is_set():
            self._send(proc, signal.SIGTERM)
        assert proc.stdin is not None
        with contextlib.suppress(ConnectionError):
            proc.stdin.write(orders.encode())
            await proc.stdin.drain()
        proc.stdin.close()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_end, "rb", buffering=0)
        )
        try:
            said = await asyncio.wait_for(reader.read(1), START_TIMEOUT)
        except TimeoutError:
            log.error("worker %d (slot %d) not ready after %gs: killed", proc.pid, slot, START_TIMEOUT)
            self._send(proc, signal.SIGKILL)
            said = b""
        finally:
            transport.close()
        if said:
            self._start_failures = 0
            log.info("worker %d of %d ready (slot %d)", proc.pid, self.count, slot)
        return proc, bool(said)

    def _forget(self, pid: int) -> None:
        """Drop a gone worker's live gauges from the metrics files (its counters stay counted)."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self._metrics_dir)  # type: ignore[no-untyped-call]
