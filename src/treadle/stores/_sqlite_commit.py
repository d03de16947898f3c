"""The committer thread of `treadle.stores.sqlite`: group commit on one writer connection.

The trio side (`SqliteStore`) hands `Write` objects to an `Inbox`; the `Committer` thread
takes everything pending, writes it in ONE transaction and hands the batch back to trio with a
single ``run_sync_soon``. Non-barrier writes do not wake the thread on their own (they linger
until a barrier or a reader asks for a flush, at most `LINGER_S`).

Why few statements per transaction: the thread must re-take the GIL after every SQLite call,
and while the trio thread is busy that costs up to the interpreter's switch interval (5 ms).
So a batch is one multi-row INSERT that is its own transaction, and a trigger fills ``runs``.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Final

import attrs
import trio

from treadle._exceptions import ConflictError, StoreError

SPLIT_ABOVE: Final = 64
"""Pending writes above which the committer takes only the older half per transaction, so
that trio works on one half while the other commits (instead of all runs in lock step)."""

LINGER_S: Final = 0.02
"""Seconds a queued non-barrier write may wait for a barrier to share its transaction."""

_RECORDS_INSERT: Final = "INSERT INTO records(run_id, seq, kind, body) VALUES "
Row = tuple[str, int, str, str]
"""One record as stored: ``(run_id, seq, kind, body)``."""


@attrs.define(eq=False)
class Write:
    """One store operation on its way to the committer (rows share one run and one write)."""

    run_id: str
    seq: int
    rows: tuple[Row, ...]
    done: bool = False
    error: StoreError | None = None
    event: trio.Event | None = None


def refusal(run_id: str, cause: StoreError) -> StoreError:
    """The error for a write of a run whose earlier write failed (``cause``)."""
    err = StoreError(
        f"run {run_id!r}: an earlier write of this run failed ({cause}); the store refuses "
        "further writes of it (open the store again to resume the run)"
    )
    err.__cause__ = cause
    return err


def read_next_seq(conn: sqlite3.Connection, run_id: str) -> int:
    """The seq after the run's last stored record (1 for a run without records)."""
    row = conn.execute("SELECT MAX(seq) FROM records WHERE run_id = ?", (run_id,)).fetchone()
    return 1 if row[0] is None else int(row[0]) + 1


class Inbox:
    """The writes handed to the committer thread.

    Queuing a write does not wake the committer for a transaction of its own: it lingers for
    up to `LINGER_S` so that it rides with the next barrier. Only a flush request (a barrier,
    or a caller waiting for a write) or stopping ends the linger early.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._items: list[Write] = []
        self._flush = False
        self._stop = False
        self._closed = False

    def put(self, write: Write, *, flush: bool) -> None:
        """Queue ``write``; ``flush`` wakes the committer now.

        Raises:
            StoreError: the committer thread has stopped.
        """
        with self._lock:
            if self._closed:
                raise StoreError("the SQLite committer thread has stopped")
            self._items.append(write)
            self._flush = self._flush or flush
            if flush or len(self._items) == 1:
                self._cond.notify()

    def flush(self) -> None:
        with self._cond:
            self._flush = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def close(self) -> list[Write]:
        """Refuse further writes; return those never taken."""
        with self._lock:
            self._closed = True
            leftover, self._items = self._items, []
            return leftover

    def take(self) -> tuple[list[Write], bool]:
        """Block until there is work; return ``(batch, stopping)``, oldest writes first."""
        with self._cond:
            while not self._items and not self._stop:
                self._cond.wait()
            if not (self._flush or self._stop):
                self._cond.wait_for(lambda: self._flush or self._stop, LINGER_S)
            items = self._items
            cut = len(items) if len(items) <= SPLIT_ABOVE else (len(items) + 1) // 2
            batch, self._items = items[:cut], items[cut:]
            self._flush = bool(self._items) and self._flush
            return batch, self._stop and not self._items


class Committer:
    """The thread that owns the writer connection and commits queued writes in batches.

    A batch is written with one multi-row INSERT (the fast path: few statements, so few
    hand-overs of the GIL); if that hits a primary-key conflict, the transaction is redone
    write by write so that only the conflicting writes fail.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        token: trio.lowlevel.TrioToken,
        deliver: Callable[[list[Write], int], None],
        stopped: Callable[[], None],
    ) -> None:
        self.inbox = Inbox()
        self._conn = conn
        self._token = token
        self._deliver = deliver
        self._stopped = stopped
        self._failed: dict[str, StoreError] = {}
        self._max_rows = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // 4
        self._thread = threading.Thread(
            target=self._main, name="treadle-sqlite-committer", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            self._loop()
        finally:  # also after a bug in the loop: no waiter is left hanging
            leftover = self.inbox.close()
            if leftover:
                self._fail_all(leftover, RuntimeError("the committer thread stopped"))
                self._call_soon(self._deliver, leftover, 0)
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._call_soon(self._stopped)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self.inbox.take()
            try:
                written = self._commit(batch)
            except BaseException as exc:  # a bug: fail this batch, then stop the thread
                self._fail_all(batch, exc)
                self._call_soon(self._deliver, batch, 0)
                raise
            self._call_soon(self._deliver, batch, written)

    def _call_soon(self, fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _commit(self, batch: list[Write]) -> int:
        """Write ``batch`` in one transaction; return the records committed (0 on failure)."""
        live = [w for w in batch if not self._refused(w)]
        if not live:
            return 0
        try:
            try:
                self._insert_all([row for w in live for row in w.rows])
                inserted = live
            except sqlite3.IntegrityError:
                self._rollback()
                inserted = self._insert_each(live)
        except Exception as exc:  # a failing disk, or a bug: every waiter hears of it
            self._rollback()
            self._fail_all(live, exc)
            return 0
        return sum(len(w.rows) for w in inserted)

    def _insert_all(self, rows: list[Row]) -> None:
        """The fast path: one INSERT that is its own transaction (when the rows fit in one)."""
        if len(rows) <= self._max_rows:
            if rows:
                self._conn.execute(_insert_sql(len(rows)), _flat(rows))
            return
        self._conn.execute("BEGIN IMMEDIATE")
        for start in range(0, len(rows), self._max_rows):
            chunk = rows[start : start + self._max_rows]
            self._conn.execute(_insert_sql(len(chunk)), _flat(chunk))
        self._conn.execute("COMMIT")

    def _insert_each(self, writes: list[Write]) -> list[Write]:
        """The slow path after a conflict: each write alone, so only conflicting ones fail."""
        self._conn.execute("BEGIN IMMEDIATE")
        inserted = [w for w in writes if self._insert_one(w)]
        self._conn.execute("COMMIT")
        return inserted

    def _insert_one(self, write: Write) -> bool:
        if self._refused(write):  # an earlier write of its run failed in this batch
            return False
        self._conn.execute("SAVEPOINT write")
        try:
            self._conn.execute(_insert_sql(len(write.rows)), _flat(write.rows))
        except sqlite3.IntegrityError as exc:
            self._conn.execute("ROLLBACK TO write")
            expected = read_next_seq(self._conn, write.run_id)
            write.error = ConflictError(write.run_id, expected=expected, got=write.seq)
            write.error.__cause__ = exc
            self._failed[write.run_id] = write.error
            return False
        finally:
            self._conn.execute("RELEASE write")
        return True

    def _refused(self, write: Write) -> bool:
        earlier = self._failed.get(write.run_id)
        if earlier is not None and write.error is None:
            write.error = refusal(write.run_id, earlier)
        return earlier is not None

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")

    def _fail_all(self, writes: list[Write], exc: BaseException) -> None:
        err = StoreError(f"SQLite transaction of {len(writes)} writes failed: {exc}")
        err.__cause__ = exc
        for write in writes:
            if write.error is None:
                write.error = err
            self._failed.setdefault(write.run_id, write.error)


@functools.lru_cache(maxsize=256)
def _insert_sql(count: int) -> str:
    return _RECORDS_INSERT + ", ".join(["(?, ?, ?, ?)"] * count)


def _flat(rows: Sequence[tuple[object, ...]]) -> list[object]:
    return [value for row in rows for value in row]
