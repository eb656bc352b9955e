"""``make dashboard``: start the Prometheus (and Grafana, when installed) found on this machine, wired to kvwarm.

    python -m tests.dashboard.launch [--kvwarm 127.0.0.1:8080] [--prometheus-port 9090]
                                     [--grafana-port 3000] [--var var] [--no-wait]

- **Prometheus** (required): started with a copy of ``config/prometheus.yml``
  whose scrape target is the ``--kvwarm`` address (default: ``$KVWARM_ADDR`` or
  ``127.0.0.1:8080``), data under ``var/dashboard/prometheus``.
- **Grafana** (optional: not packaged by Debian, nor on PyPI or npm): when a
  ``grafana`` / ``grafana-server`` binary is found, it is started with the
  provisioning of ``grafana/provisioning`` (the Prometheus data source and the
  kvwarm dashboard), anonymous Admin access, data under ``var/dashboard/grafana``.
  When it is missing the launcher says so, how to get it, and how to import
  ``grafana/dashboards/kvwarm.json`` into a Grafana you already run.

Everything runs until Ctrl-C. ``--no-wait`` checks that the servers came up and
stops them (for tests and CI). Nothing here is part of the ``proxy`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_CONFIG = ROOT / "config" / "prometheus.yml"
PROVISIONING = ROOT / "grafana" / "provisioning"
DASHBOARDS = ROOT / "grafana" / "dashboards"
DASHBOARD_JSON = DASHBOARDS / "kvwarm.json"
DEFAULT_TARGET = "127.0.0.1:8080"
"""The scrape target written in config/prometheus.yml (kvwarm's default listen address)."""
PROVISIONED_PROMETHEUS_URL = "http://localhost:9090"
"""The data source URL in grafana/provisioning/datasources/kvwarm.yaml."""
GRAFANA_HOMES = ("/usr/share/grafana", "/usr/local/share/grafana", "/opt/grafana")

GRAFANA_MISSING = """\
Grafana is not installed here (it is not packaged by Debian, nor on PyPI or npm). To get it:
  - Debian/Ubuntu: add Grafana's APT repository (https://apt.grafana.com, see
    https://grafana.com/docs/grafana/latest/setup-grafana/installation/debian/), then
    `sudo apt-get install grafana`, and run `make dashboard` again;
  - or a tarball from https://grafana.com/grafana/download with its bin/ on PATH
    (or GRAFANA_HOME=<unpacked dir>), then `make dashboard` again;
  - or Docker: docker run --network host grafana/grafana-oss, then import the dashboard.
"""

IMPORT_BY_HAND = f"""\
Import the dashboard into a Grafana you already run:
  1. Connections > Data sources > Add > Prometheus, URL = this Prometheus ({{prometheus}})
     (or any Prometheus that scrapes kvwarm: add the `kvwarm` job of config/prometheus.yml to it).
  2. Dashboards > New > Import > "Upload dashboard JSON file" > {DASHBOARD_JSON.relative_to(ROOT)}
  3. Pick that Prometheus in the dashboard's "Data source" drop-down.
  Provisioning instead: grafana/provisioning/ holds a data source and a dashboard provider
  (set KVWARM_DASHBOARDS_DIR={DASHBOARDS} for the latter).
"""


def prometheus_config(target: str, scrape_interval: str | None = None) -> str:
    """``config/prometheus.yml`` with its kvwarm target replaced (and, optionally, a shorter interval)."""
    text = PROMETHEUS_CONFIG.read_text(encoding="utf-8")
    quoted = f'"{DEFAULT_TARGET}"'
    if quoted not in text:
        raise RuntimeError(f"{PROMETHEUS_CONFIG} no longer names the target {quoted}; update {__name__}")
    text = text.replace(quoted, json.dumps(target))
    if scrape_interval is not None:
        # A scrape may not time out later than the next one starts.
        text = re.sub(r"(?m)^(\s*(?:scrape|evaluation)_interval:\s*)\S+", rf"\g<1>{scrape_interval}", text)
        text = re.sub(r"(?m)^(\s*scrape_timeout:\s*)\S+", rf"\g<1>{scrape_interval}", text)
    return text


def find_prometheus() -> str | None:
    return shutil.which("prometheus")


@dataclass(frozen=True)
class GrafanaBinary:
    argv: tuple[str, ...]
    """The command up to its flags: ``grafana server`` (Grafana 10+) or ``grafana-server``."""
    home: Path
    """Grafana's homepath: the directory holding ``conf/defaults.ini`` and ``public/``."""


def find_grafana() -> GrafanaBinary | None:
    """A Grafana server binary and its homepath, or None."""
    candidates: list[tuple[str, ...]] = []
    env_home = os.environ.get("GRAFANA_HOME")
    if env_home:
        for name in ("grafana", "grafana-server"):
            path = Path(env_home) / "bin" / name
            if path.is_file():
                candidates.append((str(path), "server") if name == "grafana" else (str(path),))
    for name in ("grafana", "grafana-server"):
        found = shutil.which(name)
        if found:
            candidates.append((found, "server") if name == "grafana" else (found,))
    for argv in candidates:
        binary = Path(argv[0]).resolve()
        homes = [Path(env_home)] if env_home else []
        homes += [binary.parent.parent, *(Path(h) for h in GRAFANA_HOMES)]
        for home in homes:
            if (home / "conf" / "defaults.ini").is_file():
                return GrafanaBinary(argv, home)
    return None


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """Status and body of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}; its log: {log}\n{_tail(log)}")
        if http_get(url)[0] == 200:
            return
        time.sleep(0.25)
    raise SystemExit(f"{what} did not answer {url} within {timeout:.0f} s; its log: {log}\n{_tail(log)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Processes:
    """The servers this launcher started, stopped in reverse order."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


@contextlib.contextmanager
def running() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop()


def start_prometheus(procs: Processes, binary: str, target: str, port: int, var: Path) -> str:
    base = var / "dashboard"
    config = base / "prometheus.yml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(prometheus_config(target), encoding="utf-8")
    log = base / "prometheus.log"
    proc = procs.start("prometheus", [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={base / 'prometheus'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ], log)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/-/ready", proc, 30, "prometheus", log)
    return url


def grafana_provisioning(prometheus_url: str, var: Path) -> Path:
    """The provisioning folder: the repository's own when Prometheus is where it says, else a copy."""
    if prometheus_url.rstrip("/").endswith(":9090"):
        return PROVISIONING
    copy = var / "dashboard" / "provisioning"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(PROVISIONING, copy)
    datasource = copy / "datasources" / "kvwarm.yaml"
    datasource.write_text(
        datasource.read_text(encoding="utf-8").replace(PROVISIONED_PROMETHEUS_URL, prometheus_url), encoding="utf-8"
    )
    return copy


def start_grafana(procs: Processes, grafana: GrafanaBinary, port: int, prometheus_url: str, var: Path) -> str:
    base = var / "dashboard" / "grafana"
    env = dict(os.environ)
    env.update({
        "GF_PATHS_PROVISIONING": str(grafana_provisioning(prometheus_url, var)),
        "GF_PATHS_DATA": str(base / "data"),
        "GF_PATHS_LOGS": str(base / "logs"),
        "GF_PATHS_PLUGINS": str(base / "plugins"),
        "GF_SERVER_HTTP_ADDR": "127.0.0.1",
        "GF_SERVER_HTTP_PORT": str(port),
        "GF_AUTH_ANONYMOUS_ENABLED": "true",
        "GF_AUTH_ANONYMOUS_ORG_ROLE": "Admin",
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": str(DASHBOARD_JSON),
        "GF_ANALYTICS_REPORTING_ENABLED": "false",
        "GF_ANALYTICS_CHECK_FOR_UPDATES": "false",
        "GF_NEWS_NEWS_FEED_ENABLED": "false",
        "KVWARM_DASHBOARDS_DIR": str(DASHBOARDS),
    })
    log = base / "grafana.log"
    proc = procs.start("grafana", [*grafana.argv, f"--homepath={grafana.home}"], log, env=env, cwd=grafana.home)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/api/health", proc, 60, "grafana", log)
    return url


def kvwarm_answers(target: str) -> bool:
    status, body = http_get(f"http://{target}/metrics")
    return status == 200 and b"kvwarm_build_info" in body


def scrape_health(prometheus_url: str, timeout: float) -> str:
    """The kvwarm target's health as Prometheus sees it after its first scrape ("up", "down" or "unknown")."""
    deadline = time.monotonic() + timeout
    health = "unknown"
    while time.monotonic() < deadline:
        status, body = http_get(f"{prometheus_url}/api/v1/targets?state=active")
        if status == 200:
            targets = json.loads(body)["data"]["activeTargets"]
            health = next((t["health"] for t in targets if t["labels"].get("job") == "kvwarm"), "unknown")
            if health != "unknown":
                return str(health)
        time.sleep(0.5)
    return health


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvwarm", metavar="HOST:PORT", default=os.environ.get("KVWARM_ADDR", DEFAULT_TARGET),
                        help="the kvwarm to scrape (default $KVWARM_ADDR or %(default)s)")
    parser.add_argument("--prometheus-port", type=int, default=9090, metavar="P", help="default %(default)s")
    parser.add_argument("--grafana-port", type=int, default=3000, metavar="P", help="default %(default)s")
    parser.add_argument("--var", type=Path, default=ROOT / "var", help="state directory (default var/)")
    parser.add_argument("--no-wait", action="store_true", help="check the servers come up, then stop them")
    args = parser.parse_args(argv)
    target: str = args.kvwarm.removeprefix("http://").rstrip("/")

    prometheus = find_prometheus()
    grafana = find_grafana()
    if prometheus is None:
        print("Prometheus is not installed: `sudo apt-get install prometheus` (Debian/Ubuntu), or a release from\n"
              "https://prometheus.io/download/ with `prometheus` on PATH. Then run `make dashboard` again.")
        print("\n" + (GRAFANA_MISSING if grafana is None else ""))
        print(IMPORT_BY_HAND.format(prometheus="http://<your prometheus>:9090"))
        return 1
    for name, port in [("Prometheus", args.prometheus_port)] + ([("Grafana", args.grafana_port)] if grafana else []):
        if not port_free("127.0.0.1", port):
            flag = "--prometheus-port" if name == "Prometheus" else "--grafana-port"
            print(f"Port {port} is already in use (another {name}?). Stop it, or run\n"
                  f"  .venv/bin/python -m tests.dashboard.launch {flag} <free port>")
            return 1

    if not kvwarm_answers(target):
        print(f"Note: nothing answers http://{target}/metrics yet. Start kvwarm (`make run`, or `make demo` for\n"
              f"scripted agents); Prometheus keeps scraping and picks it up when it comes.\n")

    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    with running() as procs:
        prometheus_url = start_prometheus(procs, prometheus, target, args.prometheus_port, args.var)
        grafana_url = start_grafana(procs, grafana, args.grafana_port, prometheus_url, args.var) if grafana else None
        health = scrape_health(prometheus_url, timeout=8)
        query = urllib.parse.quote(
            "sum(kvwarm_cached_prompt_tokens_total) / sum(kvwarm_cache_known_prompt_tokens_total)"
        )
        print(f"Prometheus  {prometheus_url}  (scraping kvwarm at http://{target}/metrics every 5 s: {health})")
        print(f"  targets:  {prometheus_url}/targets")
        print(f"  hit %:    {prometheus_url}/graph?g0.expr={query}&g0.tab=0&g0.range_input=30m")
        if grafana_url:
            print(f"Grafana     {grafana_url}/d/kvwarm/kvwarm  (anonymous Admin; data source 'Prometheus (kvwarm)')")
        else:
            print("Grafana     not started.\n")
            print(GRAFANA_MISSING)
        print(IMPORT_BY_HAND.format(prometheus=prometheus_url))
        print(f"State and logs under {args.var / 'dashboard'}.")
        if args.no_wait:
            return 0
        print("Ctrl-C stops them.")
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stop:
            for name, proc in procs.procs:
                if proc.poll() is not None:
                    print(f"{name} exited with status {proc.returncode}; see its log under {args.var / 'dashboard'}")
                    return 1
            time.sleep(0.5)
        print("\nstopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
