"""Stores the benchmarks run on."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio

import treadle
from treadle.testing import postgres

DEFAULT_DSN = "postgresql://treadle:treadle@127.0.0.1:5432/treadle_test"
DSN_ENV = "TREADLE_BENCH_POSTGRES"


def postgres_dsn(given: str | None = None) -> str:
    """``given``, else ``$TREADLE_BENCH_POSTGRES``, else the local test server."""
    return given or os.environ.get(DSN_ENV) or DEFAULT_DSN


def new_schema_name(prefix: str = "bench") -> str:
    return f"{prefix}_{secrets.token_hex(4)}"


def drop_schema(dsn: str, schema: str) -> None:
    """``DROP SCHEMA ... CASCADE`` (blocking)."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextmanager
def fresh_database(dsn: str, prefix: str = "treadle_bench") -> Iterator[str]:
    """A new database on ``dsn``'s server, dropped afterwards; yields its DSN (keyword form)."""
    with postgres.fresh_database(dsn, prefix=prefix) as fresh:
        yield fresh


@asynccontextmanager
async def open_store(kind: str, *, dsn: str | None = None) -> AsyncIterator[treadle.ports.RunStore]:
    """A fresh store of ``kind``, gone afterwards.

    ``memory``: a memory store; ``sqlite``: a SQLite store in a temporary folder; ``jsonl``: a
    JSONL store in a temporary folder; ``postgres``: a PostgreSQL store in a new schema of
    `postgres_dsn` (dropped afterwards).
    """
    if kind == "memory":
        yield treadle.MemoryStore()
        return
    if kind == "postgres":
        dsn = postgres_dsn(dsn)
        schema = new_schema_name()
        try:
            async with treadle.open_postgres_store(dsn, schema=schema) as store:
                yield store
        finally:
            await trio.to_thread.run_sync(drop_schema, dsn, schema)
        return
    if kind not in ("sqlite", "jsonl"):
        raise ValueError(f"unknown store kind {kind!r}")
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "jsonl":
            async with treadle.open_jsonl_store(os.path.join(tmp, "runs")) as store:
                yield store
        else:
            async with treadle.open_sqlite_store(os.path.join(tmp, "bench.db")) as store:
                yield store
