"""A throwaway PostgreSQL database for tests and benchmarks.

`fresh_database` creates a database with a random name on a server, yields its DSN, and drops
it afterwards, so that each test (or benchmark run) gets an empty store of its own, also when
the code under test starts other processes that connect to it by DSN (``treadle worker
--store DSN``, docs/fleet.md). It needs ``psycopg`` (``pip install 'treadle[postgres]'``) and a
role allowed to create databases.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

DROP_WAITS_S: Final = (0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0)
"""Seconds between the tries to drop the database (see `fresh_database`)."""


@contextmanager
def fresh_database(dsn: str, *, prefix: str = "treadle_test") -> Iterator[str]:
    """Create a new, empty database on ``dsn``'s server; yield its DSN; drop it afterwards.

    Args:
        dsn: a connection string of the server (any database of it the role may connect to).
        prefix: the start of the new database's name (a random hex suffix follows).

    Yields:
        The new database's connection string (``dsn`` with another ``dbname``).

    Raises:
        psycopg.Error: the database cannot be created, or still cannot be dropped after
            the waits of `DROP_WAITS_S`. ``DROP DATABASE ... WITH (FORCE)`` ends the sessions
            still connected to it (a killed worker's, say), but not an autovacuum worker
            that the server started in it under its own role; that one ends by itself, so
            the drop is tried again.
    """
    import psycopg
    from psycopg import conninfo, sql

    name = f"{prefix}_{secrets.token_hex(6)}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield conninfo.make_conninfo(dsn, dbname=name)
        finally:
            drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            for wait_s in (*DROP_WAITS_S, None):
                try:
                    admin.execute(drop)
                    break
                except psycopg.errors.InsufficientPrivilege:
                    if wait_s is None:
                        raise
                    time.sleep(wait_s)
