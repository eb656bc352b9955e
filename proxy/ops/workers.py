"""``kvwarm serve --workers N``: a supervisor and N worker processes serving one port (Linux).

**Sockets.** Every worker serves its own listening socket on ``server.host:server.port``, all
with ``SO_REUSEPORT``: the kernel spreads new connections over the sockets that listen, by a
hash of their addresses, so the workers share the load whatever their timing (on one shared
socket whichever worker wakes first takes a whole burst of connections, as asyncio and uvloop
accept in a loop, and keep-alive clients such as agents stay where they landed). The
supervisor binds a fresh socket for each worker it starts and hands it over (an inherited
descriptor) without listening on it, keeping no copy; the worker listens only once its app is
ready. So a socket accepts connections exactly while a ready worker serves it:

* a worker that cannot start (its store unreachable, a file it needs missing) never listens,
  and its share of the connections goes to the workers that do;
* a worker that dies or stops takes its socket with it: new connections go to the others at
  once, instead of queueing on a socket nobody accepts from. The few connections the kernel
  had queued on it but the worker had not yet accepted are reset (with
  ``net.ipv4.tcp_migrate_req=1`` Linux moves them to another worker's socket instead);
* while no worker is ready, a connection is refused, never left hanging.

The supervisor binds, so workers never do: a probe bind without ``SO_REUSEPORT`` first checks
that nothing listens on the port yet (otherwise a second ``kvwarm serve --workers``, or any
``SO_REUSEPORT`` server of the same user, would silently share its connections with this
one), a port in use is one clear error at start, and port 0 picks one port for all. The
supervisor keeps one more bound socket per address that never listens: while no worker
listens, a program that binds the port plainly is refused (one that sets ``SO_REUSEADDR`` can
still listen there meanwhile; the workers then fail to listen, and are retried, until it
stops).

**Workers.** Each is a fresh interpreter (no ``fork``: nothing of the supervisor's state,
threads or event loop is inherited), in its own process group (a terminal's Ctrl-C reaches
the supervisor only, which stops the workers once). It runs the supervisor's own copy of
kvwarm, whatever the current directory holds: the interpreter starts with ``-P`` (nothing
from the current directory on ``sys.path``) and imports the ``proxy`` package from the file
the supervisor was loaded from (:data:`WORKER_BOOT`), installed, editable or a checkout alike;
the current directory stays the supervisor's, for relative paths in the settings. It reads
its orders from stdin (:class:`WorkerOrders`): the supervisor's validated settings (every
worker and every restart serves the same settings, and secrets stay off command lines), its
socket descriptors, a pipe on which it says it is ready, the supervisor's pid. The supervisor
sets ``PROMETHEUS_MULTIPROC_DIR`` to a private temporary directory in the workers'
environment, so prometheus-client (which reads it once, when first imported) keeps each
worker's metric values in files there and ``/metrics`` from any worker adds them up
(:mod:`proxy.metrics`). A worker whose supervisor disappears stops gracefully by itself.

**Supervision.** A worker that exits, or fails to start, is started again after a backoff
(:data:`BACKOFF`: doubling per failure of its slot up to a cap; it starts over once a worker
ran :data:`STABLE_SECONDS`), with a log line; its live gauges are dropped from the metrics
files (``mark_process_dead``), its counters stay counted. A slot keeps being retried for as
long as the supervisor runs, whatever the other slots do: the cause of a failure (Redis
down, a file being replaced) may go away, and the workers that do serve keep serving
meanwhile. The one exception: when no worker has become ready since the supervisor started
and :data:`MAX_START_FAILURES` starts failed in a row, the supervisor stops (exit status 2
when the last one failed on its configuration, else 1), since a service that has never
served is most likely misconfigured, and its operator (or systemd) should hear of it at once
rather than find a supervisor retrying quietly. On SIGTERM or SIGINT each worker gets one
SIGTERM and ``server.shutdown_timeout`` seconds to finish its requests (plus
:data:`SHUTDOWN_MARGIN` to close its store); a straggler is killed, and so is every worker at
a second signal. Exit status 0 when all stopped cleanly. The metrics directory is removed at
exit.
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

from ..config import Settings
from ..edge.defences import FD_RESERVE, ConnectionCap, CappedSite, ensure_fd_limit, runner_options
from ..errors import ConfigError, KvwarmError

__all__ = [
    "BACKOFF",
    "MAX_START_FAILURES",
    "WORKER_BOOT",
    "InheritedSite",
    "Supervisor",
    "WorkerOrders",
    "reserve_port",
    "serve_worker",
    "slot_sockets",
]

log = logging.getLogger(__name__)

BACKOFF = (0.25, 30.0)
"""Seconds before starting a slot's worker again: the first pause, doubling per failure of the
slot up to the second."""
STABLE_SECONDS = 30.0
"""A worker that ran this long resets its slot's backoff."""
MAX_START_FAILURES = 5
"""Starts failing in a row, no worker ever ready, after which the supervisor gives up."""
START_TIMEOUT = 60.0
"""Seconds a worker may take to become ready; then it is killed (a failure at start)."""
SHUTDOWN_MARGIN = 10.0
"""Seconds beyond ``server.shutdown_timeout`` a stopping worker gets to close its store."""
PARENT_CHECK = 1.0
"""Seconds between a worker's checks that its supervisor is still there (without pidfd)."""
BACKLOG = 128
EXIT_CONFIG = 2
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
PACKAGE_INIT = Path(__file__).resolve().parent.parent / "__init__.py"
"""The ``proxy`` package this supervisor runs: its workers import this very file."""
WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('proxy', sys.argv[1], submodule_search_locations=[])\n"
    "sys.modules['proxy'] = package = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(package)\n"
    "from proxy.cli import main\n"
    "sys.argv[:] = ['kvwarm', 'serve', '--worker']\n"
    "raise SystemExit(main())\n"
)
"""A worker's program (``python -P -c WORKER_BOOT <proxy/__init__.py>``): the ``proxy`` package
from the given file, whatever ``sys.path`` finds first under that name (a directory named
``proxy`` where kvwarm was started, a stale copy on ``PYTHONPATH``); its modules are then
found beside that file. ``-P`` keeps the current directory off ``sys.path`` for every other
import too."""

Address = tuple[socket.AddressFamily, Any]


# -- sockets ---------------------------------------------------------------------------------------


def _addresses(host: str, port: int) -> list[Address]:
    """The addresses ``host`` resolves to for listening, without duplicates (as asyncio binds them)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[Address] = []
    for family, _, _, _, address in infos:
        if (family, address) not in out and family in (socket.AF_INET, socket.AF_INET6):
            out.append((family, address))
    return out


def _bound(family: socket.AddressFamily, address: Any, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``address``, not listening, not inheritable."""
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


def reserve_port(host: str, port: int) -> list[Address]:
    """The addresses (one per address ``host`` resolves to) the workers' sockets bind, after a
    probe bind without ``SO_REUSEPORT`` on each: port 0 becomes one free port, the same for all.

    Raises :class:`OSError` when something listens there already, ``SO_REUSEPORT`` or not.
    """
    if not hasattr(socket, "SO_REUSEPORT") or not sys.platform.startswith("linux"):
        raise ConfigError("server.workers", "several workers need Linux (SO_REUSEPORT spreads connections over them)")
    addresses = _addresses(host, port)
    if not addresses:
        raise OSError(f"{host!r} resolves to no IPv4 or IPv6 address")
    out: list[Address] = []
    for family, address in addresses:
        # A socket without SO_REUSEPORT cannot bind where anything listens. Port 0: it picks
        # the port every later socket binds.
        with _bound(family, (address[0], port, *address[2:]), reuse_port=False) as probe:
            port = port or int(probe.getsockname()[1])
        out.append((family, (address[0], port, *address[2:])))
    return out


def slot_sockets(addresses: Sequence[Address]) -> list[socket.socket]:
    """One ``SO_REUSEPORT`` socket bound to each of ``addresses``, none listening: until a
    socket listens, the kernel sends it no connection."""
    out: list[socket.socket] = []
    try:
        for family, address in addresses:
            out.append(_bound(family, address, reuse_port=True))
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


class InheritedSite(CappedSite):
    """A :class:`~proxy.edge.defences.CappedSite` (the connection cap) on sockets the supervisor bound,
    instead of binding ``host:port`` itself; one cap over all of them. The sockets listen from
    :meth:`start` (``create_server`` calls ``listen``), once the app is ready, until :meth:`stop`
    closes them."""

    def __init__(self, runner: web.BaseRunner, sockets: Sequence[socket.socket], *, max_connections: int) -> None:
        host, port = sockets[0].getsockname()[:2]
        super().__init__(runner, host, port, max_connections=max_connections, backlog=BACKLOG)
        self._sockets = list(sockets)
        self._more: list[asyncio.AbstractServer] = []

    async def start(self) -> None:
        # CappedSite.start would bind host:port: register with the runner as it does, then serve
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


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOrders:
    """What the supervisor tells a worker, on its stdin (JSON)."""

    settings: Settings
    sockets: tuple[int, ...]
    """Descriptors of the worker's sockets (inherited): bound, not yet listening."""
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
    ``server.shutdown_timeout``). The sockets listen only from when the app is ready until
    it stops taking connections."""
    settings = orders.settings
    sockets = [socket.socket(fileno=fd) for fd in orders.sockets]
    try:
        ensure_fd_limit(settings.server.max_connections + settings.upstream.max_connections + FD_RESERVE)
        runner = web.AppRunner(app, handle_signals=True, **runner_options(settings.server))
        await runner.setup()  # the app's start-up (its store...): a failure here never listened
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
    finally:
        for sock in sockets:  # the only descriptors of this worker's sockets: they stop listening
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


def _backoff(failures: int) -> float:
    """Seconds before the next start of a slot whose workers failed ``failures`` times in a row."""
    first, cap = BACKOFF
    return min(cap, first * 2.0 ** min(max(0, failures - 1), 16))  # the exponent bounded: no float overflow


def worker_command() -> list[str]:
    """How a worker starts: this interpreter, this ``proxy`` package (see :data:`WORKER_BOOT`)."""
    return [sys.executable, "-P", "-c", WORKER_BOOT, str(PACKAGE_INIT)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How one worker of a slot ended."""

    pid: int | None
    """None when it could not be started at all."""
    ready: bool
    """It became ready (it served)."""
    code: int
    """Its exit status (negative: the signal); 1 when it could not be started at all."""
    lived: float
    """Seconds from its start to its exit."""
    error: str = ""
    """Why it could not be started (``pid`` None)."""


class Supervisor:
    """Runs ``settings.server.workers`` workers on one port until SIGTERM / SIGINT (see the module
    docstring). ``command`` starts one worker (default: :func:`worker_command`)."""

    def __init__(self, settings: Settings, command: Sequence[str] | None = None) -> None:
        self.settings = settings
        self.count = settings.server.workers
        self.command = list(command) if command is not None else worker_command()
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        """Slot -> its running worker."""
        self._stop = asyncio.Event()
        self._signals = 0
        self._start_failures = 0
        self._ever_ready = False
        self._gave_up: int | None = None
        self._unclean = False
        self._addresses: list[Address] = []
        self._hold: list[socket.socket] = []
        """Bound to the port for the supervisor's life, never listening."""
        self._metrics_dir = ""
        self._env: dict[str, str] = {}

    def run(self) -> int:
        """Bind, start the workers, supervise until stopped; the exit status."""
        server = self.settings.server
        try:
            self._addresses = reserve_port(server.host, server.port)
            self._hold = slot_sockets(self._addresses)
        except OSError as exc:
            raise KvwarmError(f"cannot listen on {server.host}:{server.port}: {exc.strerror or exc}") from None
        self._metrics_dir = tempfile.mkdtemp(prefix="kvwarm-metrics-")
        self._env = {**os.environ, METRICS_DIR_ENV: self._metrics_dir}
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(self._main())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            for sock in self._hold:
                sock.close()
            shutil.rmtree(self._metrics_dir, ignore_errors=True)

    @property
    def port(self) -> int:
        return int(self._addresses[0][1][1])

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
        """Keep a worker running in ``slot`` until the supervisor stops: a worker that exits or
        cannot start is started again after :func:`_backoff`, however often that fails, unless
        no worker has ever been ready (:meth:`_hopeless`)."""
        failures = 0
        while not self._stop.is_set():
            outcome = await self._run_worker(slot)
            if self._stop.is_set():
                return
            failures = 0 if outcome.ready and outcome.lived >= STABLE_SECONDS else failures + 1
            if not outcome.ready:
                self._start_failures += 1
            delay = None if not outcome.ready and self._hopeless() else _backoff(failures)
            self._report(slot, outcome, delay)
            if delay is None:
                self._give_up(EXIT_CONFIG if outcome.code == EXIT_CONFIG else 1)
                return
            await self._pause(delay)

    def _hopeless(self) -> bool:
        """Starts keep failing and no worker was ever ready: most likely the configuration."""
        return not self._ever_ready and self._start_failures >= MAX_START_FAILURES

    def _give_up(self, status: int) -> None:
        log.error("workers keep dying at start and none ever became ready: kvwarm stops (see the errors above)")
        if self._gave_up is None:
            self._gave_up = status
        self._stop.set()

    def _report(self, slot: int, outcome: Outcome, delay: float | None) -> None:
        """One log line for a worker that ended (the supervisor still running): what next."""
        then = f": starting another in {delay:.2g}s" if delay is not None else ""
        if outcome.pid is None:
            log.error("cannot start a worker (slot %d): %s (%d in a row)%s", slot, outcome.error, self._start_failures, then)
        elif outcome.ready:
            log.warning(
                "worker %d (slot %d) died with %s after %.0fs: restarting in %.2gs",
                outcome.pid, slot, _describe(outcome.code), outcome.lived, delay,
            )
        else:
            log.error(
                "worker %d (slot %d) exited with %s before it was ready (%d in a row)%s",
                outcome.pid, slot, _describe(outcome.code), self._start_failures, then,
            )

    async def _run_worker(self, slot: int) -> Outcome:
        """Start a worker in ``slot`` and wait until it exits."""
        started = time.monotonic()
        try:
            proc, ready = await self._spawn(slot)
        except OSError as exc:  # its sockets (the port taken meanwhile), its process (no memory...)
            return Outcome(pid=None, ready=False, code=1, lived=time.monotonic() - started, error=str(exc))
        code = await proc.wait()
        self.procs.pop(slot, None)
        self._forget(proc.pid)
        if self._stop.is_set() and code not in (0, -signal.SIGTERM):
            log.warning("worker %d (slot %d) stopped with %s", proc.pid, slot, _describe(code))
            self._unclean = True
        return Outcome(pid=proc.pid, ready=ready, code=code, lived=time.monotonic() - started)

    async def _spawn(self, slot: int) -> tuple[asyncio.subprocess.Process, bool]:
        """Start a worker in ``slot`` on fresh sockets; once it is running, wait until it is ready
        or gone. Returns the process and whether it became ready."""
        read_end, write_end = os.pipe()
        try:
            proc, orders = await self._start(slot, write_end)
        except BaseException:
            os.close(read_end)
            raise
        self.procs[slot] = proc
        if self._stop.is_set():
            self._send(proc, signal.SIGTERM)
        assert proc.stdin is not None
        with contextlib.suppress(ConnectionError):
            proc.stdin.write(orders.encode())
            await proc.stdin.drain()
        proc.stdin.close()
        ready = await self._ready(proc, slot, read_end)
        if ready:
            self._start_failures = 0
            self._ever_ready = True
            log.info("worker %d of %d ready (slot %d)", proc.pid, self.count, slot)
        return proc, ready

    async def _start(self, slot: int, ready: int) -> tuple[asyncio.subprocess.Process, WorkerOrders]:
        """The worker's process, holding the only descriptors of its new sockets (the supervisor
        keeps none, so they stop listening when the worker closes them or dies)."""
        try:
            sockets = slot_sockets(self._addresses)
        except BaseException:
            os.close(ready)
            raise
        fds = tuple(s.fileno() for s in sockets)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(*fds, ready),
                env=self._env,
                process_group=0,
            )
        finally:
            os.close(ready)
            for sock in sockets:
                sock.close()
        return proc, WorkerOrders(settings=self.settings, sockets=fds, ready=ready, parent=os.getpid(), slot=slot)

    async def _ready(self, proc: asyncio.subprocess.Process, slot: int, read_end: int) -> bool:
        """Wait for the worker's byte on the ready pipe: False when it exited (or hung) first."""
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
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
        return bool(said)

    def _forget(self, pid: int) -> None:
        """Drop a gone worker's live gauges from the metrics files (its counters stay counted)."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self._metrics_dir)  # type: ignore[no-untyped-call]
