"""Timing helpers shared by the benchmarks: interleaved runs, medians, percentiles.

The machines are shared and noisy, so nothing is compared across runs: every case is
measured together with its baseline, in rotating order (A, B, C / B, C, A / ...), and
the statistics are taken per case over all rounds. In-process timings use the thread's
CPU time (:func:`time.thread_time`): on a 2-CPU machine shared with compilers and test
suites, wall time would mostly measure when this process was descheduled. Server processes
are measured by their own CPU time too (:func:`process_cpu`, from ``/proc``), never by the
client's wall clock.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN for no samples."""
    if not samples:
        return float("nan")
    data = sorted(samples)
    pos = (len(data) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def rotated(items: Sequence[T], i: int) -> list[T]:
    """``items`` rotated by ``i``: round ``i`` of an interleaved run starts with a different case."""
    k = i % len(items) if items else 0
    return [*items[k:], *items[:k]]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


cpu_clock = time.thread_time
"""The clock of in-process timings: this thread's CPU seconds."""


def calibrate(fn: Callable[[], object], min_seconds: float = 0.002) -> int:
    """How many calls of ``fn`` make one sample of at least ``min_seconds`` of CPU time."""
    n = 1
    while True:
        t0 = cpu_clock()
        for _ in range(n):
            fn()
        elapsed = cpu_clock() - t0
        if elapsed >= min_seconds or n >= 1 << 20:
            return n
        n = max(n * 2, int(n * min_seconds / max(elapsed, 1e-9)) + 1)


def interleaved(
    cases: dict[str, Callable[[], object]], *, seconds: float, min_rounds: int = 7
) -> dict[str, list[float]]:
    """CPU seconds per call of each case, sampled in rotating order for about ``seconds`` (wall) in all.

    Each case is calibrated to a batch of calls lasting ~2 ms, so the timer's resolution
    and the loop's overhead do not count.
    """
    names = list(cases)
    batches = {name: calibrate(fn) for name, fn in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in names}
    deadline = time.perf_counter() + seconds
    i = 0
    while i < min_rounds or time.perf_counter() < deadline:
        for name in rotated(names, i):
            fn, n = cases[name], batches[name]
            t0 = cpu_clock()
            for _ in range(n):
                fn()
            samples[name].append((cpu_clock() - t0) / n)
        i += 1
    return samples


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) of a process and its direct children; None off
    Linux or once it is gone. Ticks of ``SC_CLK_TCK`` (10 ms): measure over many requests."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        for p in (pid, *_children(pid)):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, IndexError):
        return None
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []
