"""Prometheus metrics of kvwarm: :class:`ProxyMetrics`, built on an injected registry.

Every name has the ``kvwarm_`` prefix and base units (seconds, tokens, USD);
counters end in ``_total``. Label values are bounded: ``model`` keeps the
first ``max_models`` distinct names and counts the rest as ``"other"``;
``status`` is a class (``"2xx"``, ``"4xx"``, ``"5xx"``, ... or ``"error"``
when no response came back); ``stream`` is ``"true"``/``"false"``; ``stage``,
``kind`` and ``reason`` are kvwarm's own vocabularies, capped as well.

Requests
  ``kvwarm_requests_total{model,status,stream}``
      Requests answered (or failed), by status class.
  ``kvwarm_request_duration_seconds{model,stream}`` (histogram)
      From receiving the request to the last byte relayed to the client.
  ``kvwarm_upstream_ttfb_seconds{model,stream}`` (histogram)
      From sending the request upstream to its first response byte.
  ``kvwarm_inflight_requests`` (gauge)
      Requests being served now.
  ``kvwarm_errors_total{stage}``
      Failures by pipeline stage: parse, identify, match, repair, diagnose,
      record, usage, upstream, relay, store, report, routing, breakpoints, diagnostics, keepalive
      (fail-open errors included).

Usage (from each response's usage block)
  ``kvwarm_prompt_tokens_total{model}``
      Prompt tokens, cached ones included.
  ``kvwarm_cached_prompt_tokens_total{model}``
      Prompt tokens the provider served from its cache.
  ``kvwarm_cache_known_prompt_tokens_total{model}``
      Prompt tokens of the responses that reported a cached count: the
      denominator of the cache-hit ratio, so providers that do not report
      caching do not read as misses. Hit ratio:
      ``rate(kvwarm_cached_prompt_tokens_total[5m]) / rate(kvwarm_cache_known_prompt_tokens_total[5m])``.
  ``kvwarm_cache_write_tokens_total{model,ttl}``
      Prompt tokens written to the provider's cache (Anthropic cache creation, OpenAI GPT-5.6
      and OpenRouter cache writes), by how long they were written for: ``ttl`` is ``5m`` or
      ``1h`` (Anthropic), ``30m`` or ``12h`` (OpenAI), or ``unknown`` where the provider did not
      split its writes. Counted from responses that report writes (a reported 0 too); cache
      reads are ``kvwarm_cached_prompt_tokens_total``.
  ``kvwarm_completion_tokens_total{model}``
      Completion tokens, reasoning included.
  ``kvwarm_reasoning_tokens_total{model}``
      The reasoning part of the completion tokens.
  ``kvwarm_usage_unknown_cache_total{model}``
      Responses with usage but no cached count.
  ``kvwarm_usage_missing_total{model}``
      Successful (2xx) responses that carried no usage at all.
  ``kvwarm_request_cache_hit_ratio{model}`` (histogram, buckets 0, 0.1 ... 1)
      Per response: cached / prompt tokens (responses with a cached count and
      a non-zero prompt only).

Cost
  ``kvwarm_cost_usd_total{model,source}``
      USD spent; ``source`` is ``"billed"`` (the provider's bill) or
      ``"estimated"`` (the price table: cache reads at the cached price, cache writes at the
      write price of their TTL, premium included), or ``"keepalive"`` (the keep-alive pings,
      billed or estimated: below).
  ``kvwarm_unpriced_requests_total{model}``
      Responses whose cost is unknown (no bill, no price for the model).

Savings (what the provider's prompt cache saved, at the price table's list prices)
  ``kvwarm_cache_savings_usd_total{model,by}``
      USD the cache's reads saved against the uncached input price. ``by`` says who earned
      it: ``repair`` (the reads of prompt tokens a kvwarm repair rescued), ``breakpoint`` (the
      other reads of a request that could only have read at kvwarm's own cache markers:
      proxy/core/breakpoints.py says when that is sure), ``cache`` (every other read).
  ``kvwarm_cache_write_premium_usd_total{model,by}``
      USD the cache's writes cost above the uncached input price (``by``: ``breakpoint``, the
      writes of a request marked only by kvwarm on a ``cache_control`` upstream; ``cache``, the
      client's and the provider's writes).
  The headline, what the same prompt tokens would have cost uncached minus what they cost,
  is the difference of the two: ``sum(kvwarm_cache_savings_usd_total) -
  sum(kvwarm_cache_write_premium_usd_total)``. It is negative while writes are not repaid by
  reads; two counters rather than one that goes down keep ``rate`` and restarts right. Both
  are counted for a priced response that reports a cached or a write count (zeros too);
  a write price below the input price counts as a saving, never a negative increment.

Cache breakpoints (proxy/core/breakpoints.py)
  ``kvwarm_breakpoints_total{dialect,kind}``
      Cache markers kvwarm added to requests sent upstream: ``dialect`` ``openai`` or
      ``cache_control``, ``kind`` ``stem`` (a prefix sessions share), ``continuation`` (the
      request's last block, for the session's next turn), ``previous`` (where the session's
      previous turn ended), ``head`` (the end of the leading system and developer messages,
      where a request writes past it anyway).
  ``kvwarm_breakpoints_refused_total{reason}``
      Requests sent without the markers chosen for them: the markers could not be written into
      their bytes (a splice refusal reason) or placing them failed (``error``).

Keep-alive (proxy/keepalive/: pings that keep a paused session's cached prefix warm; never turns)
  ``kvwarm_keepalive_requests_total{outcome}``
      Each ping that fell due, by what became of it: ``sent`` (answered, the prefix read),
      ``missed`` (answered, but the provider had lost the prefix: the schedule stops),
      ``failed`` (no answer, or an error: never retried), ``skipped_unprofitable`` (the
      expected saving did not exceed its cost), ``budget_exhausted`` (its worst case did not
      fit ``keepalive.budget_usd_per_day``), ``max_age`` (quiet past
      ``keepalive.max_session_seconds``), ``unpriced`` (no price for the model),
      ``unsupported`` (no marker to cut the request at). All but ``sent`` end the session's pings.
  ``kvwarm_keepalive_tokens_total{kind}``
      The pings' tokens: ``cached`` (read), ``written``, ``uncached`` prompt tokens, ``output``.
      Not in the request series above (a ping is not a request of a client's).
  ``kvwarm_cost_usd_total{model,source="keepalive"}``
      What the pings cost (billed or at the price table): part of the total spend.
  ``kvwarm_keepalive_saved_usd_total``
      The cache writes avoided: a session that came back after its prefix would have expired,
      and read it because of the pings (at the list prices: the write less the read).
  ``kvwarm_keepalive_lost_usd_total``
      What the pings cost on sessions they did not save (never came back, or too late).

Repair and matching
  ``kvwarm_repairs_total{kind}``
      Messages (or the tools array) rewritten back to their stored form, by drift kind.
  ``kvwarm_repair_rescued_tokens_total{model}``
      Prompt tokens in front of which a repair restored the stored prefix:
      tokens that would have been re-prefilled without kvwarm.
  ``kvwarm_repairs_refused_total{reason}``
      Requests forwarded unrepaired because their repair could not be written into the
      client's bytes without changing another byte's meaning (``duplicate_key``,
      ``unsafe_number``, ...).
  ``kvwarm_prefix_breaks_total{reason}``
      Requests that left the stored transcript, by diagnosed reason.

Provider diagnostics (the provider's own verdict on a response's cache use, proxy/request/diagnosis.py)
  ``kvwarm_provider_cache_diagnoses_total{verdict}``
      Responses that carried one: ``hit``, ``client_miss`` (the request differed from the
      compared one), ``provider_miss`` (it matched, and the provider had lost the prefix: TTL,
      eviction, routing) or ``unknown`` (the compared response was forgotten or wrote nothing).
  ``kvwarm_provider_cache_misses_total{side,reason}``
      The misses among them: ``side`` ``client`` or ``provider``, ``reason`` the provider's
      (``input_changed``, ``tools_changed``, ``model_changed``, ... for the client's side;
      ``expired``, ``evicted``, ``unavailable``, ``not_reused`` for the provider's;
      proxy/core/provider_misses.py).
  ``kvwarm_matched_messages_total``, ``kvwarm_request_messages_total``
      Messages inside the matched prefix, and all request messages; their
      ratio is the share of each request kvwarm recognised.

Upstream pool (one ``upstream`` label value per configured replica: its ``host:port``)
  ``kvwarm_upstream_requests_total{upstream}``
      Requests sent to each replica (a request failed over counts on each replica it reached).
  ``kvwarm_upstream_inflight{upstream}`` (gauge)
      Requests in flight on each replica now.
  ``kvwarm_upstream_ejections_total{upstream}``
      Times a replica was ejected (connection refused, or a burst of 5xx / failures).
  ``kvwarm_routing_decisions_total{kind}``
      How each placement on a pool of several replicas was decided: ``affinity`` (the
      session's home), ``spill`` (home overloaded or ejected), ``new`` (rendezvous of the
      leading prefix), ``failover`` (the chosen replica was unreachable, or none is healthy
      and the one back soonest is tried),
      ``round_robin`` / ``least_inflight`` (those policies, and requests kvwarm does not read).

Store (gauges, set with :meth:`ProxyMetrics.set_store` or read at scrape time
after :meth:`ProxyMetrics.track_store`)
  ``kvwarm_store_nodes``, ``kvwarm_store_bytes``, ``kvwarm_store_sessions``,
  ``kvwarm_store_corrupt_entries`` (entries that failed to decode since start).

  ``kvwarm_build_info{version,native}`` (gauge)
      Always 1; the running version as a label, and ``native``: ``compiled`` when the request
      path runs compiled with mypyc, ``pure`` when it runs as plain Python (:mod:`proxy.native`).

Batches
  The request path's observations (every counter and histogram above but
  ``kvwarm_errors_total``) are summed per series, and histogram observations counted per
  bucket, in a batch that is applied when the registry is read: a scrape, the live page's
  counters or ``get_sample_value`` first run :meth:`ProxyMetrics.flush` (a collector
  registered ahead of every metric). So a read right after a response sees it, and a burst
  of requests costs one increment per series. With several workers the batch is applied at
  the end of the event loop's iteration instead (another worker's scrape cannot flush this
  one). Gauges (in flight, store) are set at once.

Several workers (``kvwarm serve --workers N``)
  The supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` before a worker imports prometheus-client,
  so each worker keeps its values in files there, and ``/metrics`` from any worker shows the
  totals of all of them (:meth:`ProxyMetrics.exposition`; counters of workers that died stay
  counted). Each gauge says how workers add up: in-flight counts are summed over the live
  workers; ``kvwarm_store_nodes`` / ``kvwarm_store_bytes`` too (a shared store's stats are the
  worker's own node cache: each holds its own copy, so the sum is the memory they use);
  ``kvwarm_store_sessions`` is the most recent reading (a shared store's count is the same
  for every worker); ``kvwarm_store_corrupt_entries`` is summed over every worker since start;
  ``kvwarm_build_info`` is 1. Gauges read at scrape time (``set_function``) cannot reach
  another process: there they are set by :meth:`ProxyMetrics.refresh_gauges` (each worker
  about once a second, and the scraped worker at the scrape). The live page keeps reading
  its own worker's registry.

The package
  :mod:`.table` declares every family above as data (name, kind, help, labels, buckets, the
  series exported from the start); :mod:`.families` builds them into the attributes of
  :class:`ProxyMetrics` and owns the batch, its flush and the gauges; :mod:`.observe` is
  :class:`ProxyMetrics` itself, the observations the pipeline makes; :mod:`.batch` holds the
  observations not applied yet. All but the table are compiled (:mod:`proxy.native`).
"""

from .families import StoreStatsLike
from .observe import LISTED as LISTED  # tests bound the listed observations by it
from .observe import OTHER, UNKNOWN_MODEL, ProxyMetrics
from .table import (
    DIALECTS,
    ERROR_STAGES,
    KEEPALIVE_OUTCOMES,
    KEEPALIVE_TOKENS,
    LATENCY_BUCKETS,
    RATIO_BUCKETS,
)

__all__ = [
    "DIALECTS",
    "ERROR_STAGES",
    "KEEPALIVE_OUTCOMES",
    "KEEPALIVE_TOKENS",
    "LATENCY_BUCKETS",
    "OTHER",
    "RATIO_BUCKETS",
    "UNKNOWN_MODEL",
    "ProxyMetrics",
    "StoreStatsLike",
]
