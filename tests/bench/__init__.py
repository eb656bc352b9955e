"""kvwarm's benchmarks (``make bench``): never tests, never collected by pytest.

Every number is a ratio against a baseline measured in the same run, with the runs
interleaved (A, B, A, B, ...) and medians taken, because the machines are shared and
noisy. ``python -m tests.bench.run [--quick] [--peers]`` runs them all, prints a Markdown
report and writes it to ``docs/bench/latest.md``.

- :mod:`.proxy_latency` -- kvwarm vs direct vs a bare aiohttp pass-through, real sockets;
- :mod:`.peers` -- LiteLLM's proxy as an extra column (``--peers``);
- :mod:`.core_speed` -- identify + match + repair + diagnose vs ``orjson.loads``;
- :mod:`.store_scale` -- store bytes per node / session, and lookups against store size.
"""
