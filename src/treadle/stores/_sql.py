"""What the SQL stores (SQLite, PostgreSQL) share.

The table layout, the statements, and the trio-side store on top of the commit engine.

Tables (docs/crash-safety.md, "The stores"; docs/fleet.md, "Stores")::

    meta(key, value)                     layout version, creation marker, store id
    runs(ord, run_id UNIQUE, ...)        one row per run: the run index, its lease and its
                                         queue entry; ``ord`` is the order runs entered
    records(run_id, seq, gen, kind, body, crc)   the log; PRIMARY KEY (run_id, seq)
    control(run_id, pos, body, crc)      the control streams; PRIMARY KEY (run_id, pos)

``body`` is one record in the encoding its ``kind`` names (`treadle.stores._codec`: a compact
JSON array under a two-letter tag, or, in rows written before layout 3, a JSON object under
the long tag), ``gen`` the lease generation of its writer and ``crc`` the CRC-32 of the row
(`treadle.stores._codec.record_crc`): a read refuses a row whose checksum fails, a seq
missing, or fewer records than the run's ``next_seq`` says it has (`LogCorrupted`). Control
entries keep the JSON-object encoding (other processes, of other versions, append to them).

A write commits only if the run's ``runs`` row still holds the writer's lease generation and
the next seq the writer expects: a stale writer's rows are left out of the batch (`LeaseLost`)
and so is a writer that sees fewer records than it acknowledged (`StoreError`), while the other
runs of the batch commit. Lease expiry and the queue's backoff are judged by the store's clock
(`SqlDialect.now`).

Every statement is written once with ``?`` placeholders; `SqlDialect.sql` adapts it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Final, Protocol, TypeVar

import attrs
import trio

from treadle._exceptions import (
    ConflictError,
    LeaseLost,
    LogCorrupted,
    StoreError,
    TreadleError,
    UsageError,
)
from treadle._ids import check_run_id
from treadle.stores import _leases, _queue
from treadle.stores._codec import (
    KIND_OF,
    TAG_OF,
    check_schema,
    decode,
    decode_submission,
    encode_bytes,
    encode_submission,
    pack,
    record_crc,
    row_crc,
    stored_decoder,
)
from treadle.stores._engine import (
    MAX_WORKERS,
    CommitEngine,
    RunHead,
    StoreStatistics,
    Write,
    call_given_up,
    fail_writes,
)
from treadle.stores._index import IndexDelta, checked_last, fold_delta
from treadle.stores._ops import EngineStore
from treadle.types import (
    ApprovalDecided,
    BudgetCaps,
    CancelRequested,
    Claim,
    ControlEntry,
    Lease,
    Liveness,
    Message,
    Record,
    RunLog,
    RunStarted,
    RunState,
    RunSummary,
    StopReason,
    Submission,
)

_LOG = logging.getLogger("treadle.stores")

LAYOUT_VERSION: Final = 4
"""Version of the table layout, stored in ``meta``; a database of a newer one is refused.

3: record rows are written in the compact encoding (docs/decisions/0085-compact-log-records.md);
rows written before keep theirs and are read as they are. A layout-2 database is marked 3 when
a newer treadle opens it (nothing else changes), so an older treadle refuses it instead of
reading rows it cannot decode.
4: the same tables; rows may hold the fields of record schema 3 (`treadle.types.SCHEMA_VERSION`),
which a layout-3 treadle cannot decode. A layout-3 database is marked 4 when a newer treadle opens
it, nothing else changes. Raised whenever the records' wire shape changes (docs/crash-safety.md,
"Versions")."""


def layout_of(value: object) -> int:
    """The layout version a ``meta`` row holds (its text, as stored).

    Raises:
        StoreError: the row holds no whole number (the table was changed by hand, or is
            not a treadle store's).
    """
    try:
        return int(str(value))
    except ValueError:
        raise StoreError(
            f"not a readable treadle store: its meta table holds the layout {value!r}, "
            "not a version number"
        ) from None


TERMINAL_STATES: Final = tuple(s.value for s in RunState if s.is_terminal)

Row = tuple[str, int, int, str, bytes, int]
"""One record row as stored: ``(run_id, seq, gen, kind, body, crc)``."""

_T = TypeVar("_T")


class Connection(Protocol):
    """The DB-API connection methods the SQL stores use (sqlite3 and psycopg both have them)."""

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Any:
        """Run one statement."""
        ...

    def close(self) -> None:
        """Close the connection."""
        ...


class SqlDialect(Protocol):
    """What differs between SQLite and PostgreSQL outside the committer.

    Attributes:
        description: the store, for messages (a path, a DSN without its password).
        identity: what names the tables: two dialects of one identity are one database.
        for_update: appended to a SELECT that must lock its rows (``""`` for SQLite, whose
            write transactions lock the whole database).
        skip_locked: appended to the claim query's SELECT (``FOR UPDATE SKIP LOCKED``).
        flush_acquire: whether a lease acquisition must flush its own commit: yes where a
            driver can outlive a server crash that loses an unflushed commit (PostgreSQL), so
            that no generation is ever handed out twice; no where every driver dies with it
            (SQLite: a power loss), docs/decisions/0016-lease-writes-ride-on-log-commits.md.
    """

    description: str
    identity: tuple[str, ...]
    for_update: str
    skip_locked: str
    flush_acquire: bool

    def connect(self) -> Connection:
        """Open a connection for reads and control operations (in a worker thread)."""
        ...

    def sql(self, text: str) -> str:
        """``text`` with its ``?`` placeholders in the driver's style."""
        ...

    def begin_write(self, conn: Connection, *, flush: bool = True) -> None:
        """Start a transaction that will write.

        ``flush=False``: its commit need not wait for its own flush to disk (a lease operation,
        docs/decisions/0016-lease-writes-ride-on-log-commits.md); the next flushed commit, or
        the server's own schedule, makes it durable.
        """
        ...

    def end_write(self, conn: Connection, *, flush: bool = True) -> None:
        """Called once a transaction begun by `begin_write` committed or rolled back.

        Raises:
            sqlite3.Error or psycopg.Error: the connection could not be set back to flushing
                commits (it must not be used again).
        """
        ...

    def begin_read(self, conn: Connection) -> None:
        """Start a read-only transaction whose statements share one snapshot."""
        ...

    def now(self, conn: Connection) -> float:
        """The store clock, epoch seconds (inside the current transaction)."""
        ...

    def error(self, exc: BaseException, what: str) -> TreadleError | None:
        """The treadle error for a driver error (``None``: not a driver error)."""
        ...

    def lost(self, exc: BaseException, conn: Connection) -> bool:
        """Whether ``exc`` cost ``conn`` its connection, not a statement's own error.

        Lost: the server ended the session, or the network dropped it. Not lost: a
        statement timeout, a lock wait given up, a deadlock's victim.
        """
        ...


# --------------------------------------------------------------------------- encoding rows


def encode_rows(
    run_id: str, seq: int, generation: int, records: tuple[Record, ...]
) -> tuple[Row, ...]:
    """The rows of one write, compact-encoded (a migration's; the engine takes `encode_values`).

    Raises:
        ValueError: a record belongs to another run.
        TypeError: a value is not JSON data.
    """
    values = encode_values(run_id, seq, generation, records)
    return tuple(rows_of(values))


ROW_WIDTH: Final = 6
"""Values per record row in `encode_values`' flat tuple (the columns of `Row`)."""

_BODY: Final = 4
"""Where a row's body is among its `ROW_WIDTH` values."""


def encode_values(
    run_id: str, seq: int, generation: int, records: tuple[Record, ...]
) -> tuple[Any, ...]:
    """The rows of one write (the engine's payload for the SQL stores), compact-encoded.

    Returns:
        The rows' values in one flat tuple, `ROW_WIDTH` per record in seq order:
        ``(run_id, seq, gen, kind, body, crc, run_id, seq + 1, ...)``. A batch's statement
        parameters are the concatenation of its writes' tuples, with no row objects between.

    Raises:
        ValueError: a record belongs to another run.
        TypeError: a value is not JSON data.
    """
    if len(records) == 1:
        record = records[0]
        kind = TAG_OF[type(record)]
        body = pack(record, run_id)
        crc = record_crc(run_id, seq, generation, kind, body)
        return (run_id, seq, generation, kind, body, crc)
    values: list[Any] = []
    for offset, record in enumerate(records):
        kind = TAG_OF[type(record)]
        body = pack(record, run_id)
        crc = record_crc(run_id, seq + offset, generation, kind, body)
        values += (run_id, seq + offset, generation, kind, body, crc)
    return tuple(values)


def rows_of(values: Sequence[Any]) -> list[Row]:
    """`encode_values`' flat values as rows."""
    return [tuple(values[start : start + ROW_WIDTH]) for start in range(0, len(values), ROW_WIDTH)]


def decode_rows(where: str, run_id: str, rows: Sequence[Sequence[Any]]) -> tuple[Record, ...]:
    """A run's stored record rows ``(seq, gen, kind, body, crc)`` from seq 1, as records.

    Each row is checked: its seq, its checksum, that its body decodes as its tag says, and
    the schema version of a run-started record.

    Raises:
        LogCorrupted: a row is damaged or missing (``offset`` is its seq, ``unit`` "seq").
        SchemaTooNew: the run was started by a newer schema version.
    """
    crc_of = row_crc(run_id)
    records: list[Record] = []
    for expected, (seq, gen, kind, body, crc) in enumerate(rows, start=1):
        if type(body) is not bytes:
            if not isinstance(body, bytes | bytearray | memoryview):  # a damaged row's type
                raise LogCorrupted(
                    f"run {run_id!r}: record {expected} holds no bytes",
                    where=where,
                    offset=expected,
                    unit="seq",
                )
            body = bytes(body)  # a memoryview from PostgreSQL
        if seq != expected:
            raise LogCorrupted(
                f"run {run_id!r}: record seq {expected} is missing",
                where=where,
                offset=expected,
                unit="seq",
            )
        if crc_of(seq, gen, kind, body) != crc:
            raise LogCorrupted(
                f"run {run_id!r}: record {seq} fails its checksum",
                where=where,
                offset=seq,
                unit="seq",
            )
        try:
            record = stored_decoder(kind)(body, run_id)
        except Exception as exc:
            raise LogCorrupted(
                f"run {run_id!r}: record {seq} ({kind}) does not decode: {exc}",
                where=where,
                offset=seq,
                unit="seq",
            ) from exc
        if type(record) is RunStarted:
            check_schema(record)
        records.append(record)
    return tuple(records)


# --------------------------------------------------------------------------- the batch commit


@attrs.frozen(kw_only=True)
class RunBatch:
    """The writes of one run in one batch, with what the ``runs`` row must say to take them.

    Attributes:
        run_id: the run.
        writes: its writes, in seq order.
        generation: the lease generation the writes carry (the first write's).
        start: the seq the row's ``next_seq`` must equal.
        stop: the row's ``next_seq`` after the writes.
        delta: the index change of the writes together.
    """

    run_id: str
    writes: tuple[Write, ...]
    generation: int
    start: int
    stop: int
    delta: IndexDelta

    @property
    def values(self) -> list[Any]:
        """The values of every record row of the writes, flat (see `encode_values`)."""
        values: list[Any] = []
        for write in self.writes:
            values += write.payload  # type: ignore[arg-type]
        return values

    @property
    def rows(self) -> list[Row]:
        """Every record row of the writes."""
        return rows_of(self.values)


def group_by_run(batch: Sequence[Write]) -> list[RunBatch]:
    """The batch's writes grouped by run, runs in order of their first write.

    A run whose writes carry different generations writes none of them: all fail with
    `LeaseLost` (a driver never changes generation without a new lease).
    """
    by_run: dict[str, list[Write]] = {}
    for write in batch:
        writes = by_run.get(write.run_id)
        if writes is None:
            by_run[write.run_id] = [write]
        else:
            writes.append(write)
    groups = []
    for run_id, writes in by_run.items():
        generation = writes[0].generation
        other = next((w for w in writes if w.generation != generation), None)
        if other is not None:
            fail_writes(writes, LeaseLost(run_id, generation=other.generation, current=None))
            continue
        groups.append(
            RunBatch(
                run_id=run_id,
                writes=tuple(writes),
                generation=generation,
                start=writes[0].seq,
                stop=writes[-1].end_seq,
                delta=fold_delta([w.delta for w in writes if w.delta is not None]),
            )
        )
    return groups


def refusal(
    group: RunBatch, stored: tuple[Any, Any, Any] | None, where: str
) -> TreadleError | None:
    """Why the row ``(next_seq, lease_generation, lease_owner)`` refuses ``group``, or ``None``.

    A released lease (no owner) writes nothing, like a lease taken over.
    """
    run_id = group.run_id
    if stored is None:
        return LeaseLost(run_id, generation=group.generation, current=None)
    raw_seq, generation, owner = stored
    try:
        next_seq = stored_seq(where, run_id, raw_seq)
    except LogCorrupted as exc:
        return exc
    if generation != group.generation or group.generation < 1 or not owner:
        return LeaseLost(run_id, generation=group.generation, current=generation)
    if next_seq < group.start:
        return StoreError(
            f"{where}: run {run_id!r} holds records up to seq {next_seq - 1} but this writer "
            f"had {group.start - 1} acknowledged: the store lost acknowledged records (was "
            "its file replaced or its WAL deleted?); the writer stops"
        )
    if next_seq != group.start:
        return ConflictError(run_id, expected=next_seq, got=group.start)
    return None


def index_params(group: RunBatch) -> tuple[Any, ...]:
    """Parameters of `UPDATE_RUN` for one run's batch."""
    d = group.delta
    until = d.awaiting_until
    return (
        group.stop,
        d.state.value if d.state is not None else None,
        d.agent,
        d.agent_version,
        d.started_at,
        d.steps,
        d.stop_reason.value if d.stop_reason is not None else None,
        until is not None,
        _queue.epoch_of(until) if until else None,
        group.run_id,
    )


UPDATE_RUN: Final = (
    "UPDATE runs SET next_seq = ?, state = COALESCE(?, state), agent = COALESCE(?, agent), "
    "agent_version = COALESCE(?, agent_version), started_at = COALESCE(?, started_at), "
    "steps = COALESCE(?, steps), stop_reason = COALESCE(?, stop_reason), "
    "awaiting_until = CASE WHEN ? THEN ? ELSE awaiting_until END WHERE run_id = ?"
)
"""Moves a run's ``next_seq`` and applies its index delta (parameters: `index_params`)."""


UPDATE_INDEX: Final = (
    "UPDATE runs SET state = COALESCE(?, state), agent = COALESCE(?, agent), "
    "agent_version = COALESCE(?, agent_version), started_at = COALESCE(?, started_at), "
    "steps = COALESCE(?, steps), stop_reason = COALESCE(?, stop_reason), "
    "awaiting_until = CASE WHEN ? THEN ? ELSE awaiting_until END WHERE run_id = ?"
)
"""Applies a run's index delta, leaving its next seq alone (SQLite's triggers move it)."""


def index_only_params(group: RunBatch) -> tuple[Any, ...]:
    """Parameters of `UPDATE_INDEX` for one run's batch."""
    return index_params(group)[1:]


# --------------------------------------------------------------------------- reads


def load_head(dialect: SqlDialect, conn: Connection, run_id: str) -> RunHead:
    """The run's next seq as the ``runs`` row holds it (1 for a run without a row).

    Raises:
        LogCorrupted: the row's ``next_seq`` is no whole number of at least 1.
    """
    row = conn.execute(
        dialect.sql("SELECT next_seq FROM runs WHERE run_id = ?"), (run_id,)
    ).fetchone()
    return RunHead(next_seq=1 if row is None else stored_seq(dialect.description, run_id, row[0]))


def stored_seq(where: str, run_id: str, value: object) -> int:
    """A ``runs`` row's ``next_seq``, checked (a damaged page can leave NULL or text there).

    Raises:
        LogCorrupted: ``value`` is no whole number of at least 1.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise LogCorrupted(
        f"run {run_id!r}: its index row is damaged (next_seq is {value!r})",
        where=where,
        offset=None,
    )


def read_records(dialect: SqlDialect, conn: Connection, run_id: str) -> tuple[Record, ...]:
    """The run's whole log, every row checked, in one read transaction.

    Raises:
        LogCorrupted: a row is damaged, a seq is missing, or records the run's row counts
            are gone.
        SchemaTooNew: the run was written by a newer schema version.
    """
    where = dialect.description
    dialect.begin_read(conn)
    try:
        rows = conn.execute(
            dialect.sql(
                "SELECT seq, gen, kind, body, crc FROM records WHERE run_id = ? ORDER BY seq"
            ),
            (run_id,),
        ).fetchall()
        head = conn.execute(
            dialect.sql("SELECT next_seq FROM runs WHERE run_id = ?"), (run_id,)
        ).fetchone()
    finally:
        conn.execute("COMMIT")
    records = decode_rows(where, run_id, rows)
    counted = 0 if head is None else stored_seq(where, run_id, head[0]) - 1
    if counted > len(records):
        raise LogCorrupted(
            f"run {run_id!r}: records {len(records) + 1} to {counted} are missing",
            where=where,
            offset=len(records) + 1,
            unit="seq",
        )
    return records


def read_generations(dialect: SqlDialect, conn: Connection, run_id: str) -> tuple[int, ...]:
    """The lease generation of each record's writer, in seq order."""
    rows = conn.execute(
        dialect.sql("SELECT gen FROM records WHERE run_id = ? ORDER BY seq"), (run_id,)
    ).fetchall()
    return tuple(int(r[0]) for r in rows)


def list_run_ids(dialect: SqlDialect, conn: Connection) -> tuple[str, ...]:
    """Runs with at least one record, in the order they entered the store.

    Raises:
        LogCorrupted: a row of the index has no run id, or one that the index of run ids
            does not give it (`checked_rows`).
    """
    rows = conn.execute(
        f"SELECT {_ROW_CHECK}, run_id FROM runs WHERE next_seq > 1 OR {_NO_RUN_ID} ORDER BY ord"
    ).fetchall()
    return tuple(run_id for (run_id,) in checked_rows(dialect, rows))


_NO_RUN_ID: Final = "COALESCE(run_id, '') = ''"
"""A row without a run id. Not ``run_id IS NULL``: SQLite reads that as false for a NOT NULL
column without looking, and a damaged row is just what breaks the constraint."""

_ROW_CHECK: Final = "ord, (SELECT i.ord FROM runs AS i WHERE i.run_id = runs.run_id) AS indexed_ord"
"""The two columns a listing reads before the others, for `checked_rows`: the row's ``ord``,
and the ``ord`` the UNIQUE index of run ids gives the row's run id (``NULL``: it holds no
such run id).

A listing scans the rows; a run's lookups (`treadle show`, a resume, a lease) go through the
index. A changed byte in a row's run id (a damaged page) makes the two disagree: the row
reads a run id that the index gives no row, or gives another row, and its own run is left
out of the listing. Rows carry no checksum: the index is their second copy of the run id,
one probe of it per row (docs/decisions/0121-index-rows-are-checked-against-the-index.md).
"""


def checked_rows(dialect: SqlDialect, rows: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """``rows`` (each `_ROW_CHECK`'s two columns, run_id, the others) without the first two.

    A row without a run id (the column is NOT NULL) is a damaged file, read back as garbage:
    its run would drop out of every listing, and `treadle resume --all` would skip it,
    although its log is there. So would a row whose run id the index does not give it, which
    lists a run that does not exist in its place (`treadle show` finds no such run).

    Raises:
        LogCorrupted: a row has no run id (``None`` or empty), or one that the index of run
            ids does not give that row.
    """
    for at, indexed, run_id, *_ in rows:
        if run_id is None or run_id == "":
            raise LogCorrupted(
                "the run index is damaged: a row has no run id, so a run may be missing from "
                "the listing (check the database, e.g. PRAGMA integrity_check for SQLite)",
                where=dialect.description,
                offset=None,
            )
        if indexed != at:
            raise LogCorrupted(
                f"the run index is damaged: its row {at} reads run id {run_id!r}, which the "
                "index of run ids does not give that row, so the listing would show a run "
                "that does not exist in place of another (check the database, e.g. PRAGMA "
                "integrity_check for SQLite)",
                where=dialect.description,
                offset=None,
            )
    return [row[2:] for row in rows]


_SUMMARY_COLUMNS: Final = (
    "run_id, state, agent, agent_version, started_at, steps, stop_reason, awaiting_until, "
    "lease_owner, lease_generation, lease_expires, lease_heartbeat, submitted_at, claims, "
    "takeovers, quarantined, next_seq"
)


def list_summaries(
    dialect: SqlDialect, conn: Connection, last: int | None = None
) -> tuple[RunSummary, ...]:
    """Every run with a state (started or queued), in the order they entered the store.

    ``last``: only the last ``last`` of them, the others not read (``None``: every run).

    Raises:
        LogCorrupted: a row read has no run id, or one that the index of run ids does not
            give it (`checked_rows`).
    """
    order = "ORDER BY ord" if last is None else f"ORDER BY ord DESC LIMIT {int(last)}"
    dialect.begin_read(conn)
    try:
        now = dialect.now(conn)
        rows = conn.execute(
            f"SELECT {_ROW_CHECK}, {_SUMMARY_COLUMNS} FROM runs WHERE state IS NOT NULL "
            f"OR next_seq > 1 OR {_NO_RUN_ID} {order}"
        ).fetchall()
    finally:
        conn.execute("COMMIT")
    if last is not None:
        rows.reverse()
    return tuple(summary_of(dialect.description, row, now) for row in checked_rows(dialect, rows))


_FINISHED_STATES: Final = ", ".join(f"'{state.value}'" for state in RunState if state.is_terminal)
"""The terminal states as an SQL list (`RunState.is_terminal`), for `count_runs`."""


def count_runs(dialect: SqlDialect, conn: Connection) -> dict[Liveness, int]:
    """How many runs of `list_summaries` have each liveness, without reading finished rows.

    One snapshot: an aggregate counts the finished runs (their liveness needs nothing but
    their state), and only the unfinished rows are read, each judged by `summary_of`, as
    `list_summaries` judges it. A store holding many finished runs thus costs a count, not a
    decoded row per run (docs/metrics.md, "What is counted").

    Returns:
        liveness -> runs (a liveness no run has is absent).

    Raises:
        LogCorrupted: an unfinished run's row of the index has no run id, or one that the
            index of run ids does not give it (`checked_rows`).
    """
    dialect.begin_read(conn)
    try:
        now = dialect.now(conn)
        (finished,) = conn.execute(
            f"SELECT COUNT(*) FROM runs WHERE state IN ({_FINISHED_STATES}) AND NOT {_NO_RUN_ID}"
        ).fetchone()
        rows = conn.execute(
            f"SELECT {_ROW_CHECK}, {_SUMMARY_COLUMNS} FROM runs WHERE ((state IS NULL AND "
            f"next_seq > 1) OR state NOT IN ({_FINISHED_STATES})) OR {_NO_RUN_ID}"
        ).fetchall()
    finally:
        conn.execute("COMMIT")
    unfinished = checked_rows(dialect, rows)
    counts = Counter(summary_of(dialect.description, row, now).liveness for row in unfinished)
    if finished:
        counts[Liveness.FINISHED] += int(finished)
    return dict(counts)


def read_summary(dialect: SqlDialect, conn: Connection, run_id: str) -> RunSummary | None:
    """One run's summary, or ``None``."""
    dialect.begin_read(conn)
    try:
        now = dialect.now(conn)
        row = conn.execute(
            dialect.sql(
                f"SELECT {_SUMMARY_COLUMNS} FROM runs WHERE run_id = ? "
                "AND (state IS NOT NULL OR next_seq > 1)"
            ),
            (run_id,),
        ).fetchone()
    finally:
        conn.execute("COMMIT")
    return None if row is None else summary_of(dialect.description, row, now)


def summary_of(where: str, row: Sequence[Any], now: float) -> RunSummary:
    """A `RunSummary` from a row of `_SUMMARY_COLUMNS`; a damaged row gives ``error``.

    A damaged row keeps its quarantine's reason: the first claim that meets it quarantines
    it, saying what is wrong, and `treadle show`, `tail`, `wait` and `runs` name that reason
    (docs/fleet.md, "Poison runs").
    """
    run_id, quarantined = row[0], row[15]
    lease: Lease | None = None
    try:
        lease = _lease_of(run_id, row[8:12])
        return _summary(where, row, now, lease)
    except (StoreError, TypeError, ValueError, OverflowError) as exc:
        return RunSummary(
            run_id=run_id,
            state=None,
            liveness=_leases.liveness(state=None, lease=lease, quarantined=quarantined, now=now),
            observed_at=now,
            lease=lease,
            quarantined=_queue.still_quarantined(None, quarantined),
            error=str(exc) if isinstance(exc, StoreError) else f"damaged index row: {exc}",
            where=where,
        )


def _summary(where: str, row: Sequence[Any], now: float, lease: Lease | None) -> RunSummary:
    (
        run_id,
        state,
        agent,
        version,
        started,
        steps,
        stop,
        until,
        _,
        _,
        _,
        _,
        submitted,
        claims,
        takeovers,
        quarantined,
        next_seq,
    ) = row
    run_state = None if state is None else RunState(state)
    return RunSummary(
        run_id=run_id,
        state=run_state,
        liveness=_leases.liveness(state=run_state, lease=lease, quarantined=quarantined, now=now),
        observed_at=now,
        lease=lease,
        agent=agent,
        agent_version=version,
        steps=int(steps or 0),
        stop_reason=None if stop is None else StopReason(stop),
        started_at=started,
        submitted_at=submitted,
        claims=int(claims or 0),
        takeovers=int(takeovers or 0),
        quarantined=_queue.still_quarantined(run_state, quarantined),
        awaiting_until=None if until is None else _iso(until),
        records=int(next_seq) - 1,
    )


def _iso(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).isoformat()


# --------------------------------------------------------------------------- leases


_LEASE_COLUMNS: Final = "lease_owner, lease_generation, lease_expires, lease_heartbeat"


def _lease_of(run_id: str, row: Sequence[Any] | None) -> Lease | None:
    """The lease a row of `_LEASE_COLUMNS` holds (``None``: none).

    Raises:
        StoreError: the row's lease columns hold no numbers (changed by hand).
    """
    if row is None or not row[1]:
        return None
    owner, gen, expires, beat = row
    try:
        return Lease(
            run_id=run_id,
            owner=owner,
            generation=int(gen),
            expires_at=float(expires),
            heartbeat_at=float(beat),
        )
    except (TypeError, ValueError) as exc:
        damage = f"damaged index row of run {run_id!r}: its lease is unreadable ({exc})"
        raise StoreError(damage) from None


def _set_lease(dialect: SqlDialect, conn: Connection, lease: Lease) -> None:
    conn.execute(
        dialect.sql(
            "UPDATE runs SET lease_owner = ?, lease_generation = ?, lease_expires = ?, "
            "lease_heartbeat = ? WHERE run_id = ?"
        ),
        (lease.owner, lease.generation, lease.expires_at, lease.heartbeat_at, lease.run_id),
    )


def _locked_row(
    dialect: SqlDialect, conn: Connection, run_id: str, columns: str, *, create: bool
) -> Any:
    query = dialect.sql(f"SELECT {columns} FROM runs WHERE run_id = ?{dialect.for_update}")
    row = conn.execute(query, (run_id,)).fetchone()
    if row is None and create:
        conn.execute(
            dialect.sql("INSERT INTO runs(run_id) VALUES (?) ON CONFLICT (run_id) DO NOTHING"),
            (run_id,),
        )
        row = conn.execute(query, (run_id,)).fetchone()
    return row


def acquire_lease(
    dialect: SqlDialect, conn: Connection, run_id: str, owner: str, ttl_s: float
) -> Lease:
    """Take or renew the lease on ``run_id`` in one transaction (`treadle.stores._leases`)."""
    with write_transaction(dialect, conn, flush=dialect.flush_acquire):
        now = dialect.now(conn)
        current = _lease_of(run_id, _locked_row(dialect, conn, run_id, _LEASE_COLUMNS, create=True))
        lease = _leases.acquire(current, run_id=run_id, owner=owner, ttl_s=ttl_s, now=now)
        _set_lease(dialect, conn, lease)
        return lease


def renew_leases(
    dialect: SqlDialect, conn: Connection, leases: Sequence[Lease], ttl_s: float
) -> tuple[Lease, ...]:
    """Renew the leases still held, in one transaction; the lost ones are left out.

    The rows are locked in run id order (code point order), as the group commit locks them
    (PostgreSQL): two transactions that take the same row locks in one order cannot deadlock.
    A row another transaction keeps locked for longer than `RENEW_LOCK_WAIT_MS` (someone's
    long transaction, not a commit) is passed over: a lease that is still this holder's there
    is returned as it was, unrenewed this time, and renewed at the next turn. Waiting on one
    locked row held up every other lease of the holder until they expired, and each of its
    runs was taken over.
    """
    renewed = []
    row_locks = bool(dialect.for_update)  # PostgreSQL; SQLite locks the whole file instead
    with write_transaction(dialect, conn, flush=False):
        now = dialect.now(conn)
        if row_locks:
            conn.execute(f"SET LOCAL lock_timeout = '{RENEW_LOCK_WAIT_MS}ms'")
        for held in sorted(leases, key=_by_run):
            row = _row_unless_kept_locked(dialect, conn, held.run_id, savepoint=row_locks)
            if row is _KEPT_LOCKED:  # read it unlocked: still this holder's, and not expired?
                row = conn.execute(
                    dialect.sql(f"SELECT {_LEASE_COLUMNS} FROM runs WHERE run_id = ?"),
                    (held.run_id,),
                ).fetchone()
                if _leases.renew(_lease_of(held.run_id, row), held, ttl_s=ttl_s, now=now) and (
                    held.expires_at > now
                ):
                    renewed.append(held)  # held still, renewed at its next turn
                continue
            fresh = _leases.renew(_lease_of(held.run_id, row), held, ttl_s=ttl_s, now=now)
            if fresh is not None:
                _set_lease(dialect, conn, fresh)
                renewed.append(fresh)
    return tuple(renewed)


RENEW_LOCK_WAIT_MS: Final = 250
"""Milliseconds a lease renewal waits for a run's row that another transaction has locked
(PostgreSQL ``lock_timeout``) before passing it over until its next turn."""

_KEPT_LOCKED: Final = object()
"""`_row_unless_kept_locked`'s answer for a row that stayed locked."""


def _row_unless_kept_locked(
    dialect: SqlDialect, conn: Connection, run_id: str, *, savepoint: bool
) -> Any:
    """The run's lease columns, locked; `_KEPT_LOCKED` when the lock was not had in time.

    With ``savepoint`` (PostgreSQL's row locks), under a savepoint, so that the lock timeout
    (SQLSTATE 55P03) ends only this row's attempt, not the transaction.
    """
    if not savepoint:
        return _locked_row(dialect, conn, run_id, _LEASE_COLUMNS, create=False)
    conn.execute("SAVEPOINT renew_row")
    try:
        row = _locked_row(dialect, conn, run_id, _LEASE_COLUMNS, create=False)
    except Exception as exc:
        if not lock_timeout(exc):
            raise
        conn.execute("ROLLBACK TO SAVEPOINT renew_row")
        return _KEPT_LOCKED
    conn.execute("RELEASE SAVEPOINT renew_row")
    return row


def renew_leases_again_on_deadlock(
    dialect: SqlDialect, conn: Connection, leases: Sequence[Lease], ttl_s: float
) -> tuple[Lease, ...]:
    """`renew_leases`, made again when it is ended as a deadlock victim (`again_on_deadlock`).

    Another program's transactions on the same rows may lock them in another order.
    """
    return again_on_deadlock(functools.partial(renew_leases, dialect, conn, leases, ttl_s))


def again_on_deadlock(transaction: Callable[[], _T]) -> _T:
    """``transaction()``, made again while it is ended as a deadlock victim (SQLSTATE 40P01).

    At most `DEADLOCK_RETRIES` times again (PostgreSQL; SQLite never ends one so). The server
    rolls a deadlock victim's whole transaction back, so making it again does its writes once.
    ``transaction`` must be one whole transaction (blocking: call it in a worker thread).

    Raises:
        Exception: what the last attempt raised (the deadlock after the last retry).
    """
    attempt = 0
    while True:
        try:
            return transaction()
        except Exception as exc:
            if attempt == DEADLOCK_RETRIES or not deadlock(exc):
                raise
        attempt += 1
        time.sleep(0.01 * attempt)


def deadlock(exc: BaseException) -> bool:
    """Whether the server ended the transaction to break a deadlock (SQLSTATE 40P01)."""
    return getattr(exc, "sqlstate", None) == "40P01"


def lock_timeout(exc: BaseException) -> bool:
    """Whether a statement gave up waiting for a lock (``lock_timeout``, SQLSTATE 55P03)."""
    return getattr(exc, "sqlstate", None) == "55P03"


DEADLOCK_RETRIES: Final = 5
"""Times a transaction the server ended as a deadlock victim is made again before it fails."""


def _by_run(lease: Lease) -> str:
    return lease.run_id


def release_lease(dialect: SqlDialect, conn: Connection, lease: Lease, control_seen: int) -> None:
    """Clear the lease's owner if still held, and record the control position handled."""
    with write_transaction(dialect, conn, flush=False):
        conn.execute(
            dialect.sql(
                "UPDATE runs SET lease_owner = '', control_seen = CASE WHEN control_seen > ? "
                "THEN control_seen ELSE ? END WHERE run_id = ? AND lease_owner = ? AND "
                "lease_generation = ?"
            ),
            (control_seen, control_seen, lease.run_id, lease.owner, lease.generation),
        )


def read_lease(dialect: SqlDialect, conn: Connection, run_id: str) -> Lease | None:
    """The run's lease as stored."""
    row = conn.execute(
        dialect.sql(f"SELECT {_LEASE_COLUMNS} FROM runs WHERE run_id = ?"), (run_id,)
    ).fetchone()
    return _lease_of(run_id, row)


class write_transaction:
    """``with write_transaction(dialect, conn):`` BEGIN (for writing) ... COMMIT, or ROLLBACK.

    ``flush=False`` lets the commit return before its own flush to disk (lease operations only:
    docs/decisions/0016-lease-writes-ride-on-log-commits.md); the connection flushes again
    after it. A failing ROLLBACK (a lost connection) is not reported over the error that caused
    it: the transaction is gone either way, and the first error propagates.
    """

    def __init__(self, dialect: SqlDialect, conn: Connection, *, flush: bool = True) -> None:
        self._dialect, self._conn, self._flush = dialect, conn, flush

    def __enter__(self) -> None:
        self._dialect.begin_write(self._conn, flush=self._flush)

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        try:
            if kind is None:
                self._conn.execute("COMMIT")
                return
            with contextlib.suppress(Exception):
                self._conn.execute("ROLLBACK")
        finally:
            self._dialect.end_write(self._conn, flush=self._flush)


class ConnectionPool:
    """Idle connections shared by worker threads (thread-safe).

    Args:
        connect: opens a new connection.
        keep: idle connections kept; more are closed when handed back. As many as the store's
            calls that run at once (`treadle.stores._engine.MAX_WORKERS`, its reads and its
            lease and control calls), so that none is closed and opened again while runs
            start.
    """

    def __init__(self, connect: Callable[[], Connection], keep: int = MAX_WORKERS) -> None:
        self._connect = connect
        self._keep = keep
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> Connection:
        """An idle connection, or a new one (blocking: call it in a worker thread)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def take_new(self) -> Connection:
        """A new connection, never an idle one (blocking: call it in a worker thread)."""
        return self._connect()

    def give(self, conn: Connection, *, broken: bool = False) -> None:
        """Hand ``conn`` back; a broken one, or one beyond ``keep``, is closed."""
        with self._lock:
            if not broken and not self._closed and len(self._idle) < self._keep:
                self._idle.append(conn)
                return
        with contextlib.suppress(Exception):
            conn.close()

    def lose(self, conn: Connection) -> None:
        """Close ``conn``, whose connection was lost, and every idle connection with it.

        What ends one session of a server (its restart, a failover, an administrator ending
        the store's sessions) has most likely ended the idle ones opened to it too: the calls
        that follow open new connections instead of each failing once on a dead one.
        """
        with self._lock:
            idle, self._idle = self._idle, []
        for each in (conn, *idle):
            with contextlib.suppress(Exception):
                each.close()

    def close(self) -> None:
        """Close every idle connection; later ones handed back are closed."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(Exception):
                conn.close()


# --------------------------------------------------------------------------- control streams


def append_control(
    dialect: SqlDialect, conn: Connection, record: CancelRequested | ApprovalDecided
) -> ControlEntry:
    """Append to the run's control stream and move its ``control_head``, in one transaction."""
    run_id = record.run_id
    kind = KIND_OF[type(record)]
    body = encode_bytes(record)
    with write_transaction(dialect, conn):
        row = _locked_row(dialect, conn, run_id, "control_head, state, next_seq", create=False)
        if row is None or (row[1] is None and row[2] <= 1):
            raise UsageError(f"there is no run {run_id!r} in {dialect.description}")
        position = int(row[0]) + 1
        conn.execute(
            dialect.sql("INSERT INTO control(run_id, pos, kind, body, crc) VALUES (?, ?, ?, ?, ?)"),
            (run_id, position, kind, body, record_crc(run_id, position, 0, kind, body)),
        )
        conn.execute(
            dialect.sql("UPDATE runs SET control_head = ? WHERE run_id = ?"), (position, run_id)
        )
    return ControlEntry(run_id=run_id, position=position, record=record)


def read_control(
    dialect: SqlDialect, conn: Connection, run_id: str, after: int
) -> tuple[ControlEntry, ...]:
    """The run's control entries after ``after``, each checked."""
    rows = conn.execute(
        dialect.sql(
            "SELECT pos, kind, body, crc FROM control WHERE run_id = ? AND pos > ? ORDER BY pos"
        ),
        (run_id, after),
    ).fetchall()
    entries = []
    for expected, (pos, kind, body, crc) in enumerate(rows, start=after + 1):
        body = bytes(body)
        if pos != expected or record_crc(run_id, pos, 0, kind, body) != crc:
            raise LogCorrupted(
                f"run {run_id!r}: control entry {expected} is damaged or missing",
                where=dialect.description,
                offset=expected,
                unit="position",
            )
        try:
            record = decode(body)
        except Exception as exc:
            raise LogCorrupted(
                f"run {run_id!r}: undecodable control entry {pos}: {exc}",
                where=dialect.description,
                offset=pos,
                unit="position",
            ) from exc
        if not isinstance(record, CancelRequested | ApprovalDecided):
            raise LogCorrupted(
                f"run {run_id!r}: control entry {pos} is a {kind}",
                where=dialect.description,
                offset=pos,
                unit="position",
            )
        entries.append(ControlEntry(run_id=run_id, position=pos, record=record))
    return tuple(entries)


IN_LIST_MAX: Final = 512
"""The most values one ``IN (...)`` list holds (a power of two; longer lists are split)."""


def in_lists(values: Sequence[str]) -> Iterator[tuple[str, list[str]]]:
    """``values`` as ``IN (...)`` lists: ``(placeholders, parameters)`` pairs, none if empty.

    Each list holds at most `IN_LIST_MAX` values and is padded to a power of two by
    repeating its last value (which changes no ``IN`` test): a query then comes in a few
    shapes instead of one per length, and each shape a driver prepares stays in its
    connection's statement cache (docs/decisions/0094-few-statement-shapes.md).
    """
    for start in range(0, len(values), IN_LIST_MAX):
        chunk = list(values[start : start + IN_LIST_MAX])
        chunk += [chunk[-1]] * ((1 << (len(chunk) - 1).bit_length()) - len(chunk))
        yield ", ".join("?" * len(chunk)), chunk


def control_heads(dialect: SqlDialect, conn: Connection, run_ids: Sequence[str]) -> dict[str, int]:
    """The ``control_head`` of each run that has control entries."""
    heads: dict[str, int] = {}
    for marks, chunk in in_lists(run_ids):
        rows = conn.execute(
            dialect.sql(
                "SELECT run_id, control_head FROM runs WHERE control_head > 0 "
                f"AND run_id IN ({marks})"
            ),
            chunk,
        ).fetchall()
        heads.update((r[0], int(r[1])) for r in rows)
    return heads


# --------------------------------------------------------------------------- the queue


def submit(dialect: SqlDialect, conn: Connection, entry: Submission) -> Submission:
    """Queue a run (idempotent: the same submission again returns the first).

    ``entry.submitted_at`` is set from the store's clock.
    """
    run_id, agent, input = entry.run_id, entry.agent, entry.input
    with write_transaction(dialect, conn):
        now = dialect.now(conn)
        # create=True: two submits of one id at once both find no row; the second's INSERT
        # then waits for the first's and does nothing, and it reads the first's submission.
        row = _locked_row(
            dialect, conn, run_id, "state, next_seq, agent, submission, submitted_at", create=True
        )
        if row is not None and (row[0] is not None or row[1] > 1):
            earlier = None
            if row[3] is not None:
                earlier = decode_submission(
                    bytes(row[3]), run_id=run_id, agent=row[2], submitted_at=row[4]
                )
            return _queue.same_submission(run_id, earlier, agent, input)
        made = attrs.evolve(entry, submitted_at=now)
        conn.execute(
            dialect.sql(
                "UPDATE runs SET state = ?, agent = ?, submission = ?, submitted_at = ? "
                "WHERE run_id = ?"
            ),
            (RunState.QUEUED.value, agent, encode_submission(made), now, run_id),
        )
    return made


_QUEUE_COLUMNS: Final = (
    "run_id, state, agent, agent_version, lease_owner, lease_generation, lease_expires, "
    "lease_heartbeat, control_head, control_seen, awaiting_until, not_before, quarantined, "
    "takeovers, submission, submitted_at"
)


def claim(
    dialect: SqlDialect,
    conn: Connection,
    owner: str,
    agents: Mapping[str, Sequence[str]],
    limit: int,
    ttl_s: float,
    max_takeovers: int,
    backoff_s: float,
    driving: frozenset[str] = frozenset(),
) -> tuple[Claim, ...]:
    """Claim up to ``limit`` runs in one transaction (`treadle.stores._queue`).

    The runs in ``driving`` (the claimer drives them) are never claimed: the query asks for
    as many more candidates, and they are passed over.
    """
    if limit < 1 or not agents:
        return ()
    claims: list[Claim] = []
    with write_transaction(dialect, conn):
        now = dialect.now(conn)
        query, params = _candidates(dialect, agents, now, limit + len(driving))
        for row in conn.execute(query, params).fetchall():
            if len(claims) >= limit:
                break
            if row[0] in driving:
                continue
            made = _claim_row(
                dialect, conn, row, owner, agents, ttl_s, max_takeovers, backoff_s, now
            )
            if made is not None:
                claims.append(made)
    return tuple(claims)


def _candidates(
    dialect: SqlDialect, agents: Mapping[str, Sequence[str]], now: float, limit: int
) -> tuple[str, list[Any]]:
    """The claim query: the coarse part of the rules of `treadle.stores._queue`, in SQL."""
    served = []
    params: list[Any] = [*TERMINAL_STATES, now, now]
    for agent, versions in agents.items():
        marks = ", ".join("?" * len(versions)) or "NULL"
        served.append(
            "(agent = ? AND (state = 'queued' OR agent_version IS NULL OR "
            f"agent_version IN ({marks})))"
        )
        params.extend([agent, *versions])
    params.extend([now, limit])
    terminal = ", ".join("?" * len(TERMINAL_STATES))
    query = (
        f"SELECT {_QUEUE_COLUMNS} FROM runs WHERE state IS NOT NULL AND state NOT IN ({terminal}) "
        "AND quarantined IS NULL AND not_before <= ? AND (lease_owner = '' OR lease_expires <= ?) "
        f"AND ({' OR '.join(served)}) AND (state NOT IN ('awaiting_approval', 'awaiting_child') "
        "OR lease_owner <> '' OR "
        "control_head > control_seen OR awaiting_until <= ?) "
        f"ORDER BY ord LIMIT ?{dialect.skip_locked}"
    )
    return dialect.sql(query), params


def _claim_row(
    dialect: SqlDialect,
    conn: Connection,
    row: Sequence[Any],
    owner: str,
    agents: Mapping[str, Sequence[str]],
    ttl_s: float,
    max_takeovers: int,
    backoff_s: float,
    now: float,
) -> Claim | None:
    """Claim the run of ``row`` (of `_QUEUE_COLUMNS`) if the rules say so; ``None`` if not.

    A row that cannot be read (a state no run has, a submission that does not decode, a
    lease that holds no numbers) is quarantined instead (`_quarantine_damaged`): a damaged
    run never blocks the other runs (docs/fleet.md, "Poison runs").
    """
    run_id = row[0]
    try:
        queue_row, queued = _queue_entry(row)
    except (StoreError, ValueError, TypeError) as exc:
        _quarantine_damaged(dialect, conn, run_id, exc)
        return None
    lease = queue_row.lease
    kind = _queue.claim_kind(queue_row, agents, now)
    if kind is None:
        return None
    takeover = kind == "takeover"
    count = queue_row.takeovers + (1 if takeover else 0)
    if takeover and count >= max_takeovers:
        conn.execute(
            dialect.sql("UPDATE runs SET quarantined = ?, takeovers = ? WHERE run_id = ?"),
            (_queue.quarantine_reason(count, lease), count, run_id),
        )
        return None
    fresh = _leases.acquire(lease, run_id=run_id, owner=owner, ttl_s=ttl_s, now=now)
    conn.execute(
        dialect.sql(
            "UPDATE runs SET lease_owner = ?, lease_generation = ?, lease_expires = ?, "
            "lease_heartbeat = ?, claims = claims + 1, takeovers = ?, not_before = ? "
            "WHERE run_id = ?"
        ),
        (
            fresh.owner,
            fresh.generation,
            fresh.expires_at,
            fresh.heartbeat_at,
            count,
            _queue.next_not_before(now, count, backoff_s),
            run_id,
        ),
    )
    return Claim(lease=fresh, agent=row[2], submission=queued, takeover=takeover)


def _queue_entry(row: Sequence[Any]) -> tuple[_queue.QueueRow, Submission | None]:
    """What a row of `_QUEUE_COLUMNS` says: its queue row, and its submission while queued.

    A run taken over before its dead claimer started it carries its submission too.

    Raises:
        ValueError: a state no run has, or a submission that does not decode.
        TypeError: a number column without a number.
        StoreError: lease columns without numbers (`_lease_of`).
    """
    (
        run_id,
        state,
        agent,
        version,
        l_owner,
        l_gen,
        l_exp,
        l_beat,
        head,
        seen,
        until,
        not_before,
        quarantined,
        takeovers,
        submission,
        submitted_at,
    ) = row
    queue_row = _queue.QueueRow(
        state=RunState(state),
        agent=agent,
        agent_version=version,
        lease=_lease_of(run_id, (l_owner, l_gen, l_exp, l_beat)),
        control_head=int(head),
        control_seen=int(seen),
        awaiting_until=None if until is None else _iso(until),
        not_before=float(not_before),
        quarantined=quarantined,
        takeovers=int(takeovers),
    )
    queued = None
    if queue_row.state is RunState.QUEUED and submission is not None:
        queued = decode_submission(
            bytes(submission), run_id=run_id, agent=agent, submitted_at=submitted_at
        )
    return queue_row, queued


def _quarantine_damaged(
    dialect: SqlDialect, conn: Connection, run_id: str, damage: Exception
) -> None:
    """Quarantine run ``run_id``, whose row a claim could not read (``damage`` says why).

    Logged once, naming the run: quarantined, the row is no candidate of later claims.
    `treadle unquarantine` makes it claimable again once the row is repaired.
    """
    what = f"its row in the run index is damaged: {damage!s:.300}"
    _LOG.error("run %r is not claimed and is quarantined: %s", run_id, what)
    conn.execute(
        dialect.sql("UPDATE runs SET quarantined = ? WHERE run_id = ?"),
        (f"{what}; repair it, then `treadle unquarantine RUN_ID` makes it claimable again", run_id),
    )


def read_submission(dialect: SqlDialect, conn: Connection, run_id: str) -> Submission | None:
    """The run's queue entry, or ``None``."""
    row = conn.execute(
        dialect.sql("SELECT agent, submission, submitted_at FROM runs WHERE run_id = ?"), (run_id,)
    ).fetchone()
    if row is None or row[1] is None:
        return None
    return decode_submission(bytes(row[1]), run_id=run_id, agent=row[0], submitted_at=row[2])


def release_quarantine(dialect: SqlDialect, conn: Connection, run_id: str) -> bool:
    """Clear a run's quarantine and its takeover count; ``False`` if it was not quarantined."""
    with write_transaction(dialect, conn):
        cursor = conn.execute(
            dialect.sql(
                "UPDATE runs SET quarantined = NULL, takeovers = 0, not_before = 0 "
                "WHERE run_id = ? AND quarantined IS NOT NULL"
            ),
            (run_id,),
        )
        return bool(cursor.rowcount)


def wake(dialect: SqlDialect, conn: Connection, run_id: str) -> bool:
    """Make a run waiting on child runs claimable now; ``False`` if it waits on none."""
    with write_transaction(dialect, conn, flush=False):
        now = dialect.now(conn)
        cursor = conn.execute(
            dialect.sql(
                "UPDATE runs SET awaiting_until = ? WHERE run_id = ? AND state = ? "
                "AND (awaiting_until IS NULL OR awaiting_until > ?)"
            ),
            (now, run_id, RunState.AWAITING_CHILD.value, now),
        )
        return bool(cursor.rowcount)


# --------------------------------------------------------------------------- the committer side


class SqlBackend:
    """What the SQL backends share: encoding rows, loading a run's next seq.

    A subclass commits batches (`treadle.stores._engine.Backend.commit`) and finishes.

    Args:
        dialect: the store's dialect.
        pool: connections for loading.
    """

    def __init__(self, dialect: SqlDialect, pool: ConnectionPool) -> None:
        self.description = dialect.description
        self._dialect = dialect
        self._pool = pool

    def encode(self, run_id: str, seq: int, generation: int, records: tuple[Record, ...]) -> object:
        """The write's record rows, flat (`encode_values`)."""
        return encode_values(run_id, seq, generation, records)

    def size(self, payload: object) -> int:
        """The bytes of the rows' bodies (`encode_values`' flat values)."""
        values: tuple[Any, ...] = payload  # type: ignore[assignment]
        return sum(len(body) for body in values[_BODY::ROW_WIDTH])

    def admit(self, run_id: str, generation: int) -> None:
        """Nothing to check before the transaction: fencing happens inside it."""

    def load(self, run_id: str) -> RunHead:
        """The run's next seq from its ``runs`` row (a read: `read_pooled`)."""
        return read_pooled(self._dialect, self._pool, load_head, run_id)


# --------------------------------------------------------------------------- the store


class SqlStore(EngineStore):
    """A run store on SQL tables; `treadle.SqliteStore` and `treadle.PostgresStore` are it.

    It implements the run store seam and every capability (`LeaseStore`, `ControlStream`,
    `RunIndex` with `RunCounts`, `RunQueue`). Writes go through the store's commit engine
    (group commit across runs); reads and control operations run in worker threads on their
    own connections, so they never wait for the committer and only ever see committed
    transactions. Use it from the trio run that opened it: every call from another one
    raises `UsageError` (docs/asyncio.md, "Calling treadle from asyncio").

    Every write raises:
        ConflictError: ``seq`` is not the run's next seq. Nothing of the write is stored.
        LeaseLost: ``generation`` is not the run's current lease generation (another driver
            took the run over). Nothing of the write is stored.
        UsageError: a record cannot be encoded as JSON, or names another run.
        StoreError: the transaction of this barrier failed (the driver's error is the
            ``__cause__``), an earlier write of the run failed, the store lost records this
            writer acknowledged, or the store is closed.

    Cancellation:
        Every operation is a checkpoint. A write cancelled before it was queued writes
        nothing. A barrier cancelled while awaiting its commit stays queued and WILL commit.
        On PostgreSQL (a remote engine), any other call cancelled while it waits for the
        server returns at once, its thread left to end on its own: a write among them (a
        claim, a lease call, a control append, a submit) has an unknown outcome
        (docs/decisions/0145-a-cancelled-store-call-returns-at-once.md).
    """

    def __init__(self, dialect: SqlDialect, engine: CommitEngine, pool: ConnectionPool) -> None:
        """Private: use `treadle.open_sqlite_store` or `treadle.open_postgres_store`."""
        self._dialect = dialect
        self._engine = engine
        self._pool = pool

    def same_database(self, other: object) -> bool:
        """Whether ``other`` is a store object on the same tables as this one.

        This object, or another SQL store of the same SQLite file (by its real path) or the
        same PostgreSQL DSN and schema: a fleet worker queues a child run only on its own
        database (docs/child-runs.md, "In a fleet").
        """
        return other is self or (
            isinstance(other, SqlStore) and other._dialect.identity == self._dialect.identity
        )

    @property
    def description(self) -> str:
        """The store, for messages (no password)."""
        return self._dialect.description

    def statistics(self) -> StoreStatistics:
        """Commit counters since the store was opened."""
        return self._engine.statistics()

    async def read_log(self, run_id: str) -> RunLog:
        """Read the run's whole log, after the writes queued for it here have committed.

        Returns:
            The log, records in seq order; an empty log for a run that does not exist.

        Raises:
            LogCorrupted: a stored record fails its checksum or cannot be decoded, a seq is
                missing, or records the run's index row counts are gone (``offset``: a seq).
            SchemaTooNew: the run was started by a newer schema version.
            StoreError: the database cannot be read, or the store is closed.
            InvalidRunId: not an allowed run id; nothing is read.
        """
        check_run_id(run_id)
        await self._engine.settle(run_id)
        records = await self._read(read_records, run_id)
        return RunLog(run_id=run_id, records=records)

    async def read_generations(self, run_id: str) -> tuple[int, ...]:
        """The lease generation of each record's writer, in seq order (an audit of fencing).

        Records written before this layout (migrated) have generation 0.
        """
        await self._engine.settle(run_id)
        return await self._read(read_generations, run_id)

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one committed record, in the order they entered."""
        await self._engine.settle()
        return await self._read(list_run_ids)

    async def list_summaries(self, *, last: int | None = None) -> tuple[RunSummary, ...]:
        """Every run (queued ones too) from the index, without reading logs.

        ``last``: only the last ``last`` of them (`treadle.ports.RunIndex.list_summaries`).
        """
        last = checked_last(last)
        await self._engine.settle()
        return await self._read(list_summaries, last)

    async def count_runs(self) -> Mapping[Liveness, int]:
        """How many runs the index holds by liveness (`treadle.ports.RunCounts`).

        What `list_summaries` would say, counted in SQL for the finished runs: no finished
        row is read or decoded.

        Raises:
            LogCorrupted: an unfinished run's row of the index has no run id, or one that
                the index of run ids does not give it.
            StoreError: the database cannot be read, or the store is closed.
        """
        await self._engine.settle()
        return await self._read(count_runs)

    async def read_summary(self, run_id: str) -> RunSummary | None:
        """One run's summary from the index, or ``None``."""
        await self._engine.settle(run_id)
        return await self._read(read_summary, run_id)

    async def acquire_lease(self, run_id: str, *, owner: str, ttl_s: float) -> Lease:
        """Take (or renew, for its holder) the lease on ``run_id`` (`treadle.ports.LeaseStore`).

        Raises:
            RunLeased: another owner holds a live lease.
            InvalidRunId: not an allowed run id.
            StoreError: the store failed.
        """
        check_run_id(run_id)
        _leases.check_ttl(ttl_s)
        lease = await self._run(acquire_lease, run_id, owner, ttl_s)
        self._engine.forget(run_id)  # another driver may have written since we last did
        return lease

    async def renew_leases(self, leases: Sequence[Lease], *, ttl_s: float) -> tuple[Lease, ...]:
        """Renew the leases still held, in one transaction; a missing one was lost."""
        _leases.check_ttl(ttl_s)
        if not leases:
            await trio.lowlevel.checkpoint()
            return ()
        return await self._run(renew_leases_again_on_deadlock, tuple(leases), ttl_s, shared=True)

    async def release_lease(self, lease: Lease, *, control_seen: int = 0) -> None:
        """Release the lease if still held, once the run's queued writes committed."""
        await self._engine.settle(lease.run_id)
        await self._run(release_lease, lease, control_seen)
        self._engine.forget(lease.run_id)  # its next write comes with a new lease: loaded then

    async def read_lease(self, run_id: str) -> Lease | None:
        """The run's lease as stored, or ``None``."""
        return await self._read(read_lease, run_id, shared=True)

    async def append_control(self, record: CancelRequested | ApprovalDecided) -> ControlEntry:
        """Append to the run's control stream; durable on return (`treadle.ports.ControlStream`).

        Raises:
            UsageError: the store holds no such run.
            InvalidRunId: not an allowed run id.
            StoreError: the write failed.
        """
        check_run_id(record.run_id)
        return await self._run(append_control, record)

    async def read_control(self, run_id: str, *, after: int = 0) -> tuple[ControlEntry, ...]:
        """The run's control entries after position ``after``."""
        return await self._read(read_control, run_id, after, shared=True)

    async def control_heads(self, run_ids: Sequence[str]) -> Mapping[str, int]:
        """The last control position of each run that has entries."""
        if not run_ids:
            await trio.lowlevel.checkpoint()
            return {}
        return await self._read(control_heads, tuple(run_ids), shared=True)

    async def submit(
        self,
        run_id: str,
        *,
        agent: str,
        input: tuple[Message, ...],
        caps: BudgetCaps | None = None,
        parent: tuple[str, str] | None = None,
    ) -> Submission:
        """Queue a new run (`treadle.ports.RunQueue.submit`)."""
        check_run_id(run_id)
        entry = Submission(
            run_id=run_id,
            agent=agent,
            input=input,
            submitted_at=0.0,
            caps=caps,
            parent_run_id=parent[0] if parent else None,
            parent_intent_id=parent[1] if parent else None,
        )
        return await self._run(submit, entry)

    async def claim(
        self,
        *,
        owner: str,
        agents: Mapping[str, Sequence[str]],
        limit: int,
        ttl_s: float,
        max_takeovers: int,
        backoff_s: float,
        driving: Collection[str] = (),
    ) -> tuple[Claim, ...]:
        """Claim up to ``limit`` runs, taking their leases (`treadle.ports.RunQueue.claim`).

        Raises:
            StoreError: the store failed.
            StoreStopped: its committer has stopped (no run taken now could be written:
                `CommitEngine.check_writable`).
        """
        _leases.check_ttl(ttl_s)
        self._engine.check_writable()
        claims = await self._run(
            claim, owner, dict(agents), limit, ttl_s, max_takeovers, backoff_s, frozenset(driving)
        )
        for made in claims:
            self._engine.forget(made.lease.run_id)
        return claims

    async def release_quarantine(self, run_id: str) -> bool:
        """Make a quarantined run claimable again."""
        return await self._run(release_quarantine, run_id)

    async def wake(self, run_id: str) -> bool:
        """Make a run parked on child runs claimable now (`treadle.ports.RunQueue.wake`)."""
        return await self._run(wake, run_id)

    async def read_submission(self, run_id: str) -> Submission | None:
        """The run's queue entry, or ``None``."""
        return await self._read(read_submission, run_id)

    async def aclose(self) -> None:
        """Commit everything queued, stop the committer and close every connection.

        Idempotent. Later operations raise `StoreError`.

        Raises:
            StoreError: a write failed after it returned and no later call of that run
                reported it, or the committer did not stop in time.
            UsageError: called from another trio run than the one that opened the store
                (docs/asyncio.md, "Calling treadle from asyncio"); nothing is closed.
        """
        self._engine.check_trio_run()
        try:
            await self._engine.aclose()
        finally:
            self._pool.close()

    async def _run(self, fn: Callable[..., _T], *args: Any, shared: bool = False) -> _T:
        """``fn(dialect, conn, *args)`` in a worker thread, on a pooled connection.

        ``shared``: a call of the work the store's runs share (a lease renewal, a control
        reading), in threads of its own (`SHARED_WORKERS`), not behind the runs' reads.

        Cancellation:
            On a remote store (PostgreSQL, `CommitEngine.remote`), returns at once, however
            long the server takes to answer: the thread is left to end on its own, its
            connection then closed, not pooled (`call_given_up`). A write cut so has an
            unknown outcome: it may commit after its caller stopped waiting (a claim's
            leases then expire after their TTL, and the next claim of those runs is a
            takeover; docs/fleet.md, "What each crash does"). SQLite's calls, which its
            busy timeout bounds, end first.
        """
        return await self._pooled(run_pooled, fn, *args, shared=shared)

    async def _read(self, fn: Callable[..., _T], *args: Any, shared: bool = False) -> _T:
        """`_run` for a read (``fn`` changes nothing), run once more if its connection was lost.

        The second try is on a new connection (`read_pooled`). Cancelled, it returns as
        `_run` does.
        """
        return await self._pooled(read_pooled, fn, *args, shared=shared)

    async def _pooled(
        self,
        runner: Callable[..., _T],
        fn: Callable[..., _T],
        *args: Any,
        shared: bool,
    ) -> _T:
        """``runner(dialect, pool, fn, *args)`` in a worker thread, as `_run` says."""
        self._engine.check_open()
        return await self._engine.in_thread(
            runner,
            self._dialect,
            self._pool,
            fn,
            *args,
            shared=shared,
            what=fn.__name__,
        )


def run_pooled(dialect: SqlDialect, pool: ConnectionPool, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(dialect, conn, *args)`` on a pooled connection, driver errors translated.

    Run once: ``fn`` may write, and a write whose connection was lost has an unknown outcome
    (it may have committed), so it is never run again here (`read_pooled` runs a read again).
    A lost connection closes the pool's idle ones too (`ConnectionPool.lose`).

    Raises:
        TreadleError: what ``fn`` raised, or the driver error as `StoreError` (or
            `LogCorrupted` for a damaged database) with the driver's as ``__cause__``.
    """
    return _pooled(dialect, pool, fn, args, again=False)


def read_pooled(dialect: SqlDialect, pool: ConnectionPool, fn: Callable[..., _T], *args: Any) -> _T:
    """`run_pooled` for a read (``fn`` changes nothing): once more if its connection was lost.

    A pooled connection the server ended while it was idle (a restart, a failover,
    ``pg_terminate_backend``) fails the first statement sent on it. When ``fn`` fails
    because its connection was lost (`SqlDialect.lost`), not for an error of its own
    statement, it is run once more on a new connection: running a read again does nothing
    twice (docs/fleet.md, "What each crash does"). The pool's idle connections are closed
    with the lost one (`ConnectionPool.lose`).

    Raises:
        TreadleError: as `run_pooled`; the second try's error when it failed too.
    """
    return _pooled(dialect, pool, fn, args, again=True)


def _pooled(
    dialect: SqlDialect,
    pool: ConnectionPool,
    fn: Callable[..., _T],
    args: tuple[Any, ...],
    *,
    again: bool,
) -> _T:
    """`run_pooled` (``again=False``) or `read_pooled` (``again=True``).

    A call its caller gave up on while it ran (`call_given_up`) is not run again, and its
    connection is closed, never pooled: a server that did not answer it in time may answer
    nothing on it (docs/decisions/0145-a-cancelled-store-call-returns-at-once.md).
    """
    conn = None
    broken = False
    try:
        conn = pool.take()
        try:
            return fn(dialect, conn, *args)
        except Exception as exc:
            if not dialect.lost(exc, conn):
                raise
            pool.lose(conn)
            conn = None
            if not again or call_given_up():
                raise
            _LOG.info(
                "%s: a pooled connection was lost (%s); reading again", dialect.description, exc
            )
        conn = pool.take_new()
        return fn(dialect, conn, *args)
    except TreadleError:
        raise
    except Exception as exc:
        error = dialect.error(exc, "cannot read or update")
        if error is None:
            raise
        broken = True
        raise error from exc
    finally:
        if conn is not None:
            pool.give(conn, broken=broken or call_given_up())
