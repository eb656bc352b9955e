"""``python -m proxy`` is the ``kvwarm`` command."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
