"""Stores the benchmarks run on."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import treadle


@asynccontextmanager
async def open_store(kind: str) -> AsyncIterator[treadle.ports.RunStore]:
    """``memory``: a memory store; ``sqlite``: a SQLite store in a temporary folder."""
    if kind == "memory":
        yield treadle.MemoryStore()
        return
    with tempfile.TemporaryDirectory() as tmp:
        async with treadle.open_sqlite_store(os.path.join(tmp, "bench.db")) as store:
            yield store
