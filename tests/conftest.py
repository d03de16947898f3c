"""Fixtures shared by the whole suite: a real PostgreSQL server for the tests that need one,
and a store a fleet can run on (SQLite or that server).

The server comes from ``TREADLE_TEST_POSTGRES`` (a DSN; `.ci/run` starts one on 127.0.0.1 and
sets it), else from the default local DSN below. Without a server, those tests skip, except
in CI (``CI`` set), where a missing server fails them loudly.

The suite also sends Ctrl-C (SIGINT) to processes it starts. A suite started with SIGINT
ignored (a background job of a shell without job control, ``nohup``) would pass that on to
them, and they would ignore it too; `pytest_configure` gives the suite Python's own handler
back, so its children start with the default.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Undo an inherited ``SIG_IGN`` of SIGINT (see the module's docstring)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


DEFAULT_DSN = "postgresql://treadle:treadle@127.0.0.1:5432/treadle_test"


def _reachable(dsn: str) -> str | None:
    """``None`` when a connection to ``dsn`` works, else why not."""
    try:
        import psycopg
    except ImportError as exc:
        return f"psycopg is not installed ({exc})"
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        return f"no PostgreSQL at {dsn.split('@')[-1]}: {exc}"
    return None


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """A DSN of a reachable PostgreSQL database (skip or, in CI, fail without one)."""
    dsn = os.environ.get("TREADLE_TEST_POSTGRES", DEFAULT_DSN)
    why = _reachable(dsn)
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the PostgreSQL tests: {why}")
        pytest.skip(why)
    return dsn


@pytest.fixture
def postgres_schema(postgres_dsn: str) -> Iterator[str]:
    """A fresh, empty schema for one test (dropped afterwards)."""
    import psycopg

    schema = f"t_{secrets.token_hex(6)}"
    yield schema
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def postgres_database(postgres_dsn: str) -> Iterator[str]:
    """The DSN of a fresh, empty database for one test (dropped afterwards).

    For tests that hand a DSN to other processes (``treadle worker --store DSN``): the store
    lives in the database's default schema.
    """
    from treadle.testing.postgres import fresh_database

    with fresh_database(postgres_dsn, prefix="t") as dsn:
        yield dsn


@pytest.fixture(params=["sqlite", "postgres"])
async def fleet_store(request, tmp_path):
    """A store with every capability a fleet needs: SQLite in ``tmp_path``, then PostgreSQL
    (a schema of its own on the test server)."""
    if request.param == "sqlite":
        from treadle.stores.sqlite import open_sqlite_store

        async with open_sqlite_store(tmp_path / "fleet.db") as opened:
            yield opened
        return
    from treadle.stores.postgres import open_postgres_store

    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")
    async with open_postgres_store(dsn, schema=schema) as opened:
        yield opened
