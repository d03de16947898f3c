"""A run store in PostgreSQL, for a fleet of workers on many machines (docs/fleet.md).

The tables are those of every SQL store (`treadle.stores._sql`), in one schema of the database.
psycopg 3 is the driver; its async API is asyncio-only, so the store uses synchronous
connections in threads: the commit engine's committer thread owns one, and reads and control
operations run in trio worker threads on pooled ones.

**One group commit is one statement.** A batch of writes of many runs is committed by a single
statement (autocommit: it is its own transaction) whose data-modifying CTE first moves the
``runs`` rows that still hold each writer's lease generation and expected next seq (the
``UPDATE`` takes their row locks, so a concurrent takeover waits for it or wins before it),
then inserts the records of exactly those runs. A stale writer's rows are filtered in the
statement itself, never raised as an error that would abort the other runs' writes; the runs
it left out get their reason (`LeaseLost`, `ConflictError`, lost records) from one more read.

**A connection lost while committing leaves the outcome unknown.** The committer reconnects,
reads each run's ``runs`` row back and counts as committed exactly the writes that are there;
the others are tried once more on the new connection, and only then reported failed.

Expiry of leases and the queue's backoff are judged by the server's clock
(``clock_timestamp()``), so clock skew between worker machines cannot make two holders
(docs/decisions/0012-lease-protocol.md). A password in the DSN is never printed, logged or
shown (`treadle.stores._dsn.redact_dsn`).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Final

import trio

from treadle._exceptions import (
    LogCorrupted,
    SchemaTooNew,
    StoreBusy,
    StoreError,
    StoreRefused,
    StoreUnavailable,
    TreadleError,
    UsageError,
)
from treadle._trio_only import require_trio
from treadle.stores import _sql
from treadle.stores._dsn import quotes_password, redact_dsn, scrub_password
from treadle.stores._engine import BatchReport, CommitEngine, Write, fail_writes

FIRST_LAYOUT: Final = 2
"""The first layout of a PostgreSQL store (layout 1 was SQLite's alone)."""

CONNECT_TIMEOUT_S: Final = 10
"""Seconds a connection attempt may take (psycopg's ``connect_timeout``)."""

RECONNECT_FOR_S: Final = 60.0
"""Seconds the committer keeps trying to reconnect after losing its connection and to read
back on the new one which commits happened (0.2 s, 0.4 s ... apart, at most 5 s): a server
restart or a failover takes that long. Its writes wait."""

IDLE_IN_TRANSACTION_S: Final = 30
"""Seconds a connection may sit inside a transaction without a statement before the server
ends it (``idle_in_transaction_session_timeout``): a process paused in the middle of a commit
(SIGSTOP, a frozen VM) then lets go of the rows it locked, and the runs it drove can be
taken over (docs/fleet.md, "Leases")."""

KEEPALIVE: Final = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
"""libpq's TCP keepalive settings: a connection to a server that vanished without a word (a
network partition) fails within about half a minute, not the operating system's two hours."""

DDL_LOCK_TIMEOUT: Final = "10s"
"""How long creating the tables waits for a lock (the first open of a schema, or an upgrade):
refused then, rather than stalling every commit of the fleet queued behind it."""

DEFAULT_SCHEMA: Final = "public"
"""The schema the tables live in when none is given."""

_SCHEMA_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")

_TABLES: Final = (
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS runs(ord BIGSERIAL PRIMARY KEY, run_id TEXT NOT NULL UNIQUE, "
    "next_seq BIGINT NOT NULL DEFAULT 1, state TEXT, agent TEXT, agent_version TEXT, "
    "started_at TEXT, steps BIGINT NOT NULL DEFAULT 0, stop_reason TEXT, "
    "awaiting_until DOUBLE PRECISION, lease_owner TEXT NOT NULL DEFAULT '', "
    "lease_generation BIGINT NOT NULL DEFAULT 0, "
    "lease_expires DOUBLE PRECISION NOT NULL DEFAULT 0, "
    "lease_heartbeat DOUBLE PRECISION NOT NULL DEFAULT 0, "
    "control_head BIGINT NOT NULL DEFAULT 0, control_seen BIGINT NOT NULL DEFAULT 0, "
    "submitted_at DOUBLE PRECISION, submission BYTEA, claims BIGINT NOT NULL DEFAULT 0, "
    "takeovers BIGINT NOT NULL DEFAULT 0, not_before DOUBLE PRECISION NOT NULL DEFAULT 0, "
    "quarantined TEXT)",
    "CREATE INDEX IF NOT EXISTS runs_open ON runs(agent, ord) WHERE quarantined IS NULL AND "
    "state IS NOT NULL AND state NOT IN ('succeeded', 'failed', 'cancelled')",
    "CREATE TABLE IF NOT EXISTS records(run_id TEXT NOT NULL, seq BIGINT NOT NULL, "
    "gen BIGINT NOT NULL, kind TEXT NOT NULL, body BYTEA NOT NULL, crc BIGINT NOT NULL, "
    "PRIMARY KEY (run_id, seq))",
    "CREATE TABLE IF NOT EXISTS control(run_id TEXT NOT NULL, pos BIGINT NOT NULL, "
    "kind TEXT NOT NULL, body BYTEA NOT NULL, crc BIGINT NOT NULL, PRIMARY KEY (run_id, pos))",
)

_COMMIT: Final = (
    "WITH b AS (SELECT * FROM unnest(%b::text[], %b::int8[], %b::int8[], %b::int8[], "
    "%b::text[], %b::text[], %b::text[], %b::text[], %b::int8[], %b::text[], %b::bool[], "
    "%b::float8[], %b::bool[]) AS b(run_id, gen, start, stop, state, agent, agent_version, "
    "started_at, steps, stop_reason, set_until, until, unpark)), "
    "ok AS (UPDATE runs r SET next_seq = b.stop, state = COALESCE(b.state, CASE WHEN "
    "b.unpark AND r.state = 'awaiting_child' THEN 'running' ELSE r.state END), "
    "agent = COALESCE(b.agent, r.agent), agent_version = COALESCE(b.agent_version, "
    "r.agent_version), started_at = COALESCE(b.started_at, r.started_at), "
    "steps = COALESCE(b.steps, r.steps), stop_reason = COALESCE(b.stop_reason, r.stop_reason), "
    "awaiting_until = CASE WHEN b.set_until THEN b.until WHEN b.unpark AND "
    "r.state = 'awaiting_child' THEN NULL ELSE r.awaiting_until END "
    "FROM b WHERE r.run_id = b.run_id AND r.lease_generation = b.gen AND r.lease_owner <> '' "
    "AND r.next_seq = b.start "
    "RETURNING r.run_id), "
    "ins AS (INSERT INTO records(run_id, seq, gen, kind, body, crc) "
    "SELECT v.run_id, v.seq, v.gen, v.kind, v.body, v.crc FROM unnest(%b::text[], %b::int8[], "
    "%b::int8[], %b::text[], %b::bytea[], %b::int8[]) AS v(run_id, seq, gen, kind, body, crc) "
    "WHERE v.run_id IN (SELECT run_id FROM ok)) "
    "SELECT run_id FROM ok"
)
"""The group commit of one batch (see the module docstring), after `_LOCK_ROWS`."""

_LOCK_ROWS: Final = (
    'SELECT run_id FROM runs WHERE run_id = ANY(%s) ORDER BY run_id COLLATE "C" FOR UPDATE'
)
"""Locks the batch's ``runs`` rows in run id order, in the transaction of `_COMMIT`.

A batch first takes them with `_LOCK_FREE_ROWS`, which passes over rows another transaction
holds; only the runs of those rows then wait, together and at most `COMMIT_LOCK_WAIT_MS`.

The lease renewal locks them in that order too: two transactions that take the same row locks
in one order cannot deadlock. The order is code point order (Python's ``sorted``), the "C"
collation's: the database's own collation orders some ids otherwise, and a deadlock with the
renewal was seen once that way. Taken by `_COMMIT` itself, in the order of its plan, the renewal
and the commit deadlocked under load. A separate statement: locked by a part of `_COMMIT`
itself, rows the commit had waited for were refused (its update had read them before)."""

_LOCK_FREE_ROWS: Final = _LOCK_ROWS + " SKIP LOCKED"
"""`_LOCK_ROWS`, passing over the rows another transaction holds (it returns the rest)."""

CALL_LOCK_WAIT_MS: Final = 5_000
"""How long (milliseconds) a statement of the store's calls waits for a lock another
transaction holds (a row kept locked, a table locked by a migration): reads, leases, claims,
control appends and submits, not the committer's commits. It then fails with `StoreBusy`
saying so, rather than hang: a worker's lease release, its claims and its drain, and
``treadle cancel`` or ``approve``, wait that long at most (docs/fleet.md, "What each crash
does")."""

COMMIT_LOCK_WAIT_MS: Final = 2_000
"""How long (milliseconds) a run's write waits for its ``runs`` row when another transaction
holds it (an operator's open transaction, a stuck client): then the write fails with
`StoreBusy` and the run is interrupted, to be resumed (docs/fleet.md, "What each crash
does"). The other runs of the batch do not wait for it: they commit first, and the runs of
all held rows wait together, once a batch."""


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - psycopg is a dependency of the extra
        raise UsageError(
            "the PostgreSQL store needs psycopg 3: pip install 'treadle[postgres]'"
        ) from exc
    return psycopg


# --------------------------------------------------------------------------- the dialect


class PostgresDialect:
    """`treadle.stores._sql.SqlDialect` for PostgreSQL.

    Args:
        dsn: the libpq connection string or URL (its password is never shown).
        schema: the schema holding the tables.
    """

    for_update = " FOR UPDATE"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    flush_acquire = True  # a worker outlives the server's crash

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.schema = schema
        self.identity: tuple[str, ...] = ("postgresql", dsn, schema)
        self.description = f"PostgreSQL store {redact_dsn(dsn)} (schema {schema})"
        self._sql: dict[str, str] = {}

    def connect(self, application: str = "treadle", *, lock_wait_ms: int = 0) -> Any:
        """A new autocommit connection whose search path is the store's schema.

        ``lock_wait_ms``: how long its statements wait for a lock (``lock_timeout``; 0, the
        server's default, waits as long as the lock is held).
        """
        psycopg = _psycopg()
        _, other = schema_of(self.dsn)
        settings = [
            f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S}s",
            f"-c search_path={self.schema}",
        ]
        if lock_wait_ms:
            settings.append(f"-c lock_timeout={lock_wait_ms}")
        return psycopg.connect(
            self.dsn,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name=application,
            options=" ".join([*other, *settings]),
            **KEEPALIVE,
        )

    def connect_pooled(self) -> Any:
        """A new connection for the store's pool: `connect`, waiting `CALL_LOCK_WAIT_MS` for a lock.

        Raises:
            StoreUnavailable: the server refused the connection (no connection slot free:
                ``max_connections``, a role's or a database's connection limit) or could not
                be reached; the password is never shown (docs/fleet.md, "Poison runs").
        """
        psycopg = _psycopg()
        try:
            return self.connect(lock_wait_ms=CALL_LOCK_WAIT_MS)
        except psycopg.Error as exc:
            said = _translate(self.description, exc, "cannot connect to", dsn=self.dsn)
            raise StoreUnavailable(str(said)) from exc

    def sql(self, text: str) -> str:
        """``text`` with ``?`` placeholders as psycopg's ``%s``."""
        converted = self._sql.get(text)
        if converted is None:
            converted = self._sql[text] = text.replace("%", "%%").replace("?", "%s")
        return converted

    def begin_write(self, conn: Any, *, flush: bool = True) -> None:
        """``BEGIN``: row locks (``FOR UPDATE``) do the rest.

        ``flush=False`` sets ``synchronous_commit = off`` for this transaction only: its commit
        returns before its WAL is flushed, which the next flushed commit (or the WAL writer)
        does.
        """
        conn.execute("BEGIN")
        if not flush:
            conn.execute("SET LOCAL synchronous_commit = off")

    def end_write(self, conn: Any, *, flush: bool = True) -> None:
        """Nothing: row locks order the writers; ``SET LOCAL`` ended with the transaction."""

    def begin_read(self, conn: Any) -> None:
        """A repeatable-read, read-only transaction: its statements share one snapshot."""
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")

    def now(self, conn: Any) -> float:
        """The server's clock (``clock_timestamp()``), epoch seconds."""
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        return float(row[0])

    def error(self, exc: BaseException, what: str) -> TreadleError | None:
        """Psycopg errors as `StoreError` (`LogCorrupted` for data corruption)."""
        return _translate(self.description, exc, what)

    def lost(self, exc: BaseException, conn: Any) -> bool:
        """Whether ``exc`` cost ``conn`` its connection (`_connection_lost`)."""
        return _connection_lost(exc, conn)


def _translate(
    description: str, exc: BaseException, what: str, *, dsn: str | None = None
) -> TreadleError | None:
    """``exc`` as the treadle error saying ``what`` failed on the store ``description``.

    ``None`` when ``exc`` is no psycopg error. With ``dsn`` (a failed connection to it),
    what libpq's message quotes of its passwords is hidden (`scrub_password`); the store's
    description, which shows the DSN redacted already, is left whole, so the message names
    the user, host and database it tried (docs/fleet.md, "Stores").
    """
    psycopg = _psycopg()
    if not isinstance(exc, psycopg.Error):
        return None
    message = _first_line(exc)
    if dsn is not None:
        message = scrub_password(message, dsn)
    if isinstance(exc, psycopg.errors.DataCorrupted | psycopg.errors.IndexCorrupted):
        return LogCorrupted(f"the database is damaged: {message}", where=description, offset=None)
    errors = psycopg.errors
    if _sql.lock_timeout(exc):
        return StoreBusy(
            f"{what} {description}: another transaction kept a lock this needs for more than "
            f"{CALL_LOCK_WAIT_MS / 1000:g} s ({message}); try again once it has let go"
        )
    if isinstance(
        exc,
        errors.InsufficientPrivilege
        | errors.UndefinedTable
        | errors.UndefinedColumn
        | errors.UndefinedFunction
        | errors.ReadOnlySqlTransaction,
    ):
        return StoreRefused(f"{what} {description}: {message}")
    return StoreError(f"{what} {description}: {message}")


def _connection_lost(exc: BaseException, conn: Any) -> bool:
    """Whether ``exc`` cost ``conn`` its connection (`treadle.stores._sql.SqlDialect.lost`).

    Lost: the server ended the session (its restart, ``pg_terminate_backend``) or the
    network dropped it. A statement the server ended (a statement timeout, a deadlock's
    victim) is an `OperationalError` too, but leaves the connection as it was.
    """
    psycopg = _psycopg()
    if _sql.deadlock(exc):
        return False
    lost = isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return lost and bool(conn.closed or conn.broken)


# --------------------------------------------------------------------------- the schema


def _ensure_schema(dialect: PostgresDialect, conn: Any, *, create: bool) -> None:
    """Create the tables when missing (``create``), mark layouts 2 and 3 as 4, refuse newer.

    Every open marks an older layout, a reading command's (``create=False``) too, as SQLite's
    does: rows this treadle writes may hold fields of record schema 3, and the mark makes an
    older treadle refuse the schema (`SchemaTooNew`) instead of reading them as damage
    (docs/crash-safety.md, "Versions"). A schema already at this layout is only read:
    creating what exists would still take locks on its tables (``CREATE INDEX IF NOT EXISTS``
    waits for writers to finish, and every commit then waits behind it).

    Raises:
        StoreError: no store in the schema and ``create`` is false, or a layout no PostgreSQL
            store had.
        StoreRefused: an older layout that this role (or a read-only server) may not mark.
        SchemaTooNew: the schema was laid out by a newer treadle.
    """
    layout = _current_layout(conn)
    if layout is None:
        if not create:
            raise _no_store(dialect)
        layout = _create_tables(dialect, conn)
    elif layout != _sql.LAYOUT_VERSION:
        _check_layout(layout, dialect)
        layout = _mark_layout(dialect, conn, layout)
    _check_layout(layout, dialect)


def _no_store(dialect: PostgresDialect) -> StoreError:
    return StoreError(
        f"no treadle store in {dialect.description}: schema {dialect.schema!r} has no "
        "treadle tables (a worker, `treadle submit` or `treadle.open_postgres_store` "
        "creates them)"
    )


def _create_tables(dialect: PostgresDialect, conn: Any) -> int:
    """Create the schema and its tables (once, under an advisory lock); the layout after.

    Another treadle may create them at the same time: the lock orders the two, and one of an
    older layout is marked as `_mark_layout` does.
    """
    psycopg = _psycopg()
    with _schema_transaction(conn):
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"treadle:{dialect.schema}",))
        conn.execute(
            psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                psycopg.sql.Identifier(dialect.schema)
            )
        )
        for statement in _TABLES:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO meta(key, value) VALUES ('layout', %s), ('created', %s) "
            "ON CONFLICT (key) DO NOTHING",
            (str(_sql.LAYOUT_VERSION), repr(time.time())),
        )
        return _marked_layout(conn)


def _mark_layout(dialect: PostgresDialect, conn: Any, layout: int) -> int:
    """Mark a schema of ``layout`` 2 or 3 as this treadle's layout; the layout after.

    Safe when several treadles open the schema at once: the second ``UPDATE`` waits for the
    first one's row lock, then finds the layout changed and changes nothing.

    Raises:
        StoreRefused: the role may not update the ``meta`` table, or the server is read-only:
            the schema is left unmarked and the store is not opened, since this treadle's rows
            in an unmarked schema would read as damage to an older treadle; a role that may
            update ``meta`` opens it once, and after that any role may.
    """
    errors = _psycopg().errors
    try:
        with _schema_transaction(conn):
            return _marked_layout(conn)
    except (errors.InsufficientPrivilege, errors.ReadOnlySqlTransaction) as exc:
        raise StoreRefused(
            f"cannot open {dialect.description}: its tables are of the layout "
            f"{layout}, which this treadle marks {_sql.LAYOUT_VERSION} before "
            f"writing to them, and the server refused the mark ({_first_line(exc)}); open it "
            "once with a role that may update its meta table"
        ) from None


def _marked_layout(conn: Any) -> int:
    """Mark layouts 2 and 3 as 4 (inside the caller's transaction); the layout after.

    Layouts 2 and 3 to 4 change no table: new rows are compact-encoded (layout 3) and may hold
    fields of record schema 3 (layout 4), old ones are read as they are
    (docs/decisions/0085-compact-log-records.md; docs/crash-safety.md, "Versions").
    """
    conn.execute(
        "UPDATE meta SET value = %s WHERE key = 'layout' AND value IN ('2', '3')",
        (str(_sql.LAYOUT_VERSION),),
    )
    row = conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
    return _sql.layout_of(row[0])


@contextlib.contextmanager
def _schema_transaction(conn: Any) -> Iterator[None]:
    """A transaction that waits at most `DDL_LOCK_TIMEOUT` for a lock; rolled back on error."""
    conn.execute("BEGIN")
    try:
        conn.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
        yield
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            conn.execute("ROLLBACK")
        raise


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _check_layout(layout: int, dialect: PostgresDialect) -> None:
    """Refuse a layout newer than this treadle's, or one no PostgreSQL store had.

    Raises:
        SchemaTooNew: the schema was laid out by a newer treadle.
        StoreError: a layout below `FIRST_LAYOUT` (its meta table was changed by hand).
    """
    if layout > _sql.LAYOUT_VERSION:
        where = f"the table layout of {dialect.description}"
        raise SchemaTooNew(layout, _sql.LAYOUT_VERSION, what=where)
    if layout < FIRST_LAYOUT:
        raise StoreError(
            f"not a readable treadle store: its meta table holds the layout {layout}, which no "
            f"PostgreSQL store had (the first was {FIRST_LAYOUT}); the table was changed by hand"
        )


def _current_layout(conn: Any) -> int | None:
    """The schema's layout when its ``meta`` table says; ``None`` when there is none yet."""
    psycopg = _psycopg()
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
    except psycopg.errors.UndefinedTable:  # a new schema (autocommit: nothing to roll back)
        return None
    return None if row is None else _sql.layout_of(row[0])


# --------------------------------------------------------------------------- the committer


class PostgresBackend(_sql.SqlBackend):
    """The committer side of the PostgreSQL store: one statement per batch (`_COMMIT`)."""

    def __init__(self, dialect: PostgresDialect, conn: Any, pool: _sql.ConnectionPool) -> None:
        super().__init__(dialect, pool)
        self._dialect: PostgresDialect = dialect
        self._conn = conn

    commits_here = False
    """A commit is a round trip to the server (and may wait for a row lock): never in the
    trio thread."""

    def commit_here(self, batch: list[Write]) -> None:
        """Never commits in the trio thread (see ``commits_here``)."""
        return None

    def commit(self, batch: list[Write]) -> BatchReport:
        """Commit ``batch`` with one statement; reconcile when the connection drops."""
        groups = _sql.group_by_run(batch)
        if not groups:
            return BatchReport()
        held: list[_sql.RunBatch] = []
        try:
            committed = self._statement(groups, held=held)
        except Exception as exc:
            held.clear()  # every group is dealt with below
            if not self._lost(exc):
                committed = self._each(groups, exc)
            else:
                committed = self._reconcile(groups, exc)
        if held:  # their rows were locked elsewhere: they wait together, bounded
            committed |= self._held(held)
        self._refuse_others(groups, committed)
        return BatchReport(syncs=1 if committed else 0)

    def _each(self, groups: Sequence[_sql.RunBatch], failure: Exception) -> set[str]:
        """After ``failure`` of a statement for ``groups``: commit each run's writes alone.

        One run's writes can fail a statement for all (a record past the server's size
        limit, a statement timeout on its row): the others must not fail with it
        (docs/fleet.md, "What each crash does"). A batch of one run fails as it is.
        """
        if len(groups) == 1:
            self._fail(groups, failure)
            return set()
        committed: set[str] = set()
        for group in groups:
            committed |= self._alone(group)
        return committed

    def _held(self, held: list[_sql.RunBatch]) -> set[str]:
        """Commit the runs whose rows another transaction held when the batch took its rows.

        One wait for all of them, at most `COMMIT_LOCK_WAIT_MS`; then the rows free by then
        are committed and the runs of those still held fail (`_locked`): the batch waits
        that long once, however many rows are held.
        """
        try:
            return self._statement(held)
        except Exception as exc:
            if self._lost(exc):
                return self._reconcile(held, exc)
            if not _sql.lock_timeout(exc):
                return self._each(held, exc)
        still: list[_sql.RunBatch] = []
        try:
            committed = self._statement(held, held=still)
        except Exception as exc:
            if self._lost(exc):
                return self._reconcile(held, exc)
            self._fail(held, exc)
            return set()
        for group in still:
            self._locked(group)
        return committed

    def _alone(self, group: _sql.RunBatch) -> set[str]:
        """Commit one run's writes in their own transaction (waiting for its row, bounded)."""
        try:
            return self._statement([group])
        except Exception as exc:
            if self._lost(exc) and self._read_back([group], exc):
                return {group.run_id}
            if _failed(group):  # the read-back failed them
                return set()
            if _sql.lock_timeout(exc):
                self._locked(group, exc)
                return set()
            self._fail([group], exc)
            return set()

    def _locked(self, group: _sql.RunBatch, cause: BaseException | None = None) -> None:
        """Fail ``group``'s writes: its run's row stayed locked past `COMMIT_LOCK_WAIT_MS`."""
        error = StoreBusy(
            f"cannot write to {self.description}: the row of run {group.run_id!r} stayed "
            f"locked by another transaction for {COMMIT_LOCK_WAIT_MS / 1000:g} s; nothing of "
            "the write was stored"
        )
        error.__cause__ = cause
        fail_writes(group.writes, error)

    def _lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` cost the committer its connection.

        A statement the server ended (a statement timeout) is an `OperationalError` too, but
        leaves the connection as it was: no reconnect, and no wait for one.
        """
        return _connection_lost(exc, self._conn)

    def _fail(self, groups: Sequence[_sql.RunBatch], exc: Exception) -> None:
        """Fail every write of ``groups`` with the `StoreError` for ``exc`` (or raise it)."""
        error = _translate(self.description, exc, "cannot write to")
        if error is None:
            raise exc
        error.__cause__ = exc
        for group in groups:
            fail_writes(group.writes, error)

    def _statement(
        self, groups: Sequence[_sql.RunBatch], *, held: list[_sql.RunBatch] | None = None
    ) -> set[str]:
        """Run `_COMMIT`; one the server ended as a deadlock victim is run again.

        The rows are locked first, in run id order (`_LOCK_ROWS`). A deadlock rolls the
        transaction back whole, so running it again writes each record once; the lock order
        avoids deadlocks with the renewal, this covers other programs' transactions.

        With ``held`` the rows another transaction holds are passed over (`_LOCK_FREE_ROWS`):
        their runs' groups are left out of the commit and put in ``held``. Without it the
        rows are waited for, up to `COMMIT_LOCK_WAIT_MS` (then lock_not_available, 55P03).
        """
        ids = sorted(g.run_id for g in groups)

        def transaction() -> set[str]:
            conn = self._conn
            with conn.transaction():
                kept = groups
                if held is None:
                    conn.execute(f"SET LOCAL lock_timeout = '{COMMIT_LOCK_WAIT_MS}ms'")
                    conn.execute(_LOCK_ROWS, (ids,))
                else:
                    held.clear()  # (a deadlock's retry starts over)
                    free = {row[0] for row in conn.execute(_LOCK_FREE_ROWS, (ids,))}
                    if len(free) < len(groups):
                        kept = [g for g in groups if g.run_id in free]
                        held.extend(g for g in groups if g.run_id not in free)
                        if not kept:
                            return set()
                return {row[0] for row in conn.execute(_COMMIT, _commit_params(kept)).fetchall()}

        return _sql.again_on_deadlock(transaction)

    def _reconcile(self, groups: list[_sql.RunBatch], lost: Exception) -> set[str]:
        """After a lost connection: count what committed, retry the rest once, then report.

        The writes of a run whose retry lost the connection again, and did not commit, fail
        with that error (docs/fleet.md, "What each crash does").

        Raises:
            StoreError: no new connection could read back what committed within
                `RECONNECT_FOR_S` (`_read_back`); the committer stops.
        """
        committed = self._read_back(groups, lost)
        rest = [g for g in groups if g.run_id not in committed and not _failed(g)]
        if not rest:
            return committed
        try:
            return committed | self._statement(rest)
        except Exception as exc:
            if not self._lost(exc):
                return committed | self._each(rest, exc)
            committed |= self._read_back(rest, exc)
            self._fail([g for g in rest if g.run_id not in committed], exc)
            return committed

    def _read_back(self, groups: Sequence[_sql.RunBatch], lost: Exception) -> set[str]:
        """Connect again after ``lost`` and read back which runs of ``groups`` committed.

        Connecting and reading back share one window of `RECONNECT_FOR_S`: a read-back
        that loses its new connection too (the server restarting again, connections ended
        by an administrator) is tried again on another, at the same growing delays as a
        refused connection (0.2 s, 0.4 s ... at most 5 s; docs/fleet.md, "What each crash
        does"). A read-back the server refuses for another reason (a privilege revoked, a
        statement timeout) leaves the outcome unknown: the writes of ``groups`` fail with
        it, and nothing of them counts as committed.

        Returns:
            The run ids whose writes of ``groups`` are stored (`_committed`).

        Raises:
            StoreError: no connection read back within `RECONNECT_FOR_S` (the committer then
                stops, and every writer gets this error).
        """
        delay = 0.2
        give_up = time.monotonic() + RECONNECT_FOR_S
        while True:
            try:
                self._connect()
            except Exception as exc:  # refused, timed out ...: the server may come back
                lost = exc
            else:
                try:
                    return self._committed(groups)
                except Exception as exc:
                    if not self._lost(exc):
                        self._fail(groups, exc)
                        return set()
                    lost = exc
            if time.monotonic() + delay > give_up:
                raise StoreError(
                    f"{self.description}: the connection was lost while committing and "
                    f"could not be made again in {RECONNECT_FOR_S:g} s to read back what "
                    f"was committed ({lost})"
                ) from lost
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _connect(self) -> None:
        """Replace the committer's connection with a new one; a failure keeps the old, closed."""
        with contextlib.suppress(Exception):
            self._conn.close()
        self._conn = self._dialect.connect("treadle committer")

    def _committed(self, groups: Sequence[_sql.RunBatch]) -> set[str]:
        """The runs whose writes of ``groups`` are in the database (read after a reconnect)."""
        rows = self._conn.execute(
            "SELECT run_id, next_seq, lease_generation FROM runs WHERE run_id = ANY(%s)",
            ([g.run_id for g in groups],),
        ).fetchall()
        stored = {r[0]: (int(r[1]), int(r[2])) for r in rows}
        done = set()
        for group in groups:
            found = stored.get(group.run_id)
            if found is not None and found[0] >= group.stop and found[1] == group.generation:
                last = self._conn.execute(
                    "SELECT gen FROM records WHERE run_id = %s AND seq = %s",
                    (group.run_id, group.stop - 1),
                ).fetchone()
                if last is not None and int(last[0]) == group.generation:
                    done.add(group.run_id)
        return done

    def _refuse_others(self, groups: Sequence[_sql.RunBatch], committed: set[str]) -> None:
        refused = [g for g in groups if g.run_id not in committed and not _failed(g)]
        if not refused:
            return
        try:
            rows = self._conn.execute(
                "SELECT run_id, next_seq, lease_generation, lease_owner FROM runs "
                "WHERE run_id = ANY(%s)",
                ([g.run_id for g in refused],),
            ).fetchall()
            stored = {r[0]: (int(r[1]), int(r[2]), r[3]) for r in rows}
        except Exception:  # the reasons only: the writes were refused either way
            stored = {}
        for group in refused:
            reason = _sql.refusal(group, stored.get(group.run_id), self.description)
            fail_writes(
                group.writes,
                reason or StoreError(f"{self.description}: run {group.run_id!r}: write refused"),
            )

    def finish(self) -> BatchReport:
        """Close the committer's connection."""
        with contextlib.suppress(Exception):
            self._conn.close()
        return BatchReport()


def _failed(group: _sql.RunBatch) -> bool:
    return any(w.error is not None for w in group.writes)


def _commit_params(groups: Sequence[_sql.RunBatch]) -> list[list[Any]]:
    """The 19 array parameters of `_COMMIT`: 13 per run, 6 per record."""
    runs: list[list[Any]] = [[] for _ in range(13)]
    records: list[list[Any]] = [[] for _ in range(6)]
    for group in groups:
        stop, state, agent, version, started, steps, reason, set_until, until, run_id = (
            _sql.index_params(group)
        )
        for column, value in zip(
            runs,
            (
                run_id,
                group.generation,
                group.start,
                stop,
                state,
                agent,
                version,
                started,
                steps,
                reason,
                set_until,
                until,
                bool(group.delta.unpark),
            ),
            strict=True,
        ):
            column.append(value)
        for row in group.rows:
            for column, value in zip(records, row, strict=True):
                column.append(value)
    return [*runs, *records]


# --------------------------------------------------------------------------- opening


_SEARCH_PATH: Final = re.compile(r"(?:-c\s*|--)search_path=(\S+)")


def schema_of(dsn: str) -> tuple[str | None, list[str]]:
    """The schema a DSN's ``options`` name (``-c search_path=NAME``), and its other options.

    So ``postgresql://…/db?options=-csearch_path%3Dtenant_a`` (or ``options='-c
    search_path=tenant_a'`` in keyword form) opens the store in schema ``tenant_a``, from any
    command that takes ``--store``.
    """
    try:
        from psycopg.conninfo import conninfo_to_dict

        options = str(conninfo_to_dict(dsn).get("options") or "")
    except Exception:  # not parseable here: psycopg reports it when connecting
        return None, []
    found = _SEARCH_PATH.search(options)
    rest = _SEARCH_PATH.sub("", options).split()
    return (found.group(1).split(",")[0] if found else None), rest


def _check_readable(dsn: str) -> None:
    """Refuse a DSN libpq cannot read, without quoting it (the quote is of its password).

    The hint on writing a URL's password is given when the password is the likely cause:
    libpq's complaint quotes it (a raw ``%`` or space), or it holds a raw ``@`` or ``/``.
    Otherwise (a misspelt query parameter, an unclosed ``[``, any ``key=value`` error) the
    message is libpq's own, the password hidden as in every message about the store.

    Raises:
        UsageError: ``dsn`` is malformed, or is a URL whose user information holds a raw
            ``@`` or ``/`` (libpq would read a piece of the password as the host).
    """
    url = "://" in dsn
    try:
        _psycopg().conninfo.conninfo_to_dict(dsn)
    except _psycopg().ProgrammingError as exc:
        said = _first_line(exc)
        misread = url and quotes_password(said, dsn)
        if not misread:
            said = redact_dsn(scrub_password(said, dsn))
            raise UsageError(
                f"the PostgreSQL DSN {redact_dsn(dsn)} cannot be read: {said}"
            ) from None
    else:
        # libpq ends a URL's user information at its first '@' (and its host at the first
        # '/'): a raw '@' or '/' before the last '@' connects elsewhere, and names a piece of
        # the password as the host in its error
        userinfo = dsn.split("://", 1)[-1].split("?", 1)[0].rpartition("@")[0]
        misread = url and ("@" in userinfo or "/" in userinfo)
    if misread:
        raise UsageError(
            f"the PostgreSQL DSN {redact_dsn(dsn)} cannot be read: in a URL, a '%', a "
            "space, a '/' or an '@' in the password is written %25, %20, %2F or %40"
        )


def _check_schema_name(schema: str) -> str:
    if _SCHEMA_NAME.fullmatch(schema) is None:
        raise UsageError(
            f"invalid schema name {schema!r}: lower-case letters, digits and _ (at most 63)"
        )
    return schema


def _open(dsn: str, schema: str, create: bool) -> tuple[PostgresDialect, Any]:
    _check_readable(dsn)
    dialect = PostgresDialect(dsn, schema)
    try:
        conn = dialect.connect("treadle committer")
    except Exception as exc:
        error = _translate(dialect.description, exc, "cannot connect to", dsn=dsn)
        if error is None:
            raise
        raise StoreError(str(error)) from None
    try:
        _ensure_schema(dialect, conn, create=create)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.close()
        error = (
            _translate(dialect.description, exc, "cannot open")
            if isinstance(exc, Exception)
            else None
        )
        if error is None:
            raise
        raise error from exc
    return dialect, conn


class PostgresStore(_sql.SqlStore):
    """A run store in a PostgreSQL database; every capability (the fleet's queue included).

    Open it with `open_postgres_store`, inside a trio run; the store belongs to that trio run.
    Any number of processes on any number of machines may open the same database and schema:
    leases keep each run to one driver, and the queue hands each claimable run to one worker
    (``FOR UPDATE SKIP LOCKED``). See `treadle.stores._sql.SqlStore` for what every write
    raises, and docs/fleet.md for what the guarantee needs from the server.
    """

    @classmethod
    async def open(
        cls, dsn: str, *, schema: str | None = None, create: bool = True
    ) -> PostgresStore:
        """Connect, create the tables if needed, and start the committer thread.

        Args:
            dsn: a libpq connection string or ``postgresql://`` URL.
            schema: the schema holding the tables (created when missing); ``None`` takes the
                one the DSN's ``options`` name (``-c search_path=NAME``, `schema_of`), else
                ``public``.
            create: create the schema and its tables when missing; ``False`` refuses a schema
                without them instead (reading commands must not leave tables in a database
                they were pointed at by mistake). A schema of an older layout (2 or 3) is
                marked with this treadle's whatever ``create`` says (docs/crash-safety.md,
                "Versions").

        Returns:
            The open store; the caller owns it and must `aclose` it.

        Raises:
            StoreError: the server cannot be reached or refuses the connection (the message
                never holds the password); with ``create=False``, the schema holds no store.
            StoreRefused: the schema is of an older layout and the server refused to mark it
                (the role may not update its ``meta`` table, or the server is read-only).
            SchemaTooNew: the schema was laid out by a newer treadle.
            UsageError: an invalid schema name, or psycopg is not installed.
        """
        chosen = _check_schema_name(schema or schema_of(dsn)[0] or DEFAULT_SCHEMA)
        token = trio.lowlevel.current_trio_token()
        dialect, conn = await trio.to_thread.run_sync(_open, dsn, chosen, create)
        pool = _sql.ConnectionPool(dialect.connect_pooled)
        engine = CommitEngine(PostgresBackend(dialect, conn, pool), token, remote=True)
        return cls(dialect, engine, pool)


@contextlib.asynccontextmanager
async def open_postgres_store(
    dsn: str, *, schema: str | None = None, create: bool = True
) -> AsyncIterator[PostgresStore]:
    """Open a `PostgresStore` for the duration of an ``async with`` block, then `aclose` it.

    Args:
        dsn: a libpq connection string or ``postgresql://`` URL.
        schema: the schema holding the tables (see `PostgresStore.open`).
        create: create the tables when missing (see `PostgresStore.open`).

    Yields:
        The open store.

    Raises:
        StoreError: as `PostgresStore.open` and `PostgresStore.aclose`.
    """
    require_trio("treadle.open_postgres_store")
    store = await PostgresStore.open(dsn, schema=schema, create=create)
    try:
        yield store
    finally:
        await store.aclose()
