"""The benchmark report: Markdown tables, a machine header, and number formatting."""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from importlib import metadata


@dataclass
class Table:
    """One Markdown table with a title and footnotes."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        out = [f"### {self.title}", ""]
        out.append("| " + " | ".join(self.columns) + " |")
        out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|")
        out.extend("| " + " | ".join(row) + " |" for row in self.rows)
        if self.notes:
            out.append("")
            out.extend(f"- {note}" for note in self.notes)
        return "\n".join(out)


@dataclass
class Section:
    """One benchmark's part of the report."""

    title: str
    tables: list[Table] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def markdown(self) -> str:
        parts = [f"## {self.title}", ""]
        parts.extend(t.markdown() + "\n" for t in self.tables)
        if self.findings:
            parts.append("**Findings**\n")
            parts.extend(f"- {f}" for f in self.findings)
            parts.append("")
        parts.append(f"_({self.seconds:.0f} s)_\n")
        return "\n".join(parts)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def machine_header(argv: list[str]) -> str:
    now = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    libs = ", ".join(f"{n} {_version(n)}" for n in ("aiohttp", "orjson", "uvloop", "tiktoken"))
    return "\n".join(
        [
            "# kvwarm benchmarks",
            "",
            f"- date: {now}",
            f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
            f"- python: {sys.version.split()[0]} ({platform.python_implementation()}); {libs}",
            f"- command: `python -m tests.bench.run {' '.join(argv)}`".rstrip(),
            "- every figure is measured in this run against a baseline measured alongside it "
            "(interleaved rounds, medians); absolute times are for orientation only",
            "",
        ]
    )


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.2f} ms"


def us(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e6:.1f} µs"


def ns(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e9:.0f} ns"


def x(value: float) -> str:
    return "n/a" if math.isnan(value) or math.isinf(value) else f"{value:.2f}x"


def mark(ok: bool) -> str:
    return "✅" if ok else "❌"


def kib(n: float) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"
