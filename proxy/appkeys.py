"""The typed keys under which an app keeps its resources (``app[STORE]``, ...).

A module of their own so that route modules (admin) and the app factory can
both import them without importing each other.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CollectorRegistry

from .config import Settings
from .core.pricing import PriceTable
from .metrics import ProxyMetrics
from .pipeline import Pipeline
from .store.base import TranscriptStore

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", ProxyMetrics)
STORE = web.AppKey("store", TranscriptStore)
PRICES = web.AppKey("prices", PriceTable)
PIPELINE = web.AppKey("pipeline", Pipeline)
READY = web.AppKey("ready", asyncio.Event)

__all__ = ["METRICS", "PIPELINE", "PRICES", "READY", "REGISTRY", "SETTINGS", "STORE"]
