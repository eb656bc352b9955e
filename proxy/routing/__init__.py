"""Routing over a pool of upstream replicas: each session to the replica that holds its KV.

Several ``upstream.base_url`` make a pool (replicas of one model server: vLLM, SGLang,
llama.cpp). The policy (``routing.policy``) places each request:

``router``      :class:`Router` (the pool, per request a :class:`Route`, per answer a
                :class:`Lease`): placement, failover, what an answer teaches
``placement``   rendezvous hashing, bounded load, the policies' choices (pure)
``affinity``    which replica served a prefix: the :class:`Affinity` seam, :class:`LocalAffinity`,
                a shared store's table (:func:`affinity_for`)
``health``      passive ejection and the half-open probe (pure)
``replica``     one replica: its sender, traits, health and load
``cache_key``   ``prompt_cache_key`` for OpenAI-style providers: derived, sharded, spliced

With one upstream the router is a pass-through: today's behaviour, plus the metrics.
"""

from __future__ import annotations

from .affinity import Affinity, AffinitySource, LocalAffinity, affinity_for
from .replica import Replica
from .router import DECISIONS, Lease, Route, Router

__all__ = [
    "DECISIONS",
    "Affinity",
    "AffinitySource",
    "Lease",
    "LocalAffinity",
    "Replica",
    "Route",
    "Router",
    "affinity_for",
]
