"""kvwarm: a caching reverse proxy that keeps an OpenAI-compatible provider's prompt cache warm."""

from __future__ import annotations

__version__ = "0.1.0"
