"""The embedded default run store: one SQLite database file in WAL mode, with group commit.

Layout (``LAYOUT_VERSION`` 1)::

    meta(key TEXT PRIMARY KEY, value TEXT)                      -- 'layout' -> "1"
    runs(run_id TEXT PRIMARY KEY)                               -- rowid order = first-write order
    records(run_id, seq, kind, body, PRIMARY KEY (run_id, seq)) WITHOUT ROWID
    trigger first_write: a record with seq 1 adds its run to ``runs``

``body`` is one record as compact JSON (`treadle.stores._codec`), ``kind`` its tag.

Threads: one committer thread per store object owns the only writer connection
(`treadle.stores._sqlite_commit`). Every run using the store in this process hands its writes
to that thread, which takes everything pending and writes it in ONE transaction (group
commit, DESIGN §4 and §7), then wakes the waiting trio tasks with a single ``run_sync_soon``
per transaction. Reads run in trio worker threads on their own connections, so a reader (in
this process or another one) never waits for the writer and only ever sees committed
transactions.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs
import trio

from treadle._exceptions import ConflictError, LogCorrupted, SchemaTooNew, StoreError, UsageError
from treadle.stores._codec import KIND_OF, check_schema, decode, encode
from treadle.stores._ops import AppendStore
from treadle.stores._sqlite_commit import Committer, Row, Write, read_next_seq, refusal
from treadle.types import (
    Record,
    RunLog,
)

LAYOUT_VERSION: Final = 1
"""Version of the table layout, stored in ``meta``; a newer database is refused."""

BUSY_TIMEOUT_MS: Final = 10_000
"""How long (milliseconds) a connection waits for a lock held by another connection."""

MAX_PENDING_WRITES: Final = 10_000
"""Queued, uncommitted writes above which a non-barrier write waits for its commit."""

CLOSE_GRACE_S: Final = 30.0
"""Seconds `SqliteStore.aclose` waits (shielded) for the committer to flush and stop."""

_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS runs(run_id TEXT PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS records(run_id TEXT NOT NULL, seq INTEGER NOT NULL, "
    "kind TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq)) WITHOUT ROWID",
    "CREATE TRIGGER IF NOT EXISTS first_write AFTER INSERT ON records WHEN NEW.seq = 1 "
    "BEGIN INSERT OR IGNORE INTO runs(run_id) VALUES (NEW.run_id); END",
)
_IDLE_READERS: Final = 4  # read connections kept open between reads
_T = TypeVar("_T")


@attrs.frozen(kw_only=True)
class StoreStatistics:
    """Counters of one `SqliteStore` since it was opened.

    Attributes:
        commits: transactions committed.
        writes_committed: store operations committed (a step write counts once).
        records_written: log records committed.
        max_batch: the most operations committed in one transaction.
        pending: operations queued and not yet committed (or failed).
    """

    commits: int = 0
    writes_committed: int = 0
    records_written: int = 0
    max_batch: int = 0
    pending: int = 0


@attrs.define(eq=False)
class _Counters:
    """The mutable counters behind `StoreStatistics` (updated in the trio thread only)."""

    commits: int = 0
    writes_committed: int = 0
    records_written: int = 0
    max_batch: int = 0
    pending: int = 0


@attrs.define(eq=False)
class _RunState:
    """What the trio side knows about one run: its next seq, last write and first failure."""

    next_seq: int
    last: Write | None = None
    error: StoreError | None = None
    reported: bool = False


# --------------------------------------------------------------------------- connections


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return conn


def _read_layout(conn: sqlite3.Connection) -> int | None:
    found = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone()
    if found is None:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
    return None if row is None else int(row[0])


def _ensure_layout(conn: sqlite3.Connection) -> None:
    layout = _read_layout(conn)
    if layout is None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('layout', ?)", (LAYOUT_VERSION,)
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        layout = _read_layout(conn)
    if layout is not None and layout > LAYOUT_VERSION:
        raise SchemaTooNew(layout, LAYOUT_VERSION)


def _configure_writer(conn: sqlite3.Connection, pragmas: Mapping[str, int | str]) -> None:
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(f"SQLite refused WAL mode (journal_mode is {mode!r})")
    conn.execute("PRAGMA synchronous = FULL")
    for name, value in pragmas.items():
        conn.execute(f"PRAGMA {name} = {value}")
    _ensure_layout(conn)


def _open_writer(path: str, pragmas: Mapping[str, int | str]) -> sqlite3.Connection:
    parent = Path(path).parent
    if not parent.is_dir():
        raise StoreError(f"cannot open SQLite store {path}: {parent} is not a directory")
    try:
        conn = _connect(path)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open SQLite store {path}: {exc}") from exc
    try:
        _configure_writer(conn, pragmas)
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(f"cannot open SQLite store {path}: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _open_reader(path: str) -> sqlite3.Connection:
    conn = _connect(path)
    conn.execute("PRAGMA query_only = ON")
    return conn


def _check_pragmas(pragmas: Mapping[str, int | str]) -> None:
    for name, value in pragmas.items():
        if not name.isidentifier() or not str(value).replace("-", "").isalnum():
            raise UsageError(f"invalid PRAGMA {name!r} = {value!r}")
        if name.lower() in {"journal_mode", "synchronous"}:
            raise UsageError(f"PRAGMA {name} is fixed by the store (WAL, synchronous=FULL)")


# --------------------------------------------------------------------------- reading


def _decode_row(where: str, expected_seq: int, row: tuple[int, str, str]) -> Record:
    seq, kind, body = row
    if seq != expected_seq:
        raise LogCorrupted(
            f"record seq {expected_seq} is missing", where=where, offset=expected_seq
        )
    try:
        record = decode(body)
    except Exception as exc:
        raise LogCorrupted(f"undecodable {kind} record: {exc}", where=where, offset=seq) from exc
    if KIND_OF[type(record)] != kind:
        found = type(record).__name__
        raise LogCorrupted(f"record tagged {kind} holds a {found}", where=where, offset=seq)
    check_schema(record)
    return record


def _read_records(conn: sqlite3.Connection, where: str, run_id: str) -> tuple[Record, ...]:
    rows = conn.execute(
        "SELECT seq, kind, body FROM records WHERE run_id = ? ORDER BY seq", (run_id,)
    ).fetchall()
    return tuple(_decode_row(where, n, row) for n, row in enumerate(rows, start=1))


def _read_run_ids(conn: sqlite3.Connection) -> tuple[str, ...]:
    return tuple(r[0] for r in conn.execute("SELECT run_id FROM runs ORDER BY rowid"))


# --------------------------------------------------------------------------- the store


class SqliteStore(AppendStore):
    """A `treadle.ports.RunStore` in one SQLite file (WAL, ``synchronous=FULL``).

    Open it with `SqliteStore.open` or `open_sqlite_store`, inside a trio run; the store
    belongs to that trio run. Any number of runs may share one store object: their writes are
    committed together by its single committer thread.

    Barriers (`write_intent`, `write_control`, `write_run_finished`) return once the
    transaction holding them (and everything queued before) has committed. The other writes
    return once queued; if their transaction later fails, the error is raised by the next
    write of that run. After any write of a run fails in a transaction, the store refuses
    every further write of that run with `StoreError`; open the store again to resume it.

    Every write raises:
        ConflictError: ``seq`` is not the run's next seq (checked before queuing; another
            store object or process that wrote the same seq is caught at commit). Nothing
            of the write is stored.
        UsageError: a record cannot be encoded as JSON, or names another run. Nothing is
            stored and the seq stays free.
        StoreError: the transaction of this barrier failed (disk full, I/O error; the
            SQLite error is the ``__cause__``), an earlier write of the run failed, or the
            store is closed.

    Cancellation:
        Every operation is a checkpoint. A write cancelled before it was queued writes
        nothing. A barrier cancelled while awaiting its commit stays queued and WILL commit
        (the run's next seq has advanced); the committer is never left half-way.
    """

    def __init__(self, path: str, conn: sqlite3.Connection, token: trio.lowlevel.TrioToken):
        """Private: use `SqliteStore.open`."""
        self._path = path
        self._runs: dict[str, _RunState] = {}
        self._last: Write | None = None
        self._readers: list[sqlite3.Connection] = []
        self._closed = False
        self._stopped = trio.Event()
        self._counters = _Counters()
        self._committer = Committer(conn, token, self._deliver, self._stopped.set)
        self._committer.start()

    @classmethod
    async def open(
        cls, path: str | PathLike[str], *, pragmas: Mapping[str, int | str] | None = None
    ) -> SqliteStore:
        """Open (creating if needed) the store at ``path`` and start its committer thread.

        Args:
            path: the database file; its directory must exist. Readers in other processes
                may open the same file at the same time.
            pragmas: extra PRAGMAs for the writer connection (e.g. ``cache_size``);
                ``journal_mode`` and ``synchronous`` are fixed (WAL, FULL).

        Returns:
            The open store; the caller owns it and must `aclose` it.

        Raises:
            StoreError: the file cannot be opened or created (missing or read-only
                directory, not a database), with the SQLite error as ``__cause__``.
            SchemaTooNew: the file was laid out by a newer treadle.
            UsageError: an invalid or forbidden PRAGMA.
        """
        text = str(Path(path))
        extra = dict(pragmas or {})
        _check_pragmas(extra)
        token = trio.lowlevel.current_trio_token()
        conn = await trio.to_thread.run_sync(_open_writer, text, extra)
        return cls(text, conn, token)

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    def statistics(self) -> StoreStatistics:
        """Commit counters since the store was opened."""
        return StoreStatistics(**attrs.asdict(self._counters))

    async def read_log(self, run_id: str) -> RunLog:
        """Read the run's whole log, after the writes queued for it here have committed.

        Returns:
            The log, records in seq order; an empty log for a run that does not exist.

        Raises:
            LogCorrupted: a stored record cannot be decoded, or a seq is missing
                (``offset`` is that seq).
            SchemaTooNew: the run was started by a newer schema version.
            StoreError: the database cannot be read, or the store is closed.
        """
        self._check_open()
        state = self._runs.get(run_id)
        if state is not None and state.last is not None:
            await self._wait_done(state.last)
        records = await self._read(_read_records, self._path, run_id)
        return RunLog(run_id=run_id, records=records)

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one committed record, in first-write order.

        Raises:
            StoreError: the database cannot be read, or the store is closed.
        """
        self._check_open()
        if self._last is not None:
            await self._wait_done(self._last)
        return await self._read(_read_run_ids)

    async def aclose(self) -> None:
        """Commit everything queued, stop the committer and close every connection.

        Idempotent. Later operations raise `StoreError`.

        Raises:
            StoreError: a write failed after it returned and no later call of that run
                reported it, or the committer did not stop within `CLOSE_GRACE_S`.

        Cancellation:
            The flush is shielded (bounded by `CLOSE_GRACE_S`).
        """
        if not self._closed:
            self._closed = True
            self._committer.inbox.stop()
        with trio.move_on_after(CLOSE_GRACE_S, shield=True):
            await self._stopped.wait()
        if not self._stopped.is_set():
            raise StoreError(f"{self._path}: the committer did not stop in {CLOSE_GRACE_S} s")
        while self._readers:
            self._readers.pop().close()
        self._raise_unreported()

    # ------------------------------------------------------------------ internals

    async def _append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        barrier: bool,
        closes: bool = False,
    ) -> None:
        if barrier:  # waiting for the commit below is the schedule point
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            await trio.lowlevel.checkpoint()
        self._check_open()
        rows = _encode_rows(run_id, seq, records)
        state = self._runs.get(run_id)
        if state is None:
            state = await self._load_state(run_id)
        self._check_open()
        if state.error is not None:
            state.reported = True
            raise refusal(run_id, state.error)
        if seq != state.next_seq:
            raise ConflictError(run_id, expected=state.next_seq, got=seq)
        write = Write(run_id=run_id, seq=seq, rows=rows)
        wait = barrier or self._counters.pending >= MAX_PENDING_WRITES
        if wait:
            write.event = trio.Event()
        self._committer.inbox.put(write, flush=wait)  # StoreError if the committer is gone
        state.next_seq += len(rows)
        state.last = self._last = write
        self._counters.pending += 1
        if write.event is None:
            return
        await write.event.wait()
        if write.error is not None:
            state.reported = True
            raise write.error

    async def _load_state(self, run_id: str) -> _RunState:
        next_seq = await self._read(read_next_seq, run_id)
        # another task may have loaded (and advanced) it meanwhile: keep that one
        return self._runs.setdefault(run_id, _RunState(next_seq=next_seq))

    async def _wait_done(self, write: Write) -> None:
        if write.done:
            return
        if write.event is None:
            write.event = trio.Event()
            self._committer.inbox.flush()
        await write.event.wait()

    def _deliver(self, batch: list[Write], written: int) -> None:
        """In the trio thread: record the outcome of one transaction and wake its waiters."""
        ok = 0
        for write in batch:
            write.done = True
            if write.error is None:
                ok += 1
            else:
                self._poison(write.run_id, write.error)
            if write.event is not None:
                write.event.set()
        counters = self._counters
        counters.pending -= len(batch)
        if ok:
            counters.commits += 1
            counters.writes_committed += ok
            counters.records_written += written
            counters.max_batch = max(counters.max_batch, ok)

    def _poison(self, run_id: str, error: StoreError) -> None:
        state = self._runs[run_id]
        if state.error is None:
            state.error = error

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the SQLite store {self._path} is closed")

    def _raise_unreported(self) -> None:
        unreported = sorted(r for r, s in self._runs.items() if s.error and not s.reported)
        if unreported:
            for run_id in unreported:
                self._runs[run_id].reported = True
            first = self._runs[unreported[0]].error
            raise StoreError(
                f"{self._path}: writes of runs {unreported} failed after returning"
            ) from first

    async def _read(self, fn: Callable[..., _T], *args: Any) -> _T:
        conn = self._readers.pop() if self._readers else None
        try:
            if conn is None:
                conn = await trio.to_thread.run_sync(_open_reader, self._path)
            return await trio.to_thread.run_sync(fn, conn, *args)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read SQLite store {self._path}: {exc}") from exc
        finally:
            if conn is not None:
                self._release(conn)

    def _release(self, conn: sqlite3.Connection) -> None:
        if self._closed or len(self._readers) >= _IDLE_READERS:
            conn.close()
        else:
            self._readers.append(conn)


def _encode_rows(run_id: str, seq: int, records: tuple[Record, ...]) -> tuple[Row, ...]:
    rows = []
    for offset, record in enumerate(records):
        if record.run_id != run_id:
            raise UsageError(f"a write of run {run_id!r} holds a record of run {record.run_id!r}")
        try:
            body = encode(record)
        except Exception as exc:
            raise UsageError(f"run {run_id!r}: cannot encode {record!r}: {exc}") from exc
        rows.append((run_id, seq + offset, KIND_OF[type(record)], body))
    return tuple(rows)


@contextlib.asynccontextmanager
async def open_sqlite_store(
    path: str | PathLike[str], *, pragmas: Mapping[str, int | str] | None = None
) -> AsyncIterator[SqliteStore]:
    """Open a `SqliteStore` for the duration of an ``async with`` block, then `aclose` it.

    Args:
        path: the database file (see `SqliteStore.open`).
        pragmas: extra PRAGMAs for the writer connection.

    Yields:
        The open store.

    Raises:
        StoreError: as `SqliteStore.open` and `SqliteStore.aclose`.
    """
    store = await SqliteStore.open(path, pragmas=pragmas)
    try:
        yield store
    finally:
        await store.aclose()
