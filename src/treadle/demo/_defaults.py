"""Defaults of the airline replay that its command line shows (kept light: no imports)."""

from __future__ import annotations

from typing import Final

DEFAULT_CONCURRENCY: Final = 4
"""Runs driven at the same time by default by ``treadle demo airline`` (each in its own process)."""
