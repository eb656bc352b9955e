"""The typed keys under which an app keeps its resources (``app[STORE]``, ...).

A module of their own so that route modules (admin) and the app factory can
both import them without importing each other.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry

from .config import Settings
from .core.pricing import PriceTable
from .metrics import ProxyMetrics
from .store.base import AsyncStore
from .web.activity import Activity
from .web.history import History

if TYPE_CHECKING:  # the pipeline imports the edge modules that import these keys
    from .request.pipeline import Pipeline

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", ProxyMetrics)
STORE = web.AppKey("store", AsyncStore)
PRICES = web.AppKey("prices", PriceTable)
PIPELINE: web.AppKey[Pipeline] = web.AppKey("pipeline")
READY = web.AppKey("ready", asyncio.Event)
ACTIVITY = web.AppKey("activity", Activity)
"""The latest prefix-break examples (the /kvwarm/ page); the request path calls its ``note_break``."""
HISTORY = web.AppKey("history", History)
"""Per-minute snapshots of the counters for the /kvwarm/ page's chart."""

__all__ = ["ACTIVITY", "HISTORY", "METRICS", "PIPELINE", "PRICES", "READY", "REGISTRY", "SETTINGS", "STORE"]
