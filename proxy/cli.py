"""The ``kvwarm`` command line: serve, upstream-sim, sessions, show, export, import.

A broken configuration prints ``kvwarm: config error: <key>: <problem>`` and
exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from . import __version__, native
from .config import Settings, load_settings
from .errors import ConfigError, KvwarmError

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("proxy")

EXIT_CONFIG = 2


def _store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML settings file (default: none; the built-in defaults, then KVWARM_* variables and flags)",
    )
    p.add_argument(
        "--store",
        metavar="BACKEND",
        help="transcript store: 'memory' or 'sqlite:PATH' (overrides store.backend)",
    )


def version() -> str:
    """The installed distribution's version; in a source checkout that was never installed (on
    ``PYTHONPATH``), the package's own ``proxy.__version__``, which pyproject.toml reads too."""
    try:
        return metadata.version("kvwarm")
    except metadata.PackageNotFoundError:
        return f"{__version__} (not installed)"


def _sim_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``upstream-sim`` subcommand and its flags."""
    sim = sub.add_parser(
        "upstream-sim",
        help="run the reference upstream (an OpenAI-compatible provider emulator)",
        description="Run the reference upstream: an OpenAI-compatible provider emulator with a prefix cache.",
    )
    sim.add_argument("--host", metavar="H", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    sim.add_argument("--port", metavar="P", type=int, default=8090, help="listen port (default 8090)")
    sim.add_argument(
        "--cache",
        choices=("openai", "vllm", "openai-breakpoints", "anthropic"),
        default="openai",
        help="prompt-cache mode (default openai): openai (128-token steps from 1024 tokens, prompts only), "
        "vllm (16-token blocks, replies cached too), openai-breakpoints (GPT-5.6 cache breakpoints: implicit "
        "and prompt_cache_breakpoint, writes billed), anthropic (cache_control markers, writes billed)",
    )
    sim.add_argument(
        "--implicit-ttl",
        metavar="S",
        type=float,
        default=None,
        help="openai-breakpoints: seconds the implicit breakpoint lives (default: the request's ttl, 30 minutes)",
    )
    sim.add_argument(
        "--anthropic-usage",
        action="store_true",
        help="also report cache_read_input_tokens / cache_creation_input_tokens in chat usage",
    )
    sim.add_argument("--openhuman", action="store_true", help="add openhuman.usage / openhuman.billing blocks")
    sim.add_argument("--ttft-per-token", metavar="S", type=float, default=0.0, help="seconds of time-to-first-token per uncached prompt token")
    sim.add_argument("--chunk-delay", metavar="S", type=float, default=0.0, help="seconds between streamed chunks")
    sim.add_argument("--kv-capacity-tokens", metavar="N", type=int, default=None, help="bound the prefix cache to N tokens of KV blocks (breakpoint modes: of written prefixes), least recently used evicted first (default: practically unbounded, 200000 blocks)")
    sim.set_defaults(func=cmd_sim)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwarm",
        description="A caching reverse proxy for OpenAI-compatible APIs that keeps the provider's prompt cache warm.",
    )
    parser.add_argument("--version", action="version", version=f"kvwarm {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the proxy", description="Run the proxy.")
    _store_flags(serve)
    serve.add_argument("--host", metavar="H", help="listen address (overrides server.host)")
    serve.add_argument("--port", metavar="P", type=int, help="listen port (overrides server.port)")
    serve.add_argument(
        "--upstream",
        metavar="URL",
        action="append",
        help="upstream base URL, e.g. https://api.openai.com/v1; repeat it for a pool of replicas (overrides upstream.base_url)",
    )
    serve.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING, ... (overrides log.level)")
    serve.add_argument(
        "--workers",
        metavar="N",
        type=int,
        help="worker processes serving the port, under a supervisor (overrides server.workers; "
        "more than 1 needs a Redis store; Linux)",
    )
    # A worker of `serve --workers N`: its orders come from the supervisor on stdin (proxy.ops.workers).
    serve.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)

    _sim_parser(sub)

    sessions = sub.add_parser("sessions", help="list stored sessions", description="List stored sessions.")
    _store_flags(sessions)
    sessions.set_defaults(func=_admin_command("sessions"))

    show = sub.add_parser("show", help="print one session's transcript", description="Print one session's transcript.")
    _store_flags(show)
    show.add_argument("session", metavar="SESSION", help="session id (from `kvwarm sessions`)")
    show.add_argument("--format", choices=("md", "json"), default="md", help="output format (default md)")
    show.set_defaults(func=_admin_command("show"))

    export = sub.add_parser("export", help="write every session as a Markdown transcript", description="Export sessions to DIR.")
    _store_flags(export)
    export.add_argument("dir", metavar="DIR")
    export.set_defaults(func=_admin_command("export"))

    imp = sub.add_parser("import", help="seed the store from exported transcripts", description="Import transcripts from DIR.")
    _store_flags(imp)
    imp.add_argument("dir", metavar="DIR")
    imp.add_argument("--tenant-key", metavar="KEY", help="assign imported sessions to the tenant of this API key")
    imp.set_defaults(func=_admin_command("import"))
    return parser


def settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    overrides: dict[str, Any] = {"store.backend": getattr(args, "store", None)}
    overrides.update(extra)
    return load_settings(getattr(args, "config", None), overrides=overrides)


def configure_logging(level: str, *, pid: bool = False) -> None:
    """``pid``: each line names its process (a supervisor and its workers share one stderr)."""
    from .edge.defences import quiet_malformed_requests

    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
        if pid
        else "%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # A request aiohttp cannot parse (a huge header, a bad request line) is one WARNING line.
    quiet_malformed_requests()


def cmd_serve(args: argparse.Namespace) -> int:
    if args.worker:
        return _serve_worker()
    settings = settings_from(
        args,
        **{
            "server.host": args.host,
            "server.port": args.port,
            "upstream.base_url": args.upstream,
            "log.level": args.log_level,
            "server.workers": args.workers,
        },
    )
    if settings.server.workers > 1:
        from .ops.workers import Supervisor

        configure_logging(settings.log.level, pid=True)
        return Supervisor(settings).run()
    from .app import create_app

    configure_logging(settings.log.level)
    app = create_app(settings)
    return _run_until_signal(settings, lambda: _serve(app, settings))


def _serve_worker() -> int:
    """One worker of ``serve --workers N``, started by :class:`proxy.ops.workers.Supervisor`."""
    from .app import create_app
    from .ops.workers import WorkerOrders, serve_worker

    orders = WorkerOrders.decode(sys.stdin.buffer.read())
    configure_logging(orders.settings.log.level, pid=True)
    app = create_app(orders.settings)
    return _run_until_signal(orders.settings, lambda: serve_worker(app, orders))


GC_YOUNG_THRESHOLD = 20_000
"""Allocations between two collections of the youngest generation (CPython's default: 700)."""


def _tune_gc() -> None:
    """A server's garbage collector, tuned for a process whose heap is mostly long-lived nodes.

    With CPython's defaults the cyclic collector cost kvwarm about 7 % of its CPU per request in
    the benchmark (a young collection every few dozen requests, a full one every few thousand,
    walking the whole store). Objects made at startup (modules, the app) are moved out of its
    sight (``gc.freeze``), and young collections run every 20 000 allocations instead of 700:
    about the CPU of the collector switched off, while cyclic garbage is still collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 10)


def _run_until_signal(settings: Settings, serve: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """Run ``serve()`` on a new event loop until it returns or SIGINT / SIGTERM (GracefulExit)
    cancels it; then close the loop as ``web.run_app`` does."""
    from aiohttp.web_runner import GracefulExit

    _tune_gc()
    # web.run_app, unrolled: its TCP site has no connection cap (proxy.edge.defences.CappedSite has).
    loop = _new_loop(settings.server.uvloop)
    asyncio.set_event_loop(loop)
    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            rest = asyncio.all_tasks(loop)
            for task in rest:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            asyncio.set_event_loop(None)
            loop.close()
    return 0


async def _serve(app: web.Application, settings: Settings) -> None:
    """Listen until SIGINT / SIGTERM (GracefulExit), then stop as ``web.run_app`` does: in-flight
    requests get ``server.shutdown_timeout`` seconds, then the app's resources close."""
    from .edge.defences import start_server

    runner, site = await start_server(app, settings, handle_signals=True)
    try:
        log.info(
            "kvwarm listening on http://%s:%d/v1 -> %s (request path %s)",
            settings.server.host, site.port, ", ".join(settings.upstream.base_url), native.state(),
        )
        await asyncio.Event().wait()  # until cancelled
    finally:
        await runner.cleanup()


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
        except ImportError:
            pass
    return asyncio.new_event_loop()


def cmd_sim(args: argparse.Namespace) -> int:
    from aiohttp import web

    from .sim.server import SimConfig, create_sim_app

    configure_logging("INFO")
    try:
        config = SimConfig(
            cache_mode=args.cache,
            openhuman=args.openhuman,
            ttft_per_uncached_token=args.ttft_per_token,
            chunk_delay=args.chunk_delay,
            kv_capacity_tokens=args.kv_capacity_tokens,
            implicit_ttl_seconds=args.implicit_ttl,
            anthropic_usage=args.anthropic_usage,
        )
    except ValueError as exc:
        raise ConfigError("upstream-sim", str(exc)) from None
    web.run_app(
        create_sim_app(config),
        host=args.host,
        port=args.port,
        access_log=None,
        handler_cancellation=True,
        print=lambda *_: log.info("reference upstream (%s cache) on http://%s:%d/v1", args.cache, args.host, args.port),
    )
    return 0


def _admin_command(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from .ops.inspect_cli import run as run_inspect

        settings = settings_from(args)
        configure_logging("WARNING")
        return run_inspect(name, args, settings)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except ConfigError as exc:
        print(f"kvwarm: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KvwarmError as exc:
        print(f"kvwarm: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
