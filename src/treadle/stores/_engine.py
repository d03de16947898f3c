"""The commit engine that every durable store shares (docs/decisions/0011-one-commit-engine.md).

A store hands each write operation to the engine as a `Write`. The engine's committer thread
takes everything pending, asks the store's `Backend` to commit it as one batch (one SQL
transaction, or one append-and-sync round over files) and hands the batch back to trio with a
single ``run_sync_soon``: group commit across every run of the store object
(docs/crash-safety.md, "The stores").

* **A barrier met by an idle engine commits on the trio thread** (`CommitEngine.append`): when
  the committer waits, no other task is runnable, the last commit was quick and the batch
  carries at most `COMMIT_HERE_MAX_BYTES`, the barrier and everything queued before it commit
  right there, without waking the committer or the run loop's wake-up socket
  (docs/decisions/0093-commit-here-when-idle.md).
* **Barriers** wait for their batch. The other writes return once queued; they linger for up
  to `LINGER_S` so that they ride with the next barrier, and a failure of their batch is raised
  by the run's next write (or by `CommitEngine.aclose`).
* **Prefix durability**: a batch holds every run's writes in seq order and the backend makes a
  run's later write durable only with its earlier ones. After any write of a run fails, the
  engine refuses every later write of that run under the same lease in this store object, so
  nothing lands after a hole; the first write under a new lease starts afresh from what the
  store holds.
* **Reads never change what the engine knows.** Only writes and their commits move a run's
  next seq; a store's reads first wait for the run's queued writes (`CommitEngine.settle`) and
  then read on their own.
* **Errors** are never swallowed: a refused write carries its error (`ConflictError`,
  `LeaseLost`, `StoreError`), a failed batch fails every write in it, and a bug in the backend
  fails the batch and stops the committer, so no waiter is left hanging: every write it leaves
  gets a `StoreStopped` naming the exception, logged once with its traceback.

The backend supplies only what differs between stores: how records are encoded, how a run's
next seq is loaded, how a batch is committed and what happens at stop.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar, cast

import attrs
import outcome
import trio

from treadle._exceptions import (
    ConflictError,
    LeaseLost,
    StoreError,
    StoreStopped,
    TreadleError,
    UsageError,
)
from treadle._trio_only import require_trio
from treadle.stores._index import IndexDelta, index_delta
from treadle.types import Record

if TYPE_CHECKING:
    from treadle.metrics import MetricsRecorder

_R = TypeVar("_R")

_LOG = logging.getLogger("treadle.stores")

LINGER_S: Final = 0.02
"""Seconds a queued non-barrier write may wait for a barrier to share its batch."""

SPLIT_ABOVE: Final = 64
"""Pending writes above which the committer takes only the older half per batch, so that trio
works on one half while the other commits (instead of every run moving in lock step)."""

NAP_FOR_S: Final = 1.0
"""Seconds after a write last found the queue empty during which an idle committer keeps
napping in turns of `LINGER_S` (looking at its queue 50 times a second) before it sleeps
until woken."""

MAX_WORKERS: Final = 4
"""Worker threads that one store object's calls run in at once, `SHARED_WORKERS` of them kept
for its lease and control calls: the others run its loads of a run's head (every store) and
its reads (the SQL stores, each on a pooled connection, as many kept open); more wait their
turn. Without a bound, a hundred runs starting at once loaded their heads in some forty
threads, opening and closing some seventy connections; eight took 1.6 MB more than four for
100 concurrent SQLite runs, and no throughput (docs/performance.md, "Memory")."""

SHARED_WORKERS: Final = 1
"""Worker threads of the `MAX_WORKERS` kept for the store calls of the work a store's runs
share, one task each (docs/decisions/0095-one-task-for-a-stores-runs.md): renewing their
leases and reading their control heads and streams. They never queue behind the runs' own
reads: with 300 runs starting on a SQLite store, a renewal waiting its turn behind their
reads (and cancelled, and queued again, each time the run hosting it ended) let 203 leases go
unrenewed past their TTL while their runs were driven, and cancels landed 5 s late instead of
within the poll interval. A thread more on top of the four instead cost about 0.3 MB of
resident memory for 100 runs (docs/decisions/0096-lease-and-control-calls-apart.md)."""

MAX_LEFT_CALLS: Final = MAX_WORKERS
"""Worker threads of store calls given up on while they ran (their caller was cancelled, or
Ctrl-C) that may run on beside the store object's `MAX_WORKERS`: such a call gives its place
back at once, so that a call stuck on a server that answers nothing holds up no call after
it. Past these, a call given up on keeps its place until its thread ends (trio's own rule for
an abandoned thread), so that a store object never runs more than `MAX_WORKERS` +
`MAX_LEFT_CALLS` threads (and SQL connections) at once
(docs/decisions/0145-a-cancelled-store-call-returns-at-once.md)."""

MAX_PENDING_WRITES: Final = 10_000
"""Queued, uncommitted writes above which a non-barrier write waits for its batch."""

COMMIT_HERE_MAX_S: Final = 0.002
"""Seconds the last commit may have taken for a barrier to commit on the trio thread: it
blocks the run loop for as long (docs/decisions/0093-commit-here-when-idle.md)."""

COMMIT_HERE_MAX_BYTES: Final = 128 * 1024
"""Encoded bytes (`Backend.size`) a batch may carry for a barrier to commit it on the trio
thread. A commit's time grows with what it writes (SQLite on a RAM disk: about 0.3 ms for
64 KiB, 1 ms for 128 KiB, 2 ms for 256 KiB, 2 s for 100 MB); a larger batch goes to the
committer, so that one large tool result never holds the run loop for longer than a sync
(docs/decisions/0093-commit-here-when-idle.md)."""

CLOSE_GRACE_S: Final = 30.0
"""Seconds `CommitEngine.aclose` waits (shielded) for the committer to flush and stop."""

_monotonic = time.monotonic


@attrs.define(eq=False, slots=True)
class Write:
    """One store operation on its way to the backend: records of one run at consecutive seqs.

    Attributes:
        run_id: the run.
        seq: the seq of the first record.
        generation: the writer's lease generation (0 for a store without leases).
        records: the records, in seq order.
        payload: what `Backend.encode` made of them (rows, a line of bytes ...).
        barrier: the caller waits until the write is durable.
        closes: the write holds the run's run-finished record.
        delta: what the write changes in the run's index row, or ``None``.
        head: `Backend.load`'s state, carried by the first write of a run in this engine.
        size: the bytes of ``payload`` (`Backend.size`).
        error: set by the backend when the write was refused or its batch failed.
        done: the batch holding the write has been handed back.
        waiter: the task of a barrier (or of a write waiting for room) awaiting the batch;
            rescheduled once ``done``.
        event: set once ``done``, for readers settling on the write (`CommitEngine.settle`).
    """

    run_id: str
    seq: int
    generation: int
    records: tuple[Record, ...]
    payload: object
    barrier: bool
    closes: bool
    delta: IndexDelta | None
    head: object = None
    size: int = 0
    error: TreadleError | None = None
    done: bool = False
    waiter: trio.lowlevel.Task | None = None
    event: trio.Event | None = None

    def abort_wait(self, _: object) -> trio.lowlevel.Abort:
        """The waiter was cancelled: it stops waiting, the write stays queued and commits."""
        self.waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    @property
    def count(self) -> int:
        """Records in the write."""
        return len(self.records)

    @property
    def end_seq(self) -> int:
        """The seq after the write's last record."""
        return self.seq + len(self.records)


@attrs.frozen(kw_only=True)
class RunHead:
    """What `Backend.load` found of a run before its first write through this engine.

    Attributes:
        next_seq: the seq after the run's last stored record (1 for a new run).
        state: backend-specific state the committer needs at the first write (a file's end
            offset, say); handed over in `Write.head`.
    """

    next_seq: int
    state: object = None


@attrs.frozen(kw_only=True)
class BatchReport:
    """What one committed batch did, besides the errors set on its writes.

    Attributes:
        syncs: fsync calls, or durable commits, it took.
        lost: runs whose earlier, already acknowledged writes turned out not durable (a
            failed sync at eviction or at stop), each with its error.
        counters: backend-specific counts to add to `StoreStatistics.counters`.
    """

    syncs: int = 0
    lost: tuple[tuple[str, TreadleError], ...] = ()
    counters: Mapping[str, int] = MappingProxyType({})


NOTHING_COMMITTED: Final = BatchReport()
"""The report of a batch that made nothing durable (shared: a report is immutable)."""

ONE_SYNC: Final = BatchReport(syncs=1)
"""The report of a batch made durable by one commit (shared)."""


class Backend(Protocol):
    """What a durable store supplies to the engine.

    Attributes:
        description: the store, for messages (a path, a DSN without its password).
        commits_here: whether `commit_here` may commit at all (``False``: the engine never
            asks it, every batch goes to the committer).
    """

    description: str
    commits_here: bool

    def encode(self, run_id: str, seq: int, generation: int, records: tuple[Record, ...]) -> object:
        """Encode one write (in the trio thread, before it is queued); pure.

        Raises:
            Exception: the records cannot be encoded; the engine raises `UsageError` and
                nothing is queued.
        """
        ...

    def size(self, payload: object) -> int:
        """The bytes of ``payload``, a write `encode` made (in the trio thread); pure.

        What its commit writes, near enough (the records' encoded bodies, say): the engine
        commits a batch in the trio thread only while its writes' sizes add up to at most
        `COMMIT_HERE_MAX_BYTES`.
        """
        ...

    def admit(self, run_id: str, generation: int) -> None:
        """Refuse at once a write that cannot commit (in the trio thread; may do nothing).

        Raises:
            LeaseLost: this store object knows the generation is stale.
        """
        ...

    def load(self, run_id: str) -> RunHead:
        """Find the run's next seq before its first write here (in a worker thread).

        A read: for a ``remote`` engine, a write cancelled while its run loads returns at
        once and leaves the load to end on its own (`CommitEngine.in_thread`), which must
        leave nothing to clean up.

        Raises:
            StoreError: the store cannot be read (`LogCorrupted`, `SchemaTooNew` included).
        """
        ...

    def commit_here(self, batch: list[Write]) -> BatchReport | None:
        """Commit ``batch`` as `commit` does, in the trio thread, unless that would wait.

        Called only while the committer waits for work, so the two never overlap. Returns
        ``None``, with nothing of ``batch`` committed and no error set, when committing would
        wait for another process or a server (a lock, a network round trip): the engine
        hands the batch to the committer instead. A backend that never commits here returns
        ``None`` and says so in ``commits_here``.
        """
        ...

    def commit(self, batch: list[Write]) -> BatchReport:
        """Make ``batch`` durable as one unit (in the committer thread).

        Writes come oldest first; a run's writes are at consecutive seqs. A write that is
        refused or lost gets ``error`` set; the others are durable when this returns. Raising
        means a bug: the engine fails the batch and stops.
        """
        ...

    def finish(self) -> BatchReport:
        """Make everything written durable and release the backend (committer thread, once)."""
        ...


@attrs.frozen(kw_only=True)
class StoreStatistics:
    """Counters of one store's commit engine since it was opened.

    Attributes:
        commits: batches that committed at least one write.
        writes_committed: store operations committed (a step write counts once).
        records_written: log records committed.
        max_batch: the most operations committed in one batch.
        pending: operations queued and not yet committed (or failed).
        syncs: fsync calls or durable commits the backend made.
        counters: backend-specific counts (torn tails cut, say).
    """

    commits: int = 0
    writes_committed: int = 0
    records_written: int = 0
    max_batch: int = 0
    pending: int = 0
    syncs: int = 0
    counters: Mapping[str, int] = attrs.Factory(dict)


@attrs.define(eq=False)
class _Counters:
    commits: int = 0
    writes_committed: int = 0
    records_written: int = 0
    max_batch: int = 0
    pending: int = 0
    syncs: int = 0
    counters: dict[str, int] = attrs.Factory(dict)


@attrs.define(eq=False)
class _RunState:
    """What the trio side knows of one run under one lease: next seq, last write, first failure.

    ``generation`` is the lease generation of the writes it was made for: a write of a later
    generation (a new lease of the run) does not inherit it (`CommitEngine.append`).
    """

    next_seq: int
    generation: int = 0
    head: object = None
    last: Write | None = None
    error: TreadleError | None = None
    reported: bool = False


def refusal(run_id: str, cause: TreadleError) -> TreadleError:
    """The error for a write of a run whose earlier write failed with ``cause``."""
    if isinstance(cause, LeaseLost):
        err: TreadleError = LeaseLost(run_id, generation=cause.generation, current=cause.current)
    else:
        err = StoreError(
            f"run {run_id!r}: an earlier write of this run failed ({cause}); the store refuses "
            "further writes of this drive of it (resume the run once the cause is gone)"
        )
    err.__cause__ = cause
    return err


_WAITING: Final = "waiting"
_RUNNING: Final = "running"
_LEFT: Final = "left"
_ENDED: Final = "ended"

_CALL: ContextVar[StoreCall[Any] | None] = ContextVar("treadle_store_call", default=None)
"""The store call of this worker thread (set in the thread's own copy of its caller's
context, `StoreCall.run`)."""


def call_given_up() -> bool:
    """Whether the caller of the store call running in this thread gave up on it meanwhile.

    ``False`` outside a call of `CommitEngine.in_thread` (the committer thread, say). What the
    call holds is then not kept for a later call: a SQL store closes its connection instead
    of pooling it, since the server may not be answering on it, and runs no read again
    (docs/decisions/0145-a-cancelled-store-call-returns-at-once.md).
    """
    call = _CALL.get()
    return call is not None and call.given_up


class StoreCall(Generic[_R]):
    """One call of `CommitEngine.in_thread` that its caller may give up on while it runs.

    It is ``waiting`` for its place among the store object's calls (the engine's ``workers``
    or ``shared``), then ``running`` (from when it got one: trio starts its thread at once),
    then ``ended``; or, given up on while it ran (its caller was cancelled, or Ctrl-C came),
    ``left``: its thread runs on, and what it returns is dropped (trio's ``abandon_on_cancel``).
    It is its own thread limiter for trio (trio's ``CapacityLimiter`` protocol), so that a
    call left running gives its place back at once, as long as fewer than `MAX_LEFT_CALLS`
    calls of the store object are left running (it takes one of their room instead); past
    that it keeps its place until its thread ends.

    Args:
        fn: the blocking function, called as ``fn(*args)`` in the worker thread.
        args: its arguments.
        places: the limiter of the calls that run at once.
        left: the limiter of the calls left running (`MAX_LEFT_CALLS` tokens).
        what: the call, for the log (``control_heads``, say).
        description: the store, for the log.
    """

    def __init__(
        self,
        fn: Callable[..., _R],
        args: tuple[object, ...],
        *,
        places: trio.CapacityLimiter,
        left: trio.CapacityLimiter,
        what: str,
        description: str,
    ) -> None:
        self._fn = fn
        self._args = args
        self._places = places
        self._left = left
        self.what = what
        self._description = description
        self._lock = threading.Lock()
        self._state = _WAITING
        self._holds: trio.CapacityLimiter | None = None  # whose token it holds (trio thread)

    @property
    def given_up(self) -> bool:
        """Whether its caller gave up on the call while it ran (read in any thread)."""
        return self._state == _LEFT

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        """Wait for a place among the store object's calls; trio starts the thread right after."""
        await self._places.acquire_on_behalf_of(self)
        self._holds = self._places
        with self._lock:
            self._state = _RUNNING

    def release_on_behalf_of(self, borrower: object) -> None:
        """Give back the place (or the room among the calls left running) the call held.

        Called by trio in its own thread once the call's thread ended.
        """
        holds, self._holds = self._holds, None
        if holds is not None:
            holds.release_on_behalf_of(self)

    def run(self) -> _R:
        """Call ``fn(*args)`` in the worker thread, unless the call was given up before.

        Raises:
            Exception: what ``fn`` raised.
            StoreError: the call was given up on before its thread began it (nothing was
                done; nobody receives this).
        """
        with self._lock:
            began = self._state == _RUNNING
        if not began:
            raise StoreError(f"the {self._description}: {self.what} was given up before it began")
        _CALL.set(self)  # this thread's own copy of the caller's context: `call_given_up`
        found = outcome.capture(self._fn, *self._args)
        with self._lock:
            was, self._state = self._state, _ENDED
        if was == _LEFT:
            self._ended_late(found)
        return found.unwrap()

    def _ended_late(self, found: outcome.Outcome[_R]) -> None:
        """Log how a call given up on while it ran ended: nobody else learns of it."""
        if isinstance(found, outcome.Error):
            _LOG.warning(
                "the %s: %s, given up on by its caller while it ran, failed afterwards: %s",
                self._description,
                self.what,
                found.error,
            )
        else:
            _LOG.info(
                "the %s: %s, given up on by its caller while it ran, ended afterwards",
                self._description,
                self.what,
            )

    @trio.lowlevel.enable_ki_protection  # the tokens are never half handed over
    def give_up(self) -> None:
        """Its caller stops waiting for the call (in trio's thread): leave its thread running.

        A call still waiting for its place, or ended, is left as it is. A running one is
        ``left``: its place is given back now if the store object's calls left running have
        room for one more (`MAX_LEFT_CALLS`), else when its thread ends.
        """
        with self._lock:
            if self._state != _RUNNING:
                return
            self._state = _LEFT
        if self._holds is not self._places:  # trio gave the place back already
            return
        try:
            self._left.acquire_on_behalf_of_nowait(self)
        except trio.WouldBlock:
            return
        self._places.release_on_behalf_of(self)
        self._holds = self._left


class CommitEngine:
    """Group commit for one store object: the trio side, its inbox and its committer thread.

    Args:
        backend: what commits batches.
        token: the trio run the store belongs to (batches are handed back to it).
        remote: the store's calls wait on a server across a network (PostgreSQL), which
            may stop answering while its connections stay up: they are given up on when
            cancelled (`in_thread`), the load of a run's head before
            its first write here included. A store of files (SQLite, JSONL) is not remote:
            its calls end on their own, and a cancelled one is waited for.

    Attributes:
        workers: bounds the worker threads of the store object's reads (`MAX_WORKERS` less
            `SHARED_WORKERS`): the engine loads a run's head under it, and the SQL stores
            run their reads under it too.
        shared: bounds the threads of the SQL stores' lease renewals and control readings
            (`SHARED_WORKERS`), apart from ``workers``.
        left: bounds the threads of calls given up on while they ran that no longer hold a
            place in ``workers`` or ``shared`` (`MAX_LEFT_CALLS`; `StoreCall`).
        metrics: where each committed batch's size and each barrier's wait are reported
            (docs/metrics.md); ``None`` reports nothing.
        remote: as given.

    The engine belongs to one trio run, the one ``token`` names (the one that opened the
    store). Every method must be called from it: `append`, `settle`, `in_thread` and
    `aclose` refuse a call from another one (`check_trio_run`), whose tasks its committer
    can never wake (docs/asyncio.md, "Calling treadle from asyncio").
    """

    def __init__(
        self, backend: Backend, token: trio.lowlevel.TrioToken, *, remote: bool = False
    ) -> None:
        self.metrics: MetricsRecorder | None = None
        self.remote = remote
        self.workers = trio.CapacityLimiter(MAX_WORKERS - SHARED_WORKERS)
        self.shared = trio.CapacityLimiter(SHARED_WORKERS)
        self.left = trio.CapacityLimiter(MAX_LEFT_CALLS)
        self._backend = backend
        self._token = token
        self._runs: dict[str, _RunState] = {}
        self._last: Write | None = None
        self._closed = False
        self._stopped = trio.Event()
        self._counters = _Counters()
        self._inbox = _Inbox(backend.description)
        self._committer = _Committer(backend, self._inbox, token, self._deliver, self._stopped.set)
        self._committer.start()

    @property
    def closed(self) -> bool:
        """Whether `aclose` was called."""
        return self._closed

    def check_trio_run(self) -> None:
        """Raise `UsageError` unless called from the trio run the store belongs to.

        A batch is handed back to that run only (its token's ``run_sync_soon``): a write
        awaited from another trio run would wait for ever, and one in flight while that run
        is alive would wake a task it does not know (docs/asyncio.md, "Calling treadle from
        asyncio"). One comparison of trio tokens, on every write.

        Raises:
            UsageError: called from another trio run, or outside trio (asyncio, say).
        """
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            require_trio(f"the {self._backend.description}")
            raise
        if token is not self._token:
            raise UsageError(
                f"the {self._backend.description} belongs to the trio run that opened it, and "
                "it was used from another trio run: open the store in the trio run that uses "
                "it (async with treadle.open_sqlite_store(...), say; docs/asyncio.md)"
            )

    async def in_thread(
        self,
        fn: Callable[..., _R],
        *args: object,
        shared: bool = False,
        what: str | None = None,
    ) -> _R:
        """``fn(*args)`` in one of the store object's worker threads (`workers`, or `shared`).

        ``shared``: a call of the work the store's runs share (a lease renewal, a control
        reading), in threads of its own (`SHARED_WORKERS`), not behind the runs' reads
        (docs/decisions/0096-lease-and-control-calls-apart.md).

        On a ``remote`` engine a cancelled call (or Ctrl-C) returns at once, its thread left
        to end on its own (`StoreCall`, trio's ``abandon_on_cancel``): ``fn`` must leave
        nothing that its caller has to clean up, and a write it makes has an unknown outcome
        for the caller (docs/decisions/0145-a-cancelled-store-call-returns-at-once.md). On
        another the call waits for its thread, as trio does. ``what`` names the call in the
        log (``fn``'s name by default).

        Raises:
            UsageError: called from another trio run than the store's (`check_trio_run`).
            Exception: what ``fn`` raised.

        Cancellation:
            On a ``remote`` engine, `trio.Cancelled` at once (`KeyboardInterrupt` for
            Ctrl-C), whatever ``fn`` is waiting for; on another, only once ``fn`` returned.
        """
        self.check_trio_run()
        places = self.shared if shared else self.workers
        if not self.remote:
            return await trio.to_thread.run_sync(fn, *args, limiter=places)
        named = what or str(getattr(fn, "__name__", "a call"))
        store = self._backend.description
        call = StoreCall(fn, args, places=places, left=self.left, what=named, description=store)
        try:
            return await trio.to_thread.run_sync(
                call.run,
                abandon_on_cancel=True,
                limiter=cast(trio.CapacityLimiter, call),
                thread_name=f"{named} from {trio.lowlevel.current_task().name}",
            )
        except BaseException:
            call.give_up()  # cancelled while it ran: it goes on without us
            raise

    def check_open(self) -> None:
        """Raise `StoreError` once the engine is closed."""
        if self._closed:
            raise StoreError(f"the {self._backend.description} is closed")

    def check_writable(self) -> None:
        """Raise when no write can be committed any more.

        That is, once the engine is closed, or once its committer thread stopped (it could
        not reach the database again, or a bug ended it): a run taken now could never be
        written, so a fleet claims nothing more and ends (docs/fleet.md, "What each
        crash does").

        Raises:
            StoreError: the engine is closed.
            StoreStopped: the committer thread has stopped.
        """
        self.check_open()
        if self._inbox.refusing:  # the committer's last act closes it, whatever stopped it
            raise self._inbox.gone()

    def statistics(self) -> StoreStatistics:
        """Counters since the engine started."""
        c = self._counters
        return StoreStatistics(
            commits=c.commits,
            writes_committed=c.writes_committed,
            records_written=c.records_written,
            max_batch=c.max_batch,
            pending=c.pending,
            syncs=c.syncs,
            counters=dict(c.counters),
        )

    @trio.lowlevel.enable_ki_protection
    async def append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        generation: int,
        barrier: bool,
        closes: bool,
    ) -> None:
        """Queue one write; for a barrier, wait until it (and all before it) is durable.

        A barrier's wait is reported to `metrics` in seconds, from just before it is
        committed in this thread or queued until its batch is handed back, so a commit
        here counts in it (docs/metrics.md, "What is counted").

        Raises:
            ConflictError: ``seq`` is not the run's next seq here, or another writer stored it
                first (caught at commit). Nothing of the write is stored.
            LeaseLost: ``generation`` is not the run's current lease generation.
            UsageError: the records cannot be encoded, or belong to another run; or the
                call comes from another trio run than the store's (`check_trio_run`).
            StoreError: the batch of this barrier failed, an earlier write of the run under
                the same lease generation failed, or the store is closed.

        Cancellation:
            Cancelled before it was queued, nothing is written; a barrier cancelled while
            awaiting its batch stays queued and WILL commit (the run's next seq has moved
            on). Only a barrier (or a write that waits for room, or the first write of a
            run here or under a new lease, which loads the run) yields to the scheduler.

        Protected from Ctrl-C, as trio's channels are: `KeyboardInterrupt` never leaves the
        engine's bookkeeping half done or a waiting task noted that no longer waits.
        """
        self.check_trio_run()
        # Cancelled: nothing is queued. No turn of the scheduler otherwise: a barrier yields
        # where it waits for its batch, a non-barrier write returns at once.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            self.check_open()
        payload = self._encode(run_id, seq, generation, records)
        state = self._runs.get(run_id)
        if state is not None and state.generation < generation:
            state = await self._new_lease(run_id, generation)
        if state is None:
            state = await self._load(run_id, generation)
            self.check_open()
        if state.error is not None:
            state.reported = True
            raise refusal(run_id, state.error)
        if seq != state.next_seq:
            raise ConflictError(run_id, expected=state.next_seq, got=seq)
        self._backend.admit(run_id, generation)
        delta = index_delta(records)
        write = Write(run_id, seq, generation, records, payload, barrier, closes, delta, state.head)
        write.size = self._backend.size(payload)
        counters = self._counters
        wait = barrier or counters.pending >= MAX_PENDING_WRITES
        metrics = self.metrics if barrier else None
        queued = time.perf_counter() if metrics is not None else 0.0  # a commit here included
        if not (barrier and self._commit_here(write)):
            self._inbox.put(write, flush=wait)  # StoreError if the committer is gone
        state.head = None
        state.next_seq = seq + len(records)
        state.last = self._last = write
        counters.pending += 1
        if not wait:
            return
        if write.done:  # committed here: durable, so a cancellation now does not undo it
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            # The batch is handed back by `_deliver`, in this thread, never before this yields.
            write.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(write.abort_wait)
        if metrics is not None:
            metrics.barrier(time.perf_counter() - queued)
        if write.error is not None:
            state.reported = True
            raise write.error

    @trio.lowlevel.enable_ki_protection  # not torn by Ctrl-C halfway through a transaction
    def _commit_here(self, write: Write) -> bool:
        """Commit the barrier ``write`` in this thread, with everything queued before it.

        Only when the backend may commit here, the last commit took at most
        `COMMIT_HERE_MAX_S`, no other task is runnable (nothing ready to run waits for the
        run loop that the commit blocks), the committer is not committing and the batch
        carries at most `COMMIT_HERE_MAX_BYTES` (docs/decisions/0093-commit-here-when-idle.md,
        "Decision"). ``False``: nothing was done, queue ``write`` for the committer.
        ``True``: ``write`` is done (committed, or failed with its batch), or the batch is
        queued for the committer, at the head of the queue: it was too large, or the backend
        would have waited (another process's lock). A bug in the backend fails the batch and
        stops the engine, as in the committer.
        """
        if (
            not self._backend.commits_here
            or self._committer.last_commit_s > COMMIT_HERE_MAX_S
            or self._inbox.committing  # the common case with many runs: ask no more
            or trio.lowlevel.current_statistics().tasks_runnable  # counts every fd it waits on
        ):
            return False
        batch = self._inbox.claim()
        if batch is None:
            return False
        batch.append(write)
        if sum(w.size for w in batch) > COMMIT_HERE_MAX_BYTES:
            return self._hand_back(batch)
        try:
            report = self._committer.commit_here(batch)
        except BaseException as exc:
            error = _stop_error(self._backend.description, exc)
            _fail(batch, error)
            self._inbox.close(error)
            self._inbox.stop()
            report = NOTHING_COMMITTED
        else:
            if report is None:
                return self._hand_back(batch)
        self._deliver(batch, report)
        return True

    def _hand_back(self, batch: list[Write]) -> bool:
        """Have the committer commit ``batch``, claimed and not committed here; ``True``.

        It goes to the head of the queue; should the committer have stopped meanwhile, its
        writes fail with the error of a write that came after the stop.
        """
        if not self._inbox.hand_back(batch):
            _fail(batch, self._inbox.gone())
            self._deliver(batch, NOTHING_COMMITTED)
        return True

    def _encode(
        self, run_id: str, seq: int, generation: int, records: tuple[Record, ...]
    ) -> object:
        for record in records:
            if record.run_id != run_id:
                raise UsageError(
                    f"a write of run {run_id!r} holds a record of run {record.run_id!r}"
                )
        try:
            return self._backend.encode(run_id, seq, generation, records)
        except Exception as exc:
            # Named by kind and seq, never by repr: a record's repr may be megabytes long,
            # or fail itself (an integer past Python's 4,300 digits for str()).
            kinds = ", ".join(f"{type(r).__name__} (seq {seq + i})" for i, r in enumerate(records))
            raise UsageError(
                f"run {run_id!r}: cannot encode {kinds}: {type(exc).__name__}: {exc!s:.500}"
            ) from exc

    async def _new_lease(self, run_id: str, generation: int) -> _RunState | None:
        """Drop what the engine kept of ``run_id`` under leases older than ``generation``.

        A lease taken while a write of the older one was in flight here (a takeover after a
        pause, a run claimed again as its last drive was cut) left that state in place
        (`forget` keeps a run with writes in flight). Its next seq and its failure (the
        older lease's `LeaseLost`, say) are the older lease's: the first write of the new
        lease waits for those writes to be handed back, then loads the run afresh. Kept,
        the new lease's writes were refused with the older lease's error.

        Returns:
            The run's state now: ``None`` (to be loaded), or one made meanwhile for
            ``generation`` or a later one.
        """
        state = self._runs.get(run_id)
        while state is not None and state.generation < generation:
            if state.last is not None and not state.last.done:
                await self.settle(run_id)
            else:
                self.forget(run_id)
            state = self._runs.get(run_id)
        return state

    async def _load(self, run_id: str, generation: int) -> _RunState:
        head = await self.in_thread(self._backend.load, run_id)
        made = _RunState(next_seq=head.next_seq, generation=generation, head=head.state)
        # another task may have loaded (and advanced) the run meanwhile: keep that one
        return self._runs.setdefault(run_id, made)

    async def settle(self, run_id: str | None = None) -> None:
        """Wait until the writes queued here (of ``run_id``, or of every run) are handed back.

        A read made after this sees every write this store object acknowledged. It does not
        raise a failed write's error: the run's next write does.

        Raises:
            UsageError: called from another trio run than the store's (`check_trio_run`).
            StoreError: the store is closed.
        """
        self.check_trio_run()
        self.check_open()
        if run_id is None:
            last = self._last
        else:
            state = self._runs.get(run_id)
            last = state.last if state is not None else None
        if last is None or last.done:
            await trio.lowlevel.checkpoint()
            return
        if last.event is None:
            last.event = trio.Event()
            self._inbox.flush()
        await last.event.wait()

    def next_seq(self, run_id: str) -> int | None:
        """The seq the run's next write here must carry, or ``None`` before its first write."""
        state = self._runs.get(run_id)
        return state.next_seq if state is not None else None

    def forget(self, run_id: str) -> None:
        """Drop what the engine knows of a run with nothing in flight.

        Called when a lease was taken or released, and when a run-finished record is durable:
        a store object serving runs for days keeps nothing of a run nobody drives through it.
        The next write of the run loads its next seq from the store again, so a run whose
        write failed (a statement timeout, a lost connection) can be driven again through
        this store object once the cause is gone (docs/crash-safety.md, "The stores"). A
        failure the run's writer already raised goes with the rest, as does a `LeaseLost`
        refusal (it was the old lease's; the new one may write). So does a failure nobody
        was told of (its driver stopped waiting: its lease was lost meanwhile, or its drive
        was cut), logged as a warning: the lease moved on, and the run's next drive, here or
        elsewhere, goes on from what the store holds, as after a crash. Kept, it failed that
        next drive at once, and `aclose` after it.
        """
        state = self._runs.get(run_id)
        if state is None or not (state.last is None or state.last.done):
            return
        error = state.error
        if error is not None and not state.reported and not isinstance(error, LeaseLost):
            _LOG.warning(
                "run %r: a write of its last drive here failed after its driver stopped "
                "waiting for it (%s); the run's next drive goes on from what is stored",
                run_id,
                error,
            )
        del self._runs[run_id]

    def _deliver(self, batch: list[Write], report: BatchReport) -> None:
        """In the trio thread: record the outcome of one batch and wake its waiters."""
        ok = records = 0
        reschedule = trio.lowlevel.reschedule
        for write in batch:
            write.done = True
            if write.error is None:
                ok += 1
                records += len(write.records)
                if write.closes:  # the run is finished: keep nothing of it
                    self.forget(write.run_id)
            else:
                self._poison(write.run_id, write.error, write.generation)
            if write.waiter is not None:
                reschedule(write.waiter)
                write.waiter = None
            if write.event is not None:
                write.event.set()
        for run_id, error in report.lost:
            self._poison(run_id, error, None)
        c = self._counters
        c.pending -= len(batch)
        c.syncs += report.syncs
        if report.counters:
            for name, value in report.counters.items():
                c.counters[name] = c.counters.get(name, 0) + value
        if ok:
            c.commits += 1
            c.writes_committed += ok
            c.records_written += records
            if ok > c.max_batch:
                c.max_batch = ok
            if self.metrics is not None:
                self.metrics.commit(ok)

    def _poison(self, run_id: str, error: TreadleError, generation: int | None) -> None:
        """Refuse the run's later writes with ``error``, a write's failure.

        ``generation`` is the failed write's lease generation (``None``: the run's current
        lease here). A failure of an older lease's write leaves a newer lease's writes alone.
        """
        state = self._runs.get(run_id)
        if state is None:
            state = self._runs[run_id] = _RunState(next_seq=0, generation=generation or 0)
        if generation is not None and generation < state.generation:
            return
        if state.error is None:
            state.error = error

    async def aclose(self) -> None:
        """Commit everything queued, finish the backend and stop the committer. Idempotent.

        Raises:
            StoreError: a write failed after it returned and no later call of that run
                reported it (the first such error is the ``__cause__``), or the committer did
                not stop within `CLOSE_GRACE_S`. A write refused because the run's lease was
                taken over is not such a failure (its driver learns of it from the lease).
            UsageError: called from another trio run than the store's (`check_trio_run`),
                which could not learn that the committer stopped; nothing is done.

        Cancellation:
            The flush is shielded (bounded by `CLOSE_GRACE_S` wall-clock seconds).
        """
        self.check_trio_run()
        if not self._closed:
            self._closed = True
            self._inbox.stop()
        with trio.CancelScope(shield=True):
            # Wall-clock seconds, not trio's clock: under a virtual clock (a test's autojump
            # clock) 30 s of trio time can pass while the thread commits one slow batch.
            if not await trio.to_thread.run_sync(self._committer.join, CLOSE_GRACE_S):
                late = f"the committer did not stop in {CLOSE_GRACE_S} s"
                raise StoreError(f"{self._backend.description}: {late}")
            await self._stopped.wait()  # the thread's last act, delivered by trio
        self._raise_unreported()

    def _raise_unreported(self) -> None:
        # A write refused because the run's lease moved on lost nothing acknowledged: the
        # driver learns of it from its lease (renewal or next write), and the run goes on
        # under its new driver.
        unreported = sorted(
            r
            for r, s in self._runs.items()
            if s.error and not s.reported and not isinstance(s.error, LeaseLost)
        )
        if not unreported:
            return
        for run_id in unreported:
            self._runs[run_id].reported = True
        first = self._runs[unreported[0]].error
        raise StoreError(
            f"{self._backend.description}: writes of runs {unreported} failed after returning"
        ) from first


_AWAKE: Final = 0
_NAPPING: Final = 1  # waits until a deadline: only a flush (or stop) wakes it before
_ASLEEP: Final = 2  # waits without a deadline: any write wakes it


class _Inbox:
    """The writes handed to the committer thread, and how the committer waits for them.

    A queued write does not wake the committer for a batch of its own: it lingers for up to
    `LINGER_S` so that it rides with the next barrier. A flush request (a barrier, a reader
    waiting for a write) or stopping ends the linger early.

    Waking the committer is the costly part of a hand-off (a futex wake, a context switch and
    the GIL), so it is woken only when it must be: when it waits without a deadline, by any
    write; when it naps until a deadline, only by a flush. After each batch the committer naps
    for `LINGER_S` (`take`'s ``nap_until``): a run's non-barrier writes between two barriers
    (a model result, a step record) then wake nobody, and its next barrier wakes the committer
    once. While writes keep coming (one found the queue empty less than `NAP_FOR_S` ago) it naps
    again when a nap ends, even with nothing to commit: barriers committed in the trio thread
    leave it nothing, and the writes lingering between them must not wake it either. A write
    queued during a nap waits no longer than the nap, so never more than `LINGER_S`.

    The state is guarded by one lock; the committer sleeps on a queue of wake tokens, which the
    trio thread fills only when it moves the committer from a wait to `_AWAKE`, so a token
    never wakes it twice (a token left by a wait that timed out at the same moment makes one
    spurious turn of `take`'s loop, nothing more).
    """

    def __init__(self, description: str) -> None:
        self._description = description
        self._lock = threading.Lock()
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._items: list[Write] = []
        self._since = 0.0  # monotonic seconds when the oldest queued write was queued
        self._flush = False
        self._stop = False
        self._closed = False
        self._reason: StoreError | None = None  # why the committer stopped, when it failed
        self._sleep = _AWAKE
        self._committing = False  # the committer took a batch and has not committed it yet

    def put(self, write: Write, *, flush: bool) -> None:
        """Queue ``write``; ``flush`` has the committer take it now.

        Raises:
            StoreStopped: the committer thread has stopped.
        """
        with self._lock:
            if self._closed:
                raise self.gone()
            items = self._items
            if not items:
                self._since = _monotonic()
            items.append(write)
            sleep = self._sleep
            if flush:
                self._flush = True
            elif sleep == _NAPPING:
                return
            if sleep == _AWAKE:
                return
            self._sleep = _AWAKE
        self._tokens.put(None)

    @property
    def committing(self) -> bool:
        """Whether the committer has a batch in hand.

        Read without the lock: a hint, which `claim` checks again under it.
        """
        return self._committing

    def claim(self) -> list[Write] | None:
        """Take every queued write for a commit in the trio thread, if the committer waits.

        ``None``: the committer is committing a batch (or stopping). Only the trio thread
        queues writes, so until it calls `hand_back` or is done with the batch, the committer
        finds nothing to take and never touches the backend.
        """
        with self._lock:
            if self._committing or self._stop or self._closed:
                return None
            items, self._items = self._items, []
            return items

    def hand_back(self, batch: list[Write]) -> bool:
        """Queue a claimed batch that was not committed; the committer takes it now.

        ``False``: the committer thread has stopped, nothing was queued.
        """
        with self._lock:
            if self._closed:
                return False
            if not self._items:
                self._since = _monotonic()
            self._items[:0] = batch
            self._flush = True
            wake = self._sleep != _AWAKE
            self._sleep = _AWAKE
        if wake:
            self._tokens.put(None)
        return True

    def flush(self) -> None:
        """Wake the committer to take what is queued now."""
        with self._lock:
            self._flush = True
            wake = self._sleep != _AWAKE
            self._sleep = _AWAKE
        if wake:
            self._tokens.put(None)

    def stop(self) -> None:
        """Ask the committer to take what is queued, finish the backend and stop."""
        with self._lock:
            self._stop = True
            wake = self._sleep != _AWAKE
            self._sleep = _AWAKE
        if wake:
            self._tokens.put(None)

    @property
    def refusing(self) -> bool:
        """Whether writes are refused (`close` was called: the committer stopped or failed)."""
        return self._closed

    def close(self, reason: StoreError | None = None) -> list[Write]:
        """Refuse further writes; return those never taken.

        Args:
            reason: why the committer stopped (a commit failed), named by `gone`.
        """
        with self._lock:
            self._closed = True
            self._reason = self._reason or reason  # the first stop says why
            leftover, self._items = self._items, []
            return leftover

    def gone(self) -> StoreStopped:
        """The error of a write that came after the committer stopped.

        It names why the committer stopped when a commit failed (that error is its cause), so
        a write that comes a moment too late says what the writes before it said.
        """
        gone = f"the committer thread of the {self._description} has stopped"
        reason = self._reason
        if reason is None:
            again = "no write can be committed until the store is opened again"
            return StoreStopped(f"{gone}; {again}")
        error = StoreStopped(f"{gone}: {reason}")
        error.__cause__ = reason.__cause__ or reason
        return error

    def take(self, nap_until: float | None) -> tuple[list[Write], bool]:
        """Block until there is a batch; return ``(batch, stopping)``, oldest writes first.

        Args:
            nap_until: a monotonic deadline (seconds) until which the committer naps rather
                than sleeps: a write queued before it does not wake it (see the class).

        A batch is taken once a flush was asked for, the oldest write has lingered for
        `LINGER_S`, or the inbox stops. Above `SPLIT_ABOVE` queued writes only the older half
        is taken.
        """
        lock = self._lock
        with lock:
            while True:
                items = self._items
                if self._stop or (items and self._flush):
                    break
                now = _monotonic()
                due: float | None
                if items:
                    due = self._since + LINGER_S
                    if due <= now:
                        break
                else:
                    self._flush = False  # asked for writes that are already taken
                    if nap_until is None or now >= nap_until:
                        # writes came lately: nap (again), so the next one wakes nobody
                        nap_until = now + LINGER_S if now - self._since < NAP_FOR_S else None
                    due = nap_until
                self._sleep = _ASLEEP if due is None else _NAPPING
                lock.release()
                try:
                    self._tokens.get(timeout=None if due is None else due - now)
                except queue.Empty:
                    pass
                finally:
                    lock.acquire()
                self._sleep = _AWAKE
            cut = len(items) if len(items) <= SPLIT_ABOVE else (len(items) + 1) // 2
            if cut == len(items):
                batch, self._items = items, []
                self._flush = False
            else:
                batch, self._items = items[:cut], items[cut:]
            self._committing = bool(batch)
            return batch, self._stop and not self._items

    def committed(self) -> None:
        """The committer is done with the batch it took (the backend is free)."""
        with self._lock:
            self._committing = False


class _Committer:
    """The thread that takes batches from the inbox and has the backend commit them."""

    def __init__(
        self,
        backend: Backend,
        inbox: _Inbox,
        token: trio.lowlevel.TrioToken,
        deliver: Callable[[list[Write], BatchReport], None],
        stopped: Callable[[], None],
    ) -> None:
        self._backend = backend
        self._inbox = inbox
        self._token = token
        self._deliver = deliver
        self._stopped = stopped
        self._thread = threading.Thread(target=self._main, name="treadle-committer", daemon=True)
        self.last_commit_s = 0.0
        """Seconds the last commit took, in this thread or the trio thread (a float is
        assigned whole under the GIL)."""
        self._failed: dict[tuple[str, int], TreadleError] = {}
        """The first failure of each (run, lease generation) among the batches committed."""

    def commit(self, batch: list[Write]) -> BatchReport:
        """Have the backend commit ``batch`` (in the committer thread)."""
        return self._commit(batch, self._backend.commit)

    def commit_here(self, batch: list[Write]) -> BatchReport | None:
        """Have the backend commit ``batch`` in the trio thread (`Backend.commit_here`).

        ``None``: the backend would have waited (another process's lock); nothing was done.
        """
        return self._commit(batch, self._backend.commit_here)

    def _commit(self, batch: list[Write], commit: Callable[[list[Write]], _R]) -> _R | BatchReport:
        """``commit(batch)``, timed, less the writes of runs whose earlier write failed.

        A run's later writes may be queued before the trio side learns that an earlier one
        failed (a non-barrier write does not wait for its commit): they are refused here,
        with that failure as their cause, and never reach the backend, which would take the
        missing seqs for lost records. Commits never overlap (the trio thread commits only a
        batch it claimed from an idle committer), so this needs no lock.
        """
        failed = self._failed
        kept = batch
        if failed:
            kept = []
            for write in batch:
                cause = failed.get((write.run_id, write.generation))
                if cause is None:
                    kept.append(write)
                elif write.error is None:
                    write.error = refusal(write.run_id, cause)
        if not kept:
            return NOTHING_COMMITTED
        began = _monotonic()
        report = commit(kept)
        self.last_commit_s = _monotonic() - began
        for write in kept:
            if write.error is not None:
                failed.setdefault((write.run_id, write.generation), write.error)
        return report

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` wall-clock seconds for the thread to end; whether it did."""
        if self._thread.ident is None:  # never started
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _main(self) -> None:
        stopped: StoreError | None = None
        try:
            stopped = self._loop()
        finally:  # also after a bug in the loop: no waiter is left hanging
            leftover = self._inbox.close(stopped)
            if leftover:
                _fail(leftover, stopped or self._inbox.gone())
                self._call_soon(self._deliver, leftover, NOTHING_COMMITTED)
            self._call_soon(self._stopped)

    def _loop(self) -> StoreError | None:
        """Commit batches until the inbox stops; ``None`` then.

        An exception out of a commit fails its batch and stops the thread: the error it
        returns then (`_stop_error`) is the error of every write still queued, and is logged
        once. Only an exception that is no `Exception` (``SystemExit``) leaves the thread as
        it came.
        """
        stopping = False
        nap_until = None
        while not stopping:
            batch, stopping = self._inbox.take(nap_until)
            try:
                if batch:
                    report = self.commit(batch)
                    self._inbox.committed()
                else:
                    report = NOTHING_COMMITTED
                if stopping:
                    report = _merge(report, self._backend.finish())
            except BaseException as exc:  # fail this batch, then stop the thread
                error = _stop_error(self._backend.description, exc)
                _fail(batch, error)
                self._call_soon(self._deliver, batch, NOTHING_COMMITTED)
                if not stopping:
                    self._finish_quietly()
                if not isinstance(exc, Exception):
                    raise
                if isinstance(exc, StoreError):  # the backend gave up (its database is gone)
                    _LOG.error("the committer of the %s stops: %s", self._backend.description, exc)
                else:  # a bug: its traceback, once
                    _LOG.error("%s", error, exc_info=exc)
                return error
            if batch or stopping:
                self._run_sync_soon(batch, report)
            nap_until = _monotonic() + LINGER_S
        return None

    def _run_sync_soon(self, batch: list[Write], report: BatchReport) -> None:
        try:
            self._token.run_sync_soon(self._deliver, batch, report)
        except trio.RunFinishedError:  # the trio run is gone: nobody waits any more
            pass

    def _finish_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self._backend.finish()

    def _call_soon(self, fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)


def _merge(first: BatchReport, second: BatchReport) -> BatchReport:
    counters = dict(first.counters)
    for name, value in second.counters.items():
        counters[name] = counters.get(name, 0) + value
    return BatchReport(
        syncs=first.syncs + second.syncs,
        lost=first.lost + second.lost,
        counters=MappingProxyType(counters),
    )


def _stop_error(description: str, exc: BaseException) -> StoreError:
    """The error of the writes a committer stopped by ``exc`` leaves uncommitted.

    A `StoreError` (the backend gave up) as it is; anything else as `StoreStopped` naming it,
    its cause ``exc``.
    """
    if isinstance(exc, StoreError):
        return exc
    error = StoreStopped(
        f"the committer of the {description} stopped: a commit failed with "
        f"{type(exc).__name__}: {exc!s:.500}; no write can be committed until the store is "
        "opened again"
    )
    error.__cause__ = exc
    return error


def _fail(writes: Sequence[Write], exc: BaseException) -> None:
    err = (
        exc if isinstance(exc, StoreError) else StoreError(f"the store's committer failed: {exc!r}")
    )
    if err is not exc:
        err.__cause__ = exc
    for write in writes:
        if write.error is None:
            write.error = err


def fail_writes(writes: Sequence[Write], error: TreadleError) -> None:
    """Set ``error`` on every write of ``writes`` that has none yet (backends use it)."""
    for write in writes:
        if write.error is None:
            write.error = error
