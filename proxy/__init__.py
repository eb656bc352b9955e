"""kvwarm: a caching reverse proxy that keeps an OpenAI-compatible provider's prompt cache warm."""

from __future__ import annotations

from . import native

__version__ = "0.1.0"

native.activate()  # the compiled request path, or every module from its source (proxy/native.py)
