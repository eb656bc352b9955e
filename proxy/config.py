"""Settings: one frozen value, loaded and validated once.

Sources, later ones winning: the built-in defaults (the fields below), the TOML file given
(``kvwarm serve --config FILE``; none by default, wherever kvwarm runs from:
``config/kvwarm.toml`` in the repository documents every key at its default), then
``KVWARM_<SECTION>_<KEY>`` environment variables (for example ``KVWARM_UPSTREAM_BASE_URL``),
then command-line flags. Every invalid value raises :class:`~proxy.errors.ConfigError` naming
the dotted key and the problem.

The price table is read here too (:meth:`MetricsSettings.prices`): the file
``metrics.prices_file`` names, else the one shipped inside the package
(``proxy/defaults/prices.toml``, package data read with :mod:`importlib.resources`), parsed
and handed to the pure core (:mod:`proxy.core.pricing`).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .core.breakpoints import SETTINGS as CACHE_BREAKPOINTS
from .core.policy import Policy
from .core.pricing import PriceTable
from .errors import ConfigError, InvalidSetting
from .store.urls import is_redis_url
from .transport.egress import IDLE_CONNECTION_TIMEOUT, Proxy, check_tls_files

SHIPPED_PRICES = ("defaults", "prices.toml")
"""The price table shipped as package data: its path inside the ``proxy`` package."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 64 * 1024 * 1024
    """Request bodies above this are refused with 413 before reaching the upstream."""
    shutdown_timeout: float = 30.0
    """Seconds in-flight requests get to finish on SIGTERM / Ctrl-C."""
    uvloop: bool = True
    """Run on uvloop when it is installed (measured faster; see ``make bench``)."""
    body_timeout: float = 60.0
    """Seconds a request body may take to arrive in full; slower: 408 and the connection closed."""
    header_timeout: float = 60.0
    """Seconds a connection may wait for a request's complete headers, from when it opened or its
    previous response ended; then it is closed. aiohttp's keep-alive timeout, which is also its
    only deadline on headers: idle keep-alive connections close after it too."""
    max_connections: int = 512
    """Client connections open at once (idle keep-alive ones included); one more is answered 503
    and closed at once. Keep it plus ``upstream.max_connections`` under the open-file limit."""
    workers: int = 1
    """Worker processes serving one port (``kvwarm serve --workers N``, Linux). More than one needs a
    shared store (``store.backend`` a Redis URL); the connection limits then hold per worker."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamSettings:
    base_url: tuple[str, ...] = ("https://api.openai.com/v1",)
    """One base URL, or several: a pool of replicas of one model server, balanced by
    ``routing.policy``. TOML: a string or an array; environment: comma-separated."""
    api_key: str = ""
    """When set, replaces the client's ``Authorization`` towards the upstream."""
    connect_timeout: float = 10.0
    first_byte_timeout: float = 600.0
    """Seconds from sending the request to the response headers."""
    idle_timeout: float = 300.0
    """Longest gap between two chunks of a streamed response."""
    total_timeout: float = 1800.0
    max_connections: int = 256
    idle_connection_timeout: float = IDLE_CONNECTION_TIMEOUT
    """Seconds an idle pooled connection to the upstream is kept; then it is closed, never
    reused. Below the 5 s after which uvicorn (vLLM, SGLang), llama.cpp's server and Node close
    an idle keep-alive connection: kvwarm does not write a request into a connection its server
    is closing, a request it could not send again (the upstream may have read it)."""
    proxy: str | None = None
    """The egress proxy for every upstream: ``http://[user:password@]host:port``. Unset (None):
    ``https_proxy`` / ``http_proxy`` below, from the environment. ``""``: no proxy, whatever
    the environment says. ``no_proxy`` applies either way."""
    https_proxy: str = ""
    """The proxy for https upstreams while ``proxy`` is unset. Default: the environment's
    ``https_proxy``, else ``HTTPS_PROXY`` (read once, by :func:`load_settings`)."""
    http_proxy: str = ""
    """The same for http upstreams (``http_proxy``, else ``HTTP_PROXY``)."""
    no_proxy: str = ""
    """Hosts reached without a proxy, as curl and requests read ``NO_PROXY``: comma-separated
    ``*``, domain suffixes, IP addresses, CIDR ranges, each with an optional ``:port``.
    Default: the environment's ``no_proxy``, else ``NO_PROXY``."""
    ca_file: str = ""
    """PEM file of CA certificates trusted for https upstreams besides the default trust (the
    system's, or OpenSSL's ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set)."""
    client_cert: str = ""
    """PEM client certificate (with its chain) presented when an upstream asks for one; its key
    is ``client_key``, or in the same file."""
    client_key: str = ""
    cache_breakpoints: str = "auto"
    """Cache markers kvwarm adds where the upstream caches only at breakpoints
    (proxy/core/breakpoints.py): ``openai`` (``prompt_cache_breakpoint``, GPT-5.6 and later),
    ``cache_control`` (Anthropic-style: OpenRouter, DashScope), ``off`` (none: the client's bytes,
    as before), or ``auto``: ``openai`` on api.openai.com for GPT-5.6 and later models,
    ``cache_control`` on openrouter.ai for ``anthropic/`` and ``qwen/`` models and on DashScope
    hosts, ``off`` anywhere else."""
    provider_diagnostics: bool = False
    """Ask the provider why a prompt missed its cache (proxy/request/diagnosis.py): kvwarm names the
    session's previous response as ``prompt_cache_options.comparison_response_id`` (Responses API)
    where the client named none, and counts the provider's verdict. Off: the client's bytes. Only
    for an upstream that takes the option (OpenAI's Responses API, GPT-5.6 and later)."""


PROXY_ENVIRONMENT = (("https_proxy", "HTTPS_PROXY"), ("http_proxy", "HTTP_PROXY"), ("no_proxy", "NO_PROXY"))
"""The environment variables of ``upstream.https_proxy``, ``http_proxy``, ``no_proxy``."""


def proxy_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``upstream.https_proxy``, ``http_proxy`` and ``no_proxy`` as the environment sets them,
    the lowercase variable first (as curl, requests and Python's urllib read them); a value set
    in the file or by ``KVWARM_UPSTREAM_*`` wins over them."""
    found: dict[str, str] = {}
    for lower, upper in PROXY_ENVIRONMENT:
        value = env.get(lower, env.get(upper))
        if value is not None:
            found[lower] = value.strip()
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSettings:
    backend: str = "sqlite:var/kvwarm.db"
    """``memory``, ``sqlite:PATH`` (relative to the working directory), or a shared Redis:
    ``redis://[:password@]host:port/db``, ``rediss://...``, ``unix:///path.sock?db=N``,
    ``redis+cluster://host:port[,host:port...]`` (see proxy/store/redis/store.py)."""
    ttl_seconds: float = 24 * 3600.0
    """A node unused for this long is evicted."""
    max_bytes: int = 512 * 1024 * 1024
    """Byte budget of stored transcripts; leaves are evicted first, least recently used."""
    secret: str = ""
    """Server secret keying tenant hashes. Empty: generated once and kept beside the store."""
    tenant_header: str = ""
    """Header naming the tenant. Empty: the ``Authorization`` value is the tenant."""
    flush_interval: float = 0.5
    """Seconds between batched writes of the sqlite store."""
    import_max_bytes: int = 64 * 1024 * 1024
    """``kvwarm import`` refuses a transcript file larger than this (checked before and while reading)."""
    timeout: float = 0.25
    """Seconds a request may wait for a shared store, in all (reads while planning, the turn's
    write); beyond, it is forwarded unrepaired and ``kvwarm_errors_total{stage="store"}`` counts it."""
    cache_bytes: int = 64 * 1024 * 1024
    """A shared store's per-process cache of (immutable) nodes."""
    redis_prefix: str = "kvwarm"
    """Prefix of every Redis key (several kvwarm deployments may share one Redis)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RepairSettings:
    enabled: bool = True
    """Off: kvwarm only observes (fingerprints, diagnoses, measures) and forwards bytes unchanged."""
    collapse_duplicates: bool = False
    pin_patterns: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Role -> regexes of volatile spans to pin to their first-seen value (opt-in)."""

    def policy(self) -> Policy:
        """The core's repair policy; a pin pattern that does not compile is a ConfigError."""
        try:
            return Policy.build(self.enabled, self.collapse_duplicates, self.pin_patterns)
        except InvalidSetting as exc:
            raise ConfigError.of(exc) from exc


ROUTING_POLICIES = ("prefix", "round_robin", "least_inflight")
PROMPT_CACHE_KEY_MODES = ("", "session")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingSettings:
    """How a pool of upstream replicas (several ``upstream.base_url``) shares the requests."""

    policy: str = "prefix"
    """``prefix`` (each session to the replica that holds its KV, bounded load),
    ``round_robin`` or ``least_inflight``. Ignored with one upstream."""
    max_load_factor: float = 1.25
    """A replica whose in-flight requests reach this times the healthy replicas' mean (counting
    the request being placed) takes no more sessions until it drains; at least 1."""
    balance_abs_threshold: int = 32
    """A session leaves its home (moves to the least-loaded replica) only when the home is
    overloaded (``max_load_factor``) and holds more than this many requests in flight beyond
    the least-loaded healthy replica; at least 0 (0: bounded load alone). A move costs a
    prefill of the session's whole history; a few more requests in a batching engine's batch
    cost little. An agent session has one request in flight at a time, so with 32 no session
    moves while 33 or fewer sessions run, however they are spread; 32 in-flight requests are
    still well within one engine's batch (vLLM schedules up to 256 sequences)."""
    eject_errors: int = 3
    """5xx responses or failures in ``eject_window`` seconds that eject a replica (a refused
    connection ejects it at once)."""
    eject_window: float = 10.0
    eject_seconds: float = 30.0
    """How long an ejected replica gets no requests; then one request probes it."""
    affinity_entries: int = 65536
    """Prefix -> replica entries remembered (least recently used forgotten first) by one process.
    With a shared store (a Redis ``store.backend``) the table lives there instead, shared by
    every kvwarm process, and this does not apply."""
    affinity_ttl_seconds: float = 1800.0
    """With a shared store: how long a prefix -> replica entry lives after it was last written
    (about as long as an engine keeps a prefix's KV)."""
    prompt_cache_key: str = ""
    """``session``: give each session a stable ``prompt_cache_key`` when the client sent none
    (OpenAI-style providers route by it). Empty: never."""
    prompt_cache_key_rpm: int = 15
    """Requests per minute one ``prompt_cache_key`` carries before further ones get a shard
    (``<key>-1``, ...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSettings:
    enabled: bool = True
    path: str = "/metrics"
    max_models: int = 20
    """Distinct ``model`` label values; later models are counted as ``other``."""
    prices_file: str = ""
    """Price table (TOML), replacing the shipped one whole. Empty: the table shipped inside the
    package (``proxy/defaults/prices.toml``)."""
    token: str = ""
    """Bearer token the metrics path requires. Empty: open (as Prometheus exporters usually are)."""

    def prices(self) -> PriceTable:
        """The price table: ``prices_file``, else the shipped one. Read when an app is built
        (each worker reads its own), not when settings load; a file that cannot be read or a
        bad entry is a ConfigError naming the key."""
        if self.prices_file:
            path = Path(self.prices_file)
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ConfigError("metrics.prices_file", f"cannot read {path}: {exc.strerror}") from exc
            return parse_prices(data, str(path))
        shipped = files("proxy").joinpath(*SHIPPED_PRICES)
        return parse_prices(shipped.read_bytes(), "the shipped price table")


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepaliveSettings:
    """Opt-in keep-alive of paused sessions' cached prefixes (proxy/keepalive/): shortly before a
    prefix kvwarm marked would expire, one minimal request re-reads it, when the tenant's own
    history says the session is likely enough to come back for the read to pay for itself."""

    enabled: bool = False
    budget_usd_per_day: float = 1.0
    """Most USD the pings may cost in any 24 hours (each ping's worst case counted before it is
    sent); with several workers, each gets its share."""
    max_session_seconds: float = 3600.0
    """No ping once a session has been quiet this long since its last turn."""
    lead_seconds: float = 30.0
    """A ping goes this many seconds before the prefix would expire; below the TTL."""
    ttl_seconds: float = 0.0
    """The provider's cache TTL. 0: what the response's usage reports, else the dialect's
    default (``cache_control`` 5 minutes, ``openai`` 30 minutes)."""
    max_sessions: int = 1000
    """Sessions watched at once (each holds its last request's bytes while pings may follow)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminSettings:
    token: str = ""
    """Bearer token for /kvwarm/ from non-loopback clients. Empty: loopback only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogSettings:
    level: str = "INFO"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    repair: RepairSettings = field(default_factory=RepairSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    keepalive: KeepaliveSettings = field(default_factory=KeepaliveSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    log: LogSettings = field(default_factory=LogSettings)

    def with_overrides(self, overrides: Mapping[str, Any]) -> Settings:
        """A copy with dotted keys (``"server.port"``) replaced, validated."""
        raw = _to_raw(self)
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            raw.setdefault(section, {})[key] = value
        return _build(raw)


_SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Settings)}  # type: ignore[misc]
_LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read the TOML file ``path`` (None: no file, the built-in defaults), then environment,
    then ``overrides`` (dotted keys from flags)."""
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("config", f"cannot read {file}: {exc.strerror}") from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{file} is not valid TOML: {exc}") from exc
        for section, values in data.items():
            if section not in _SECTIONS:
                raise ConfigError(section, f"unknown section (known: {', '.join(_SECTIONS)})")
            if not isinstance(values, dict):
                raise ConfigError(section, "must be a table")
            raw[section] = dict(values)
    environment = os.environ if env is None else env
    for key, value in proxy_environment(environment).items():  # under the file's values
        raw.setdefault("upstream", {}).setdefault(key, value)
    for name, value in environment.items():
        if not name.startswith("KVWARM_"):
            continue
        dotted = _env_key(name)
        if dotted is None:
            continue
        section, _, key = dotted.partition(".")
        raw.setdefault(section, {})[key] = value
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        raw.setdefault(section, {})[key] = value
    return _build(raw)


def _env_key(name: str) -> str | None:
    rest = name[len("KVWARM_") :].lower()
    for section in _SECTIONS:
        if rest.startswith(section + "_"):
            return f"{section}.{rest[len(section) + 1 :]}"
    return None


def _to_raw(settings: Settings) -> dict[str, dict[str, Any]]:
    return {
        f.name: {g.name: getattr(getattr(settings, f.name), g.name) for g in fields(_SECTIONS[f.name])}
        for f in fields(Settings)
    }


def _build(raw: Mapping[str, Mapping[str, Any]]) -> Settings:
    sections: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        values = dict(raw.get(section, {}))
        known = {f.name: f for f in fields(cls)}
        default = cls()
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if key not in known:
                raise ConfigError(dotted, f"unknown key (known: {', '.join(known)})")
            kwargs[key] = _coerce(dotted, value, getattr(default, key))
        sections[section] = replace(default, **kwargs)
    settings = Settings(**sections)
    _validate(settings)
    return settings


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Convert ``value`` to the type of ``default``; strings come from the environment."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
            return value.lower() in {"1", "true", "yes", "on"}
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if isinstance(default, int):
        try:
            if isinstance(value, bool) or isinstance(value, float):
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(key, f"expected a whole number, got {value!r}") from None
    if isinstance(default, float):
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(key, f"expected a number of seconds, got {value!r}") from None
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        return _url_list(key, value)
    if isinstance(default, Mapping):
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError:
                raise ConfigError(key, "expected a table (JSON in the environment)") from None
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a table of role = [regex, ...], got {value!r}")
        out: dict[str, tuple[str, ...]] = {}
        for role, patterns in value.items():
            if role not in _ROLES:
                raise ConfigError(f"{key}.{role}", f"unknown role (known: {', '.join(sorted(_ROLES))})")
            if isinstance(patterns, str):
                patterns = [patterns]
            if not isinstance(patterns, list | tuple) or not all(isinstance(p, str) for p in patterns):
                raise ConfigError(f"{key}.{role}", "expected a list of regular expressions")
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ConfigError(f"{key}.{role}", f"invalid regex {pattern!r}: {exc}") from None
            out[role] = tuple(patterns)
        return out
    return value


def _url_list(key: str, value: Any) -> tuple[str, ...]:
    """A string (comma-separated in the environment) or a list of strings -> a tuple of URLs."""
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
        items = [part for part in items if part] or [value]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise ConfigError(key, f"expected a URL or a list of URLs, got {value!r}")
    return tuple(items)


def _validate(s: Settings) -> None:
    if not 0 <= s.server.port <= 65535:
        raise ConfigError("server.port", f"must be 0-65535, got {s.server.port}")
    if s.server.max_body_bytes <= 0:
        raise ConfigError("server.max_body_bytes", "must be positive")
    for name in ("body_timeout", "header_timeout"):
        if getattr(s.server, name) <= 0:
            raise ConfigError(f"server.{name}", "must be a positive number of seconds")
    if s.server.max_connections <= 0:
        raise ConfigError("server.max_connections", "must be positive")
    if s.server.workers < 1:
        raise ConfigError("server.workers", f"must be at least 1, got {s.server.workers}")
    urls = s.upstream.base_url
    if not urls:
        raise ConfigError("upstream.base_url", "needs at least one URL")
    for base in urls:
        url = urlsplit(base)
        if url.scheme not in {"http", "https"} or not url.netloc:
            raise ConfigError("upstream.base_url", f"must be an http(s) URL, got {base!r}")
    seen = {u.rstrip("/") for u in urls}
    if len(seen) != len(urls):
        raise ConfigError("upstream.base_url", "lists the same URL twice")
    _validate_routing(s.routing)
    _validate_upstream(s.upstream)
    _validate_keepalive(s.keepalive)
    backend = s.store.backend
    if backend != "memory" and not (backend.startswith("sqlite:") and len(backend) > len("sqlite:")) and not is_redis_url(backend):
        raise ConfigError("store.backend", f"expected 'memory', 'sqlite:PATH' or a redis:// URL, got {backend!r}")
    if s.server.workers > 1 and not is_redis_url(backend):
        why = (
            "each worker would keep its own transcripts, so a session's turns would miss on the other workers"
            if backend == "memory"
            else "a sqlite file is owned by one process, which keeps the store's index in its memory"
        )
        raise ConfigError(
            "server.workers",
            f"{s.server.workers} workers need a shared store (store.backend a Redis URL), not {backend!r}: {why}",
        )
    if s.store.timeout <= 0:
        raise ConfigError("store.timeout", "must be a positive number of seconds")
    if s.store.cache_bytes <= 0:
        raise ConfigError("store.cache_bytes", "must be positive")
    if not s.store.redis_prefix or "{" in s.store.redis_prefix or "}" in s.store.redis_prefix:
        raise ConfigError("store.redis_prefix", "must be non-empty and hold no '{' or '}'")
    if s.store.ttl_seconds <= 0:
        raise ConfigError("store.ttl_seconds", "must be positive")
    if s.store.max_bytes <= 0:
        raise ConfigError("store.max_bytes", "must be positive")
    if s.store.flush_interval <= 0:
        raise ConfigError("store.flush_interval", "must be positive")
    if s.store.import_max_bytes <= 0:
        raise ConfigError("store.import_max_bytes", "must be positive")
    if not s.metrics.path.startswith("/"):
        raise ConfigError("metrics.path", "must start with '/'")
    if s.metrics.max_models < 1:
        raise ConfigError("metrics.max_models", "must be at least 1")
    if s.log.level.upper() not in _LEVELS:
        raise ConfigError("log.level", f"expected one of {', '.join(sorted(_LEVELS))}")


def _validate_upstream(u: UpstreamSettings) -> None:
    if u.cache_breakpoints not in CACHE_BREAKPOINTS:
        raise ConfigError(
            "upstream.cache_breakpoints", f"expected one of {', '.join(CACHE_BREAKPOINTS)}, got {u.cache_breakpoints!r}"
        )
    for name in ("connect_timeout", "first_byte_timeout", "idle_timeout", "total_timeout", "idle_connection_timeout"):
        if not getattr(u, name) > 0:
            raise ConfigError(f"upstream.{name}", "must be a positive number of seconds")
    if u.max_connections <= 0:
        raise ConfigError("upstream.max_connections", "must be positive")
    if u.proxy is not None and not isinstance(u.proxy, str):
        raise ConfigError("upstream.proxy", f"expected a proxy URL or \"\" (no proxy), got {u.proxy!r}")
    proxies = [("proxy", u.proxy)] if u.proxy is not None else [("https_proxy", u.https_proxy), ("http_proxy", u.http_proxy)]
    for name, url in proxies:
        if url:
            try:
                Proxy.parse(url)
            except ValueError as exc:
                hint = "" if name == "proxy" else f" (from {name.upper()} or {name} in the environment unless set here; upstream.proxy = \"\" ignores the environment)"
                raise ConfigError(f"upstream.{name}", f"{exc}{hint}") from None
    try:
        check_tls_files(u.ca_file, u.client_cert, u.client_key)
    except ValueError as exc:
        key, _, problem = str(exc).partition(": ")
        raise ConfigError(f"upstream.{key}", problem) from None


SHORTEST_TTL = 300.0
"""The shortest cache TTL a keep-alive may face (Anthropic-style ``cache_control``: 5 minutes)."""


def _validate_keepalive(k: KeepaliveSettings) -> None:
    if not (math.isfinite(k.budget_usd_per_day) and k.budget_usd_per_day >= 0):
        raise ConfigError("keepalive.budget_usd_per_day", f"must be a finite number of USD >= 0, got {k.budget_usd_per_day}")
    if not (math.isfinite(k.max_session_seconds) and k.max_session_seconds > 0):
        raise ConfigError("keepalive.max_session_seconds", "must be a positive number of seconds")
    if not (math.isfinite(k.ttl_seconds) and k.ttl_seconds >= 0):
        raise ConfigError("keepalive.ttl_seconds", "must be 0 (the provider's default) or a positive number of seconds")
    ttl = k.ttl_seconds or SHORTEST_TTL
    if not 0 < k.lead_seconds < ttl:
        raise ConfigError("keepalive.lead_seconds", f"must be more than 0 and less than the cache TTL ({ttl:g} s), got {k.lead_seconds}")
    if k.max_sessions < 1:
        raise ConfigError("keepalive.max_sessions", "must be at least 1")


def _validate_routing(r: RoutingSettings) -> None:
    if r.policy not in ROUTING_POLICIES:
        raise ConfigError("routing.policy", f"expected one of {', '.join(ROUTING_POLICIES)}, got {r.policy!r}")
    if not r.max_load_factor >= 1.0:
        raise ConfigError("routing.max_load_factor", f"must be at least 1.0, got {r.max_load_factor}")
    if r.balance_abs_threshold < 0:
        raise ConfigError(
            "routing.balance_abs_threshold",
            f"must be 0 or more (requests in flight beyond the least-loaded replica), got {r.balance_abs_threshold}",
        )
    if r.eject_errors < 1:
        raise ConfigError("routing.eject_errors", "must be at least 1")
    for name in ("eject_window", "eject_seconds"):
        if not getattr(r, name) > 0:
            raise ConfigError(f"routing.{name}", "must be a positive number of seconds")
    if r.affinity_entries < 1:
        raise ConfigError("routing.affinity_entries", "must be at least 1")
    if not r.affinity_ttl_seconds > 0:
        raise ConfigError("routing.affinity_ttl_seconds", "must be a positive number of seconds")
    if r.prompt_cache_key not in PROMPT_CACHE_KEY_MODES:
        raise ConfigError("routing.prompt_cache_key", f"expected \"session\" or \"\" (off), got {r.prompt_cache_key!r}")
    if r.prompt_cache_key_rpm < 1:
        raise ConfigError("routing.prompt_cache_key_rpm", "must be at least 1")


def parse_prices(data: bytes, source: str) -> PriceTable:
    """A price table from the bytes of its TOML file (``source`` names it in errors)."""
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("prices", f"{source} is not valid TOML: {exc}") from None
    try:
        return PriceTable.from_mapping(parsed)
    except InvalidSetting as exc:
        raise ConfigError(exc.key, f"{exc.problem} (in {source})") from exc
