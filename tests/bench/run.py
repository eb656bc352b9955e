"""``make bench``: run every benchmark, print the Markdown report, write ``docs/bench/latest.md``.

``python -m tests.bench.run [--quick] [--peers] [--only proxy,core,store,routing,scale,breakpoints,keepalive]``

- ``--quick``: fewer samples and a smaller store (about a third of the time);
- ``--peers``: add LiteLLM's proxy as a column of the proxy benchmark (installed into
  ``var/bench-peers/`` on first use);
- ``--only``: a subset of the sections (the report file is still written).

Sections run one after another, each measuring its cases against baselines in the same
run (see :mod:`tests.bench.measure`); server logs go to ``var/bench/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.bench import (
    breakpoints,
    core_responses,
    core_speed,
    keepalive,
    proxy_latency,
    routing,
    scale,
    store_flood,
    store_scale,
)
from tests.bench.report import Section, machine_header

REPORT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "latest.md"
SECTIONS = ("proxy", "core", "responses", "store", "flood", "routing", "scale", "breakpoints", "keepalive")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m tests.bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, smaller stores")
    parser.add_argument("--peers", action="store_true", help="add LiteLLM's proxy to the proxy benchmark")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--output", type=Path, default=REPORT, help=f"report file (default docs/bench/{REPORT.name})")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s): {', '.join(sorted(unknown))}")

    runners: dict[str, Callable[[], Section]] = {
        "proxy": lambda: proxy_latency.run(args.quick, args.peers),
        "core": lambda: core_speed.run(args.quick),
        "responses": lambda: core_responses.run(args.quick),
        "flood": lambda: store_flood.run(args.quick),
        "store": lambda: store_scale.run(args.quick),
        "routing": lambda: routing.run(args.quick),
        "scale": lambda: scale.run(args.quick),
        "breakpoints": lambda: breakpoints.run(args.quick),
        "keepalive": lambda: keepalive.run(args.quick),
    }
    started = time.perf_counter()
    parts = [machine_header(argv)]
    for name in SECTIONS:
        if name not in chosen:
            continue
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        section = runners[name]()
        parts.append(section.markdown())
    parts.append(f"_Total: {time.perf_counter() - started:.0f} s._\n")
    report = "\n".join(parts)
    print(report)
    args.output.write_text(report, encoding="utf-8")
    print(f"[bench] written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
