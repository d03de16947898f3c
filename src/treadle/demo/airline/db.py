"""The airline database: one SQLite file per conversation, holding JSON documents.

Tables ``users``, ``reservations`` and ``flights`` each hold one JSON document per record,
keyed by its id, in insertion order (``seq``); documents keep their key order because the
tools' outputs show it. ``applied_actions(intent_id PRIMARY KEY, tool, output)`` records
every database-changing tool call, written in the same transaction as its change, so a call
is applied at most once per idempotency key and its output can be looked up afterwards
(`reconcile`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from treadle.demo.airline.data import TABLES, AirlineData
from treadle.types import JSONValue

_SCHEMA: Final = (
    *(
        f"CREATE TABLE {name} (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, doc TEXT NOT NULL)"
        for name in TABLES
    ),
    "CREATE TABLE applied_actions (intent_id TEXT PRIMARY KEY, tool TEXT NOT NULL, "
    "output TEXT NOT NULL)",
)

BUSY_TIMEOUT_S: Final = 30.0
"""How long a connection waits for another writer's lock before failing, in seconds."""


def _check_table(table: str) -> str:
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    return table


class Documents:
    """Document access inside one open transaction (see `AirlineDatabase.transaction`).

    Documents are decoded fresh on every read: changing a returned dict changes nothing
    until it is written back with `put`.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def get(self, table: str, key: str) -> dict[str, Any] | None:
        """Return the document with id ``key`` of ``table``, or ``None`` when absent."""
        row = self._conn.execute(
            f"SELECT doc FROM {_check_table(table)} WHERE id = ?", (key,)
        ).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def all(self, table: str) -> list[tuple[str, dict[str, Any]]]:
        """Return every ``(id, document)`` of ``table`` in insertion order."""
        rows = self._conn.execute(f"SELECT id, doc FROM {_check_table(table)} ORDER BY seq")
        return [(key, json.loads(doc)) for key, doc in rows]

    def put(self, table: str, key: str, doc: JSONValue) -> None:
        """Insert the document, or replace it keeping its position, under id ``key``."""
        self._conn.execute(
            f"INSERT INTO {_check_table(table)} (id, doc) VALUES (?, ?) "
            "ON CONFLICT (id) DO UPDATE SET doc = excluded.doc",
            (key, json.dumps(doc)),
        )

    def applied(self, intent_id: str) -> tuple[str, str] | None:
        """Return ``(tool, output)`` stored for an applied intent, or ``None``."""
        row = self._conn.execute(
            "SELECT tool, output FROM applied_actions WHERE intent_id = ?", (intent_id,)
        ).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    def record_applied(self, intent_id: str, tool: str, output: str) -> None:
        """Store that ``intent_id`` was applied by ``tool`` with ``output``.

        Raises:
            sqlite3.IntegrityError: when the intent is already recorded.
        """
        self._conn.execute(
            "INSERT INTO applied_actions (intent_id, tool, output) VALUES (?, ?, ?)",
            (intent_id, tool, output),
        )


class AirlineDatabase:
    """An airline database file. Connections are opened per transaction and closed after.

    Several processes may use the same file: writes take SQLite's write lock for the whole
    transaction (``BEGIN IMMEDIATE``).

    Attributes:
        path: the SQLite file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"AirlineDatabase({str(self.path)!r})"

    @classmethod
    def create(cls, path: str | os.PathLike[str], data: AirlineData) -> AirlineDatabase:
        """Build a fresh database file from loaded workload data.

        Args:
            path: the file to create; its folder must exist.
            data: users, reservations and flights (see `load_data`).

        Returns:
            The new database.

        Raises:
            FileExistsError: when ``path`` already exists (an existing conversation's
                database is never overwritten).
        """
        target = Path(path)
        if target.exists():
            raise FileExistsError(f"{target}: a database already exists there")
        db = cls(target)
        with db._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            for name, documents in data.tables():
                conn.executemany(
                    f"INSERT INTO {name} (id, doc) VALUES (?, ?)",
                    ((key, json.dumps(doc)) for key, doc in documents.items()),
                )
            conn.execute("COMMIT")
        return db

    def copy_to(self, path: str | os.PathLike[str]) -> AirlineDatabase:
        """Copy this database (bookkeeping included) to a new file.

        Building one fresh database and copying it per conversation is faster than
        building each from JSON.

        Raises:
            FileExistsError: when ``path`` already exists.
        """
        target = Path(path)
        if target.exists():
            raise FileExistsError(f"{target}: a database already exists there")
        with self._connection() as src, contextlib.closing(sqlite3.connect(target)) as dst:
            src.backup(dst)
        return AirlineDatabase(target)

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            yield conn
        finally:
            conn.close()

    @contextlib.contextmanager
    def transaction(self, *, write: bool) -> Iterator[Documents]:
        """Run a block in one SQLite transaction.

        Committed when the block ends normally, rolled back when it raises (the exception
        propagates).

        Args:
            write: take the write lock at the start (``BEGIN IMMEDIATE``), so the reads of a
                read-modify-write block see no concurrent change.

        Yields:
            Document access bound to the transaction.

        Raises:
            FileNotFoundError: when the database file does not exist.
            sqlite3.Error: when SQLite fails (e.g. the lock wait exceeds `BUSY_TIMEOUT_S`).
        """
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no airline database there")
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield Documents(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def snapshot(self) -> dict[str, dict[str, JSONValue]]:
        """Return the data content: table name -> id -> document, in insertion order.

        The ``applied_actions`` bookkeeping is not part of it.
        """
        with self.transaction(write=False) as docs:
            return {name: dict(docs.all(name)) for name in TABLES}

    def data_hash(self) -> str:
        """Return `content_hash` of `snapshot` (hex SHA-256), computed row by row.

        Each row's part is cached by its stored text, so hashing many copies of one
        database costs little more than reading their rows.
        """
        tables = []
        with self._connection() as conn:
            for name in sorted(TABLES):
                rows = sorted(conn.execute(f"SELECT id, doc FROM {name}"))
                parts = [_tuple_repr([repr(key), _row_repr(doc)]) for key, doc in rows]
                tables.append(_tuple_repr([repr(name), _tuple_repr(parts)]))
        return hashlib.sha256(_tuple_repr(tables).encode("utf-8")).hexdigest()

    def applied_actions(self) -> list[tuple[str, str, str]]:
        """Return every recorded ``(intent_id, tool, output)``, ordered by intent id."""
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT intent_id, tool, output FROM applied_actions ORDER BY intent_id"
            )
            return [(str(a), str(b), str(c)) for a, b, c in rows]


def reconcile(db: AirlineDatabase, intent_id: str) -> str | None:
    """Find out what happened to a database-changing action whose outcome is unknown.

    Args:
        db: the conversation's database.
        intent_id: the idempotency key the action was (or may have been) called with.

    Returns:
        The stored output text when the action was applied (its change is then in the
        database), ``None`` when it was not (nothing of it is in the database).
    """
    with db.transaction(write=False) as docs:
        found = docs.applied(intent_id)
    return None if found is None else found[1]


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple((key, _hashable(v)) for key, v in sorted(value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _tuple_repr(parts: list[str]) -> str:
    """``repr`` of a tuple whose items have the given reprs."""
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


@functools.lru_cache(maxsize=16384)
def _row_repr(doc: str) -> str:
    return repr(_hashable(json.loads(doc)))


def content_hash(value: JSONValue) -> str:
    """Hash JSON data the way the benchmark hashes its database.

    Dict keys are sorted (key order does not count), list order counts, and ``1`` and
    ``1.0`` differ. The result equals the benchmark's recorded ``gt_data_hash`` for the
    same database content.

    Returns:
        The hex SHA-256 digest (64 characters).
    """
    return hashlib.sha256(str(_hashable(value)).encode("utf-8")).hexdigest()
