"""The embedded default run store: one SQLite database file in WAL mode, with group commit.

The tables are those of every SQL store (`treadle.stores._sql`, layout version 3). Several
processes on one machine may open the same file: leases, fencing and the fleet's queue live in
the database, and expiry is judged by the machine's wall clock.

Threads: the store's commit engine owns the only writer connection in its committer thread;
every run using the store hands its writes to it, and each batch is ONE transaction (group
commit). Reads and control operations run in trio worker threads on their own connections, so
a reader (in this process or another one) never waits for the writer and only ever sees
committed transactions.

Damage (docs/crash-safety.md, "What the SQLite store detects"): every record row carries a
CRC-32, each run's row counts its records, and the creation marker is checkpointed into the
main file when the store is made, so a store is never again taken for a new one. The committer
checks before each transaction that the database file and its WAL are still the files it
opened: one removed or replaced while the store is open stops every writer with `StoreError`
instead of acknowledging writes into a file nobody will read. A WAL deleted before its
checkpoint, or damaged (SQLite drops every frame from the first whose checksum fails), loses
its transactions without an error: the log reads consistently shorter.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import attrs
import trio

from treadle._exceptions import (
    ConflictError,
    LogCorrupted,
    SchemaTooNew,
    StoreError,
    StoreRefused,
    TreadleError,
    UsageError,
)
from treadle._paths import is_directory, stat_or_none
from treadle._trio_only import require_trio
from treadle.stores import _sql
from treadle.stores._codec import KIND_OF, STEP_KINDS, decode, encode_bytes, record_crc
from treadle.stores._engine import (
    NOTHING_COMMITTED,
    ONE_SYNC,
    BatchReport,
    CommitEngine,
    StoreStatistics,
    Write,
    fail_writes,
)
from treadle.stores._index import IndexDelta, index_delta
from treadle.types import ApprovalDecided, CancelRequested, Record

_FENCED: Final = "treadle: the row of the run refuses this record"

BUSY_TIMEOUT_MS: Final = 10_000
"""How long (milliseconds) a connection waits for a lock held by another connection."""

FILE_CHECK_INTERVAL_S: Final = 0.05
"""How often (seconds, at most) the committer checks that its database file and WAL are still
the files it opened (docs/crash-safety.md, "What the SQLite store detects"). Each check is two
``stat`` calls, and the committer gives up the GIL for each: on every commit they cost about
a tenth of a single run's write path."""

_monotonic = time.monotonic

_SCHEMA: Final = (
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE runs(ord INTEGER PRIMARY KEY, run_id TEXT NOT NULL UNIQUE, "
    "next_seq INTEGER NOT NULL DEFAULT 1, state TEXT, agent TEXT, agent_version TEXT, "
    "started_at TEXT, steps INTEGER NOT NULL DEFAULT 0, stop_reason TEXT, awaiting_until REAL, "
    "lease_owner TEXT NOT NULL DEFAULT '', lease_generation INTEGER NOT NULL DEFAULT 0, "
    "lease_expires REAL NOT NULL DEFAULT 0, lease_heartbeat REAL NOT NULL DEFAULT 0, "
    "control_head INTEGER NOT NULL DEFAULT 0, control_seen INTEGER NOT NULL DEFAULT 0, "
    "submitted_at REAL, submission BLOB, claims INTEGER NOT NULL DEFAULT 0, "
    "takeovers INTEGER NOT NULL DEFAULT 0, not_before REAL NOT NULL DEFAULT 0, quarantined TEXT)",
    "CREATE INDEX runs_open ON runs(agent, ord) WHERE quarantined IS NULL AND state IS NOT NULL "
    "AND state NOT IN ('succeeded', 'failed', 'cancelled')",
    "CREATE TABLE records(run_id TEXT NOT NULL, seq INTEGER NOT NULL, gen INTEGER NOT NULL, "
    "kind TEXT NOT NULL, body BLOB NOT NULL, crc INTEGER NOT NULL, PRIMARY KEY (run_id, seq)) "
    "WITHOUT ROWID",
    "CREATE TABLE control(run_id TEXT NOT NULL, pos INTEGER NOT NULL, kind TEXT NOT NULL, "
    "body BLOB NOT NULL, crc INTEGER NOT NULL, PRIMARY KEY (run_id, pos)) WITHOUT ROWID",
)

_ADVANCE: Final = (
    "CREATE TRIGGER records_advance AFTER INSERT ON records BEGIN UPDATE runs SET next_seq = "
    "NEW.seq + 1, steps = steps + (NEW.kind = '{0}' OR NEW.kind = '{1}') "
    "WHERE run_id = NEW.run_id; UPDATE runs SET state = 'running', awaiting_until = NULL "
    "WHERE (NEW.kind = '{0}' OR NEW.kind = '{1}') AND run_id = NEW.run_id "
    "AND state = 'awaiting_child'; END"
).format(*STEP_KINDS)
"""Moves a run's next seq and counts its step records (stored under either tag); a step
record also ends a wait on child runs (`treadle.stores._index.IndexDelta.unpark`).

Two statements, so that the common row costs one page of ``runs``: the first sets no column
the ``runs_open`` index depends on (setting ``state``, even to itself, rewrites the index
entry), and the second finds nothing to change unless a step record meets a run waiting on
its children. The step tags are compared with ``=``: an ``IN`` list would build a temporary
table on every row."""

_TRIGGERS: Final = (
    # Fencing, in the statement that writes: a record lands only when its run's row holds the
    # writer's live lease generation and expects exactly this seq.
    "CREATE TRIGGER records_fence BEFORE INSERT ON records WHEN NOT EXISTS (SELECT 1 FROM runs "
    "WHERE run_id = NEW.run_id AND lease_generation = NEW.gen AND lease_owner <> '' AND "
    f"next_seq = NEW.seq) BEGIN SELECT RAISE(ABORT, '{_FENCED}'); END",
    _ADVANCE,
)

_V1_CONTROL_SUFFIX: Final = "#control"
"""Layout 1 kept a run's control log as a pseudo-run named ``<run_id>#control``."""


# --------------------------------------------------------------------------- the dialect


class SqliteDialect:
    """`treadle.stores._sql.SqlDialect` for SQLite.

    Args:
        path: the database file.
        clock: the store clock (epoch seconds): the machine's wall clock, shared by every
            process that opens the file.
    """

    for_update = ""
    skip_locked = ""
    flush_acquire = False  # a power loss ends every driver on the machine with it

    def __init__(self, path: str, clock: Callable[[], float]) -> None:
        self.path = path
        self.description = f"SQLite store {path}"
        self.identity: tuple[str, ...] = ("sqlite", os.path.realpath(path))
        self._existing = Path(os.path.abspath(path)).as_uri() + "?mode=rw"
        self._clock = clock
        # The store object's control writes (leases, control streams, claims) take turns here
        # instead of all waiting in SQLite's busy handler at once, which is not fair: under load
        # one of a hundred could wait past the busy timeout ("database is locked").
        self._writing = threading.Lock()

    def connect(self) -> sqlite3.Connection:
        """A connection for reads and control operations (autocommit, busy timeout).

        It opens the file that exists and never makes one: a store file deleted while the
        store is open fails the call ("unable to open database file") instead of leaving an
        empty database where the store was.
        """
        return _connect(self._existing, uri=True)

    def sql(self, text: str) -> str:
        """SQLite takes ``?`` placeholders as they are."""
        return text

    def begin_write(self, conn: Any, *, flush: bool = True) -> None:
        """``BEGIN IMMEDIATE``: take the database's write lock now (one thread at a time).

        ``flush=False`` commits with ``synchronous = NORMAL``: in WAL mode the commit does not
        fsync; the next FULL commit of the log syncs the WAL, this transaction's frames with it.
        """
        if not flush:
            conn.execute("PRAGMA synchronous = NORMAL")
        self._writing.acquire()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._writing.release()
            if not flush:
                conn.execute("PRAGMA synchronous = FULL")
            raise

    def end_write(self, conn: Any, *, flush: bool = True) -> None:
        """Let the next control write of this store object begin; flush commits again."""
        self._writing.release()
        if not flush:
            conn.execute("PRAGMA synchronous = FULL")

    def begin_read(self, conn: Any) -> None:
        """``BEGIN``: a deferred transaction reads one snapshot of the WAL."""
        conn.execute("BEGIN")

    def now(self, conn: Any) -> float:
        """The machine's wall clock (epoch seconds)."""
        return self._clock()

    def error(self, exc: BaseException, what: str) -> TreadleError | None:
        """A damaged database is `LogCorrupted`; other SQLite errors are `StoreError`."""
        return _translate(self.path, exc, what)

    def lost(self, exc: BaseException, conn: Any) -> bool:
        """Never: a SQLite connection is a file opened in this process, no server's session."""
        return False


def _translate(path: str, exc: BaseException, what: str) -> TreadleError | None:
    if isinstance(exc, UnicodeDecodeError):  # a TEXT value of the file is not UTF-8
        return LogCorrupted(f"the database is damaged: {exc}", where=path, offset=None)
    if not isinstance(exc, sqlite3.Error):
        return None
    text = str(exc)
    if "malformed" in text:
        return LogCorrupted(f"the database is damaged: {text}", where=path, offset=None)
    if "not a database" in text:  # a damaged header, or a path to some other file
        return LogCorrupted(
            f"the database is damaged, or the file is not a SQLite database: {text}",
            where=path,
            offset=None,
        )
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in _REFUSALS:  # a read-only file or folder
        return StoreRefused(f"{what} SQLite store {path}: {text}")
    return StoreError(f"{what} SQLite store {path}: {text}")


_REFUSALS: Final = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_AUTH, sqlite3.SQLITE_PERM})
"""SQLite's primary result codes for what trying again does not change (a read-only file,
a denied access): `treadle.StoreRefused`."""


STATEMENT_CACHE: Final = 16
"""Prepared statements each connection keeps (Python's `sqlite3` default: 128). A group commit
is one INSERT of exactly its rows, so a hundred runs make an INSERT per batch size; kept, they
held some 7 MB of SQLite's memory (docs/decisions/0094-few-statement-shapes.md)."""

WRITER_PRAGMAS: Final[Mapping[str, int | str]] = MappingProxyType({"cache_size": -1024})
"""PRAGMAs of the writer connection that ``pragmas`` may override. Its page cache is 1 MiB
(SQLite's default is 2 MB): the writer appends, so the pages it touches are the right edges of
a few B-trees; the other megabyte was resident memory of every store object and bought no
throughput in paired runs of 100 concurrent runs (docs/performance.md, "Memory")."""


def _connect(path: str, *, uri: bool = False) -> sqlite3.Connection:
    """A connection to ``path``, a file path (or a ``file:`` URI with ``uri``)."""
    conn = sqlite3.connect(
        path,
        isolation_level=None,
        check_same_thread=False,
        cached_statements=STATEMENT_CACHE,
        uri=uri,
    )
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return conn


# --------------------------------------------------------------------------- layout


def _layout(conn: sqlite3.Connection) -> int | None:
    """The layout version in ``meta``; ``None`` for an empty database.

    Raises:
        StoreError: the database holds tables but is not a treadle store.
    """
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" not in names:
        if names:
            raise StoreError(f"not a treadle store (it holds tables {sorted(names)})")
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
    if row is None:
        raise StoreError("not a treadle store (its meta table names no layout)")
    return _sql.layout_of(row[0])


def _roll_back(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction after a failure; the caller re-raises that failure.

    SQLite has often rolled back already (a full disk, an I/O error): a ROLLBACK then would
    fail with "cannot rollback - no transaction is active" and hide the real error, so none
    is made. A ROLLBACK that fails on its own is dropped for the same reason.
    """
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _create(conn: sqlite3.Connection, clock: Callable[[], float]) -> None:
    """Lay out a new store, then checkpoint so the creation marker is in the main file."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _layout(conn) is None:  # another process may have created it meanwhile
            for statement in (*_SCHEMA, *_TRIGGERS):
                conn.execute(statement)
            conn.executemany(
                "INSERT INTO meta(key, value) VALUES (?, ?)",
                [
                    ("layout", str(_sql.LAYOUT_VERSION)),
                    ("created", repr(clock())),
                    ("store_id", secrets.token_hex(8)),
                ],
            )
        conn.execute("COMMIT")
    except BaseException:
        _roll_back(conn)
        raise
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _ensure_layout(conn: sqlite3.Connection, clock: Callable[[], float], where: str) -> None:
    layout = _layout(conn)
    if layout is None:
        _create(conn, clock)
        layout = _layout(conn)
    if layout == 1:
        _migrate_v1(conn, where)
        layout = _layout(conn)
    if layout == 2:
        _migrate_v2(conn)
        layout = _layout(conn)
    if layout == 3:
        _migrate_v3(conn)
        layout = _layout(conn)
    if layout is not None and layout > _sql.LAYOUT_VERSION:
        raise SchemaTooNew(layout, _sql.LAYOUT_VERSION, what=f"the table layout of {where}")
    _ensure_triggers(conn)


def _ensure_triggers(conn: sqlite3.Connection) -> None:
    """Replace triggers an earlier version of the same layout created with today's."""
    wanted = {statement.split()[2]: statement for statement in _TRIGGERS}
    found = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))
    if all(found.get(name) == statement for name, statement in wanted.items()):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        for name, statement in wanted.items():
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
            conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        _roll_back(conn)
        raise


def _migrate_v1(conn: sqlite3.Connection, where: str) -> None:
    """Layout 1 to 2: checksummed rows, the run index, control streams instead of pseudo-runs.

    One transaction: every record is decoded, re-encoded with its checksum (generation 0),
    and each run's index row is folded from its log; a ``<run_id>#control`` pseudo-run becomes
    the control stream of ``<run_id>``.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _layout(conn) != 1:
            conn.execute("ROLLBACK")
            return
        conn.execute("ALTER TABLE runs RENAME TO runs_v1")
        conn.execute("ALTER TABLE records RENAME TO records_v1")
        conn.execute("DROP TRIGGER IF EXISTS first_write")
        for statement in _SCHEMA[1:]:
            conn.execute(statement)
        order = [r[0] for r in conn.execute("SELECT run_id FROM runs_v1 ORDER BY rowid")]
        for run_id in order:
            _migrate_run(conn, run_id, where)
        conn.execute("DROP TABLE records_v1")
        conn.execute("DROP TABLE runs_v1")
        for statement in _TRIGGERS:  # after the copy: migrated rows carry generation 0
            conn.execute(statement)
        conn.execute("UPDATE meta SET value = ? WHERE key = 'layout'", (str(_sql.LAYOUT_VERSION),))
        conn.execute(
            "INSERT OR IGNORE INTO meta(key, value) VALUES ('created', ?)", (repr(time.time()),)
        )
        conn.execute("COMMIT")
    except BaseException:
        _roll_back(conn)
        raise
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _migrate_v2(conn: sqlite3.Connection) -> None:
    """Layout 2 to 3: new rows are compact-encoded (docs/decisions/0085-compact-log-records.md).

    One transaction, and no row is rewritten: the step-counting trigger learns the compact
    step tag and the layout is marked 3 (so an older treadle refuses the database instead of
    meeting rows it cannot decode). Rows written before keep their encoding and are read as
    they are.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _layout(conn) != 2:
            conn.execute("ROLLBACK")
            return
        conn.execute("DROP TRIGGER IF EXISTS records_advance")
        conn.execute(_ADVANCE)
        conn.execute("UPDATE meta SET value = '3' WHERE key = 'layout'")
        conn.execute("COMMIT")
    except BaseException:
        _roll_back(conn)
        raise


def _migrate_v3(conn: sqlite3.Connection) -> None:
    """Layout 3 to 4: the layout is marked 4, and nothing else changes.

    Rows written from now on may hold fields a layout-3 treadle cannot decode (record schema
    3, `treadle.types.SCHEMA_VERSION`); the mark makes it refuse the database (`SchemaTooNew`)
    instead of calling those rows damaged (docs/crash-safety.md, "Versions"). One
    transaction; no row is rewritten.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _layout(conn) == 3:
            conn.execute("UPDATE meta SET value = '4' WHERE key = 'layout'")
        conn.execute("COMMIT")
    except BaseException:
        _roll_back(conn)
        raise


def _migrate_run(conn: sqlite3.Connection, log_id: str, where: str) -> None:
    rows = conn.execute(
        "SELECT seq, body FROM records_v1 WHERE run_id = ? ORDER BY seq", (log_id,)
    ).fetchall()
    records = [_decode_v1(where, log_id, seq, body) for seq, body in rows]
    if log_id.endswith(_V1_CONTROL_SUFFIX):
        run_id = log_id[: -len(_V1_CONTROL_SUFFIX)]
        conn.execute("INSERT OR IGNORE INTO runs(run_id) VALUES (?)", (run_id,))
        controls = [r for r in records if isinstance(r, CancelRequested | ApprovalDecided)]
        for position, record in enumerate(controls, start=1):
            moved: Record = _with_run_id(record, run_id)
            kind, body = KIND_OF[type(moved)], encode_bytes(moved)
            conn.execute(
                "INSERT INTO control(run_id, pos, kind, body, crc) VALUES (?, ?, ?, ?, ?)",
                (run_id, position, kind, body, record_crc(run_id, position, 0, kind, body)),
            )
        conn.execute("UPDATE runs SET control_head = ? WHERE run_id = ?", (len(controls), run_id))
        return
    conn.execute("INSERT OR IGNORE INTO runs(run_id) VALUES (?)", (log_id,))
    encoded = _sql.encode_rows(log_id, 1, 0, tuple(records))
    conn.executemany(
        "INSERT INTO records(run_id, seq, gen, kind, body, crc) VALUES (?, ?, ?, ?, ?, ?)", encoded
    )
    delta = index_delta(records)
    group = _sql.RunBatch(
        run_id=log_id,
        writes=(),
        generation=0,
        start=1,
        stop=len(records) + 1,
        delta=delta if delta is not None else IndexDelta(),
    )
    conn.execute(_sql.UPDATE_RUN, _sql.index_params(group))


def _decode_v1(where: str, run_id: str, seq: int, body: str) -> Record:
    try:
        return decode(body)
    except Exception as exc:
        raise LogCorrupted(
            f"run {run_id!r}: a layout-1 record cannot be decoded, so the store cannot be "
            f"migrated: {exc}",
            where=where,
            offset=seq,
            unit="seq",
        ) from exc


def _with_run_id(
    record: CancelRequested | ApprovalDecided, run_id: str
) -> CancelRequested | ApprovalDecided:
    return attrs.evolve(record, run_id=run_id)


# --------------------------------------------------------------------------- the committer side


def _configure_writer(
    conn: sqlite3.Connection,
    pragmas: Mapping[str, int | str],
    clock: Callable[[], float],
    where: str,
    create: bool,
) -> None:
    try:  # before anything is changed: another program's database is left as it is
        layout = _layout(conn)
    except StoreError as exc:
        raise StoreError(f"{where}: {exc}") from None
    if layout is None and not create:
        raise _no_store(where)
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(f"SQLite refused WAL mode (journal_mode is {mode!r})")
    conn.execute("PRAGMA synchronous = FULL")
    for name, value in {**WRITER_PRAGMAS, **pragmas}.items():
        conn.execute(f"PRAGMA {name} = {value}")
    _ensure_layout(conn, clock, where)


def _changes_index(group: _sql.RunBatch) -> bool:
    """Whether the writes change index columns beyond next seq and steps (the triggers' part)."""
    return _delta_changes_index(group.delta)


def _delta_changes_index(delta: IndexDelta) -> bool:
    """Whether ``delta`` sets index columns beyond next seq and steps (the triggers' part)."""
    return not (
        delta.state is None
        and delta.agent is None
        and delta.agent_version is None
        and delta.started_at is None
        and delta.stop_reason is None
        and delta.awaiting_until is None
    )


def _file_id(path: str) -> tuple[int, int] | None:
    """The file's device and inode, or ``None`` when nothing is at ``path``.

    Raises:
        StoreError: ``path`` cannot be looked at (its folder made unreadable, say).
    """
    info = stat_or_none(path)
    return None if info is None else (info.st_dev, info.st_ino)


class _Busy(Exception):
    """A commit in the trio thread met another connection's write lock and gave up."""


def _is_busy(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's ``SQLITE_BUSY`` (any extended code of it)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_BUSY


class SqliteBackend(_sql.SqlBackend):
    """The committer side of the SQLite store: one transaction per batch.

    A batch is ``BEGIN IMMEDIATE``; a check that the database and its WAL are the files
    opened; one read of the batch's runs rows (their next seq and lease generation); one
    multi-row INSERT of every record the rows admit; one UPDATE per run (next seq, index
    columns); ``COMMIT``. Few statements: the thread re-takes the GIL after every SQLite call.

    In the trio thread (`commit_here`) the same batch gives up instead of waiting for another
    connection's write lock: the committer then commits it, waiting up to the busy timeout.
    """

    commits_here = True

    def __init__(
        self,
        dialect: SqliteDialect,
        conn: sqlite3.Connection,
        pool: _sql.ConnectionPool,
        files: tuple[tuple[int, int] | None, tuple[int, int] | None],
    ) -> None:
        super().__init__(dialect, pool)
        self._path = dialect.path
        self._conn = conn
        self._cursor = conn.cursor()
        self._max_rows = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // _sql.ROW_WIDTH
        self._files = files
        self._files_checked = -FILE_CHECK_INTERVAL_S
        self._broken: StoreError | None = None
        self._give_up_when_busy = False
        # the wait the connection was opened with (`BUSY_TIMEOUT_MS`, or a ``pragmas`` one)
        self._wait_ms = self._busy_ms = int(conn.execute("PRAGMA busy_timeout").fetchone()[0])

    def commit_here(self, batch: list[Write]) -> BatchReport | None:
        """`commit`, except that another connection's write lock makes it return ``None``.

        With the busy timeout at 0, SQLite reports the lock at once (``SQLITE_BUSY``) rather
        than waiting for it; the transaction is rolled back, so nothing of ``batch`` is
        committed, and the committer commits it instead.
        """
        self._busy_timeout(0)
        self._give_up_when_busy = True
        try:
            return self.commit(batch)
        except _Busy:
            return None
        finally:
            self._give_up_when_busy = False

    def _busy_timeout(self, ms: int) -> None:
        """Set the connection's busy timeout to ``ms`` unless it is that already.

        A run alone commits in the trio thread every time, many runs in the committer: the
        PRAGMA is run only when the side changes (two statements a commit, otherwise).
        """
        if self._busy_ms != ms:
            self._conn.execute(f"PRAGMA busy_timeout = {ms}")
            self._busy_ms = ms

    def commit(self, batch: list[Write]) -> BatchReport:
        """Commit ``batch`` in one transaction; refused runs' writes get their error.

        The common batch is one multi-row INSERT, its own transaction, its parameters the
        writes' flat values end to end (`treadle.stores._sql.encode_values`): the
        ``records_fence`` trigger admits each row against its run's row and
        ``records_advance`` moves the run's next seq. A batch that changes index columns (a
        run started, finished, waiting on a human...) or holds more rows than one statement
        takes is grouped by run and adds one UPDATE in the same transaction. Only when a row
        is refused is the batch redone run by run, so that just the refused runs fail.
        """
        if self._broken is not None:
            fail_writes(batch, self._broken)
            return NOTHING_COMMITTED
        if not self._give_up_when_busy:
            self._busy_timeout(self._wait_ms)
        try:
            self._check_files()
            try:
                if self._plain(batch):
                    values: list[Any] = []
                    for write in batch:
                        values += write.payload  # type: ignore[arg-type]
                    self._cursor.execute(_insert_sql(len(values) // _sql.ROW_WIDTH), values)
                    return ONE_SYNC
                groups = _sql.group_by_run(batch)
                committed = self._all_at_once(groups) if groups else False
            except sqlite3.IntegrityError:
                _roll_back(self._conn)
                committed = self._run_by_run(_sql.group_by_run(batch))
        except (sqlite3.Error, StoreError) as exc:
            _roll_back(self._conn)
            if self._give_up_when_busy and _is_busy(exc):
                raise _Busy from exc
            error = (
                exc
                if isinstance(exc, StoreError)
                else _translate(self._path, exc, "cannot write to")
            )
            assert error is not None
            if error is not exc:
                error.__cause__ = exc
            fail_writes(batch, error)
            return NOTHING_COMMITTED
        return ONE_SYNC if committed else NOTHING_COMMITTED

    def _plain(self, batch: list[Write]) -> bool:
        """Whether ``batch`` is one INSERT: it sets no index column but the triggers' own.

        And it holds few enough rows for one statement.
        """
        rows = 0
        for write in batch:
            if write.delta is not None and _delta_changes_index(write.delta):
                return False
            rows += len(write.records)
        return rows <= self._max_rows

    def _all_at_once(self, groups: list[_sql.RunBatch]) -> bool:
        self._conn.execute("BEGIN IMMEDIATE")
        self._insert([v for group in groups for v in group.values])
        self._update_index([g for g in groups if _changes_index(g)])
        self._conn.execute("COMMIT")
        return True

    def _run_by_run(self, groups: list[_sql.RunBatch]) -> bool:
        """The slow path after a refused row: each run's writes alone, under a savepoint."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        ok = []
        for group in groups:
            conn.execute("SAVEPOINT run")
            try:
                self._insert(group.values)
            except sqlite3.IntegrityError:
                conn.execute("ROLLBACK TO run")
                stored = self._stored([group.run_id]).get(group.run_id)
                error = _sql.refusal(group, stored, self.description)
                fail_writes(
                    group.writes, error or ConflictError(group.run_id, expected=-1, got=group.start)
                )
            else:
                ok.append(group)
            finally:
                conn.execute("RELEASE run")
        self._update_index([g for g in ok if _changes_index(g)])
        conn.execute("COMMIT")
        return bool(ok)

    def _update_index(self, groups: list[_sql.RunBatch]) -> None:
        if groups:
            self._conn.executemany(_sql.UPDATE_INDEX, [_sql.index_only_params(g) for g in groups])

    def _check_files(self) -> None:
        """Refuse to go on once the database file or its WAL was removed or replaced.

        Checked before a transaction, unless the last check is less than
        `FILE_CHECK_INTERVAL_S` old.

        Raises:
            StoreError: the files were removed or replaced (for good: every later batch is
                refused), or they cannot be looked at now (their folder made unreadable, say:
                this batch fails, the next one checks again).
        """
        checked = _monotonic()
        if checked - self._files_checked < FILE_CHECK_INTERVAL_S:
            return
        now = (_file_id(self._path), _file_id(self._path + "-wal"))  # StoreError: not checked
        self._files_checked = checked
        if now != self._files:
            self._broken = StoreError(
                f"{self.description}: the database file or its WAL was removed or replaced "
                "while the store was open; nothing more is written (writes acknowledged since "
                "the last checkpoint may be lost: see docs/crash-safety.md)"
            )
            raise self._broken

    def _stored(self, run_ids: list[str]) -> dict[str, tuple[Any, Any, Any]]:
        """Each run's ``(next_seq, lease_generation, lease_owner)`` as stored, unchecked.

        `treadle.stores._sql.refusal` tells a damaged row.
        """
        found: dict[str, tuple[Any, Any, Any]] = {}
        for marks, chunk in _sql.in_lists(run_ids):
            rows = self._conn.execute(
                "SELECT run_id, next_seq, lease_generation, lease_owner FROM runs "
                f"WHERE run_id IN ({marks})",
                chunk,
            ).fetchall()
            found.update((r[0], (r[1], r[2], r[3])) for r in rows)
        return found

    def _insert(self, values: list[Any]) -> None:
        """INSERT flat row values (`treadle.stores._sql.encode_values`).

        In as few statements as SQLite's limit on parameters allows.
        """
        step = self._max_rows * _sql.ROW_WIDTH
        for start in range(0, len(values), step):
            chunk = values[start : start + step]
            self._cursor.execute(_insert_sql(len(chunk) // _sql.ROW_WIDTH), chunk)

    def finish(self) -> BatchReport:
        """Close the writer connection."""
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()
        return NOTHING_COMMITTED


_INSERT_CACHE: dict[int, str] = {}


def _insert_sql(count: int) -> str:
    text = _INSERT_CACHE.get(count)
    if text is None:
        values = ", ".join(["(?, ?, ?, ?, ?, ?)"] * count)
        text = f"INSERT INTO records(run_id, seq, gen, kind, body, crc) VALUES {values}"
        if len(_INSERT_CACHE) < 256:
            _INSERT_CACHE[count] = text
    return text


# --------------------------------------------------------------------------- opening


_FileIds = tuple[tuple[int, int] | None, tuple[int, int] | None]


def _check_path(path: str) -> None:
    """Refuse a store path SQLite would refuse with only "unable to open database file".

    Raises:
        StoreError: ``path`` is a directory, or its folder is missing, not a directory, or
            cannot be looked at (its permissions: the `OSError` is the ``__cause__``).
    """
    parent = Path(path).parent
    if is_directory(path):
        raise StoreError(
            f"cannot open SQLite store {path}: it is a directory; give the path of a file in"
            f" it, such as {Path(path) / 'runs.db'}"
        )
    if is_directory(parent):
        return
    if not parent.exists():  # looked at already: nothing there, or a file on the way
        raise StoreError(f"cannot open SQLite store {path}: the folder {parent} does not exist")
    raise StoreError(f"cannot open SQLite store {path}: {parent} is not a directory")


def _no_store(path: str) -> StoreError:
    """The refusal of a file without treadle's tables when the store may not be created.

    An empty file (0 bytes) or a SQLite database holding no tables, opened with
    ``create=False`` (the reading commands; docs/fleet.md, "Stores"), is left as it is.

    Raises:
        StoreError: the file cannot be looked at any more (see `stat_or_none`).
    """
    found = stat_or_none(path)
    empty = found is not None and found.st_size == 0
    why = "the file is empty" if empty else "the SQLite database holds no treadle tables"
    return StoreError(
        f"no store at {path}: {why} (a worker, `treadle submit` or `treadle.open_sqlite_store` "
        "creates them)"
    )


def _open_writer(
    path: str, pragmas: Mapping[str, int | str], clock: Callable[[], float], create: bool
) -> tuple[sqlite3.Connection, _FileIds]:
    _check_path(path)
    if not create and stat_or_none(path) is None:  # connecting would make the file
        raise StoreError(f"no store at {path}: no such file")
    try:
        conn = _connect(path)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open SQLite store {path}: {exc}") from exc
    try:
        _configure_writer(conn, pragmas, clock, path, create)
        conn.execute("SELECT 1 FROM meta").fetchone()  # the WAL exists from here on
        return conn, (_file_id(path), _file_id(path + "-wal"))
    except (sqlite3.Error, UnicodeDecodeError) as exc:
        conn.close()
        error = _translate(path, exc, "cannot open")
        assert error is not None
        raise error from exc
    except BaseException:
        conn.close()
        raise


def _check_pragmas(pragmas: Mapping[str, int | str]) -> None:
    for name, value in pragmas.items():
        if not name.isidentifier() or not str(value).replace("-", "").isalnum():
            raise UsageError(f"invalid PRAGMA {name!r} = {value!r}")
        if name.lower() in {"journal_mode", "synchronous"}:
            raise UsageError(f"PRAGMA {name} is fixed by the store (WAL, synchronous=FULL)")


class SqliteStore(_sql.SqlStore):
    """A run store in one SQLite file (WAL, ``synchronous=FULL``); every capability.

    Open it with `SqliteStore.open` or `open_sqlite_store`, inside a trio run; the store
    belongs to that trio run. Any number of runs may share one store object: their writes are
    committed together by its committer thread. Other store objects, in this process or in
    other processes on the same machine, may open the same file at the same time: leases keep
    each run to one driver. See `treadle.stores._sql.SqlStore` for what every write raises.
    """

    def __init__(
        self, path: str, dialect: SqliteDialect, engine: CommitEngine, pool: _sql.ConnectionPool
    ) -> None:
        """Private: use `SqliteStore.open`."""
        super().__init__(dialect, engine, pool)
        self._path = path

    @classmethod
    async def open(
        cls,
        path: str | PathLike[str],
        *,
        pragmas: Mapping[str, int | str] | None = None,
        clock: Callable[[], float] = time.time,
        create: bool = True,
    ) -> SqliteStore:
        """Open (creating if needed, migrating an older layout) the store at ``path``.

        Args:
            path: the database file; its directory must exist.
            pragmas: extra PRAGMAs for the writer connection (e.g. ``cache_size``), over
                `WRITER_PRAGMAS`; ``journal_mode`` and ``synchronous`` are fixed (WAL, FULL).
            clock: the store clock for lease expiry and the queue (epoch seconds); tests
                inject one, every process of a deployment uses the machine's wall clock.
            create: create the file and its tables when missing; ``False`` refuses a missing
                file, an empty one and a SQLite database without treadle's tables instead,
                changing nothing in it (reading commands must not leave tables in a database
                they were pointed at by mistake; docs/fleet.md, "Stores").

        Returns:
            The open store; the caller owns it and must `aclose` it.

        Raises:
            StoreError: the file cannot be opened or created (missing or read-only
                directory), or is not a treadle store; with ``create=False``, the file is
                missing or holds no treadle tables.
            LogCorrupted: the file is damaged.
            SchemaTooNew: the file was laid out by a newer treadle.
            UsageError: an invalid or forbidden PRAGMA.
        """
        text = str(Path(path))
        extra = dict(pragmas or {})
        _check_pragmas(extra)
        token = trio.lowlevel.current_trio_token()
        conn, files = await trio.to_thread.run_sync(_open_writer, text, extra, clock, create)
        dialect = SqliteDialect(text, clock)
        pool = _sql.ConnectionPool(dialect.connect)
        engine = CommitEngine(SqliteBackend(dialect, conn, pool, files), token)
        return cls(text, dialect, engine, pool)

    @property
    def path(self) -> str:
        """The database file."""
        return self._path


@contextlib.asynccontextmanager
async def open_sqlite_store(
    path: str | PathLike[str],
    *,
    pragmas: Mapping[str, int | str] | None = None,
    clock: Callable[[], float] = time.time,
    create: bool = True,
) -> AsyncIterator[SqliteStore]:
    """Open a `SqliteStore` for the duration of an ``async with`` block, then `aclose` it.

    Args:
        path: the database file (see `SqliteStore.open`).
        pragmas: extra PRAGMAs for the writer connection.
        clock: the store clock (see `SqliteStore.open`).
        create: create the file and its tables when missing (see `SqliteStore.open`).

    Yields:
        The open store.

    Raises:
        StoreError: as `SqliteStore.open` and `SqliteStore.aclose`.
    """
    require_trio("treadle.open_sqlite_store")
    store = await SqliteStore.open(path, pragmas=pragmas, clock=clock, create=create)
    try:
        yield store
    finally:
        await store.aclose()


__all__ = ["SqliteStore", "StoreStatistics", "open_sqlite_store"]
