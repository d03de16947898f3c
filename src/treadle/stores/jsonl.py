"""A run store of plain files: one JSON-lines file per run in a directory, with group commit.

Layout (format ``treadle.jsonl`` version 1; docs/decisions/0004-jsonl-format.md)::

    <directory>/run-42.jsonl              one file per run, named by its percent-encoded id
    <directory>/%52un%2F1.jsonl           (only a-z 0-9 . _ - are kept; "Run/1" here)
    <directory>/~<sha256 of the id>.jsonl an id whose encoding is empty, starts with "." or
                                          is longer than 200 characters

Each line of a run file is one frame, the result of ONE store operation::

    {"seq":0,"crc":"1c291ca3","header":{"format":"treadle.jsonl","version":1,"run_id":"r",...}}
    {"seq":1,"crc":"8d0b5e1a","records":[{...,"kind":"run_started"}]}
    {"seq":5,"crc":"00c0ffee","records":[{...,"kind":"action_result"},{...,"kind":"step"}]}

``seq`` is the seq of the frame's first record (0 for the header, which comes first and only
once); ``records`` holds the records of the operation in seq order, so an action result and
its step record are one line and reach the disk together or not at all. ``crc`` is the
CRC-32 (zlib) of the line's bytes, newline excluded, with its own 8 hex digits taken as
``00000000``.

Reading (`treadle.stores._lines.scan_lines`): each line is decoded on its own as strict
UTF-8. A last line without a trailing newline, or a last line whose checksum does not match,
is a torn tail left by a crash mid-append: it was never acknowledged; it is reported
(`JsonlStore.torn_tails`, `JsonlStatistics.torn_tails` and a warning on the
``treadle.stores.jsonl`` logger) and cut off, durably, before the run's next append. A damaged
line with more lines after it is corruption: `LogCorrupted` with the byte offset of that line.

Threads and processes: one committer thread per store object appends every run's lines and
syncs the files of each batch's barriers concurrently (`treadle.stores._jsonl_commit`); reads
run in trio worker threads. Several store objects, in one process or several, may share a
directory: each append holds the run file's ``flock`` and checks that nobody appended since
the run was read, so a second writer of the same run gets `ConflictError` instead of
interleaving lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from os import PathLike
from pathlib import Path
from typing import Final

import attrs
import trio

from treadle._exceptions import ConflictError, LogCorrupted, StoreError, UsageError
from treadle.stores._jsonl_commit import Committer, Counts, FileOps, OsFileOps, Write, refusal
from treadle.stores._jsonl_files import FORMAT as FORMAT
from treadle.stores._jsonl_files import FORMAT_VERSION as FORMAT_VERSION
from treadle.stores._jsonl_files import MAX_NAME_CHARS as MAX_NAME_CHARS
from treadle.stores._jsonl_files import Listing, open_directory, probe_directory
from treadle.stores._jsonl_files import RunFile as RunFile
from treadle.stores._jsonl_files import encode_run_id as encode_run_id
from treadle.stores._jsonl_files import header_frame as header_frame
from treadle.stores._jsonl_files import read_run_file as read_run_file
from treadle.stores._jsonl_files import records_frame as records_frame
from treadle.stores._jsonl_files import run_file_name as run_file_name
from treadle.stores._lines import TornSpan
from treadle.stores._ops import AppendStore
from treadle.types import (
    Record,
    RunLog,
)

MAX_PENDING_WRITES: Final = 10_000
"""Queued, unwritten writes above which a non-barrier write waits for its batch."""

CLOSE_GRACE_S: Final = 30.0
"""Seconds `JsonlStore.aclose` waits (shielded) for the committer to sync and stop."""

_LOG = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class TornTail:
    """A torn last line found in a run file (a crash interrupted an append).

    Attributes:
        run_id: the run.
        path: the run file.
        offset: byte offset where the torn line starts; the file is cut to this size before
            the run's next append.
        length: bytes of the torn line (to the end of the file when it was read).
        reason: ``no trailing newline`` or the frame error (``checksum mismatch`` ...).
        head: up to the first 256 bytes of the torn line.
    """

    run_id: str
    path: str
    offset: int
    length: int
    reason: str
    head: bytes = b""


@attrs.frozen(kw_only=True)
class JsonlStatistics:
    """Counters of one `JsonlStore` since it was opened.

    Attributes:
        batches: batches the committer wrote.
        syncs: ``fdatasync``/``fsync`` calls (run files and the directory).
        sync_rounds: batches that synced at least one run file.
        writes_committed: store operations written (a step write counts once).
        records_written: log records written.
        max_batch: the most operations written in one batch.
        pending: operations queued and not yet written (or failed).
        torn_tails: torn tails found by reads since opening (see `JsonlStore.torn_tails`).
        tails_cut: torn tails cut off before an append.
    """

    batches: int = 0
    syncs: int = 0
    sync_rounds: int = 0
    writes_committed: int = 0
    records_written: int = 0
    max_batch: int = 0
    pending: int = 0
    torn_tails: int = 0
    tails_cut: int = 0


@attrs.define(eq=False)
class _Counters:
    """The mutable counters behind `JsonlStatistics` (updated in the trio thread only)."""

    batches: int = 0
    syncs: int = 0
    sync_rounds: int = 0
    writes_committed: int = 0
    records_written: int = 0
    max_batch: int = 0
    pending: int = 0
    torn_tails: int = 0
    tails_cut: int = 0


@attrs.define(eq=False)
class _RunState:
    """What the trio side knows about one run's file.

    Attributes:
        path: the run file.
        exists: the file existed when read (else the first write creates it).
        next_seq: the seq of the next write.
        end: bytes of the file known to hold whole lines (read, or written here).
        tail: where the next write lands: ``end`` plus the writes still queued.
        records: records in the file.
        header: the header line is in the file or queued.
        inflight: writes queued and not yet written (or failed).
    """

    path: str
    exists: bool
    next_seq: int = 1
    end: int = 0
    tail: int = 0
    records: int = 0
    header: bool = False
    inflight: int = 0
    last: Write | None = None
    error: StoreError | None = None
    reported: bool = False


# --------------------------------------------------------------------------- the store


class JsonlStore(AppendStore):
    """A `treadle.ports.RunStore` of JSON-lines files, one per run, in one directory.

    Open it with `JsonlStore.open` or `open_jsonl_store`, inside a trio run; the store belongs
    to that trio run. Any number of runs may share one store object: their writes are
    appended and synced together by its committer thread (group commit). Other store objects,
    in this process or others, may use the same directory at the same time; one run has one
    writer, and a second writer of a run gets `ConflictError`.

    Barriers (`write_intent`, `write_control`, `write_run_finished`) return once their line
    and every earlier line of the run are synced. The other writes return once queued; if
    their append later fails, the error is raised by the next write of that run. After a
    write of a run fails, the store refuses every further write of that run with
    `StoreError`; open the store again to resume it.

    Every write raises:
        ConflictError: ``seq`` is not the run's next seq (checked before queuing), or
            another writer appended to the run's file since this store read it (caught at
            append time; the run is then refused here). Nothing of the write is stored.
        UsageError: a record cannot be encoded as JSON or UTF-8, or names another run.
            Nothing is written and the seq stays free.
        LogCorrupted: the run's existing file is damaged before its end (its first write in
            this store reads it).
        StoreError: the append or sync of this barrier failed (disk full, I/O error; the
            `OSError` is the ``__cause__``), an earlier write of the run failed, or the
            store is closed.

    Cancellation:
        Every operation is a checkpoint. A write cancelled before it was queued writes
        nothing. A barrier cancelled while awaiting its sync stays queued and WILL be
        written (the run's next seq has advanced).
    """

    def __init__(self, directory: str, ops: FileOps, token: trio.lowlevel.TrioToken) -> None:
        """Private: use `JsonlStore.open`."""
        self._directory = directory
        self._runs: dict[str, _RunState] = {}
        self._listed: dict[str, Listing] = {}
        self._torn: list[TornTail] = []
        self._last: Write | None = None
        self._created_ns = 0
        self._closed = False
        self._stopped = trio.Event()
        self._counters = _Counters()
        self._committer = Committer(directory, ops, token, self._deliver, self._stopped.set)
        self._committer.start()

    @classmethod
    async def open(
        cls, directory: str | PathLike[str], *, file_ops: FileOps | None = None
    ) -> JsonlStore:
        """Open (creating if needed) the store in ``directory`` and start its committer.

        Args:
            directory: the store directory; created when missing (its parent must exist).
            file_ops: the file operations of the committer; ``None`` for the real ones. Tests
                pass a `treadle.testing.faults.FailingFileOps` to simulate a full disk.

        Returns:
            The open store; the caller owns it and must `aclose` it.

        Raises:
            StoreError: the directory cannot be created, or the path is not a directory.
        """
        text = str(Path(directory))
        token = trio.lowlevel.current_trio_token()
        await trio.to_thread.run_sync(open_directory, text)
        return cls(text, file_ops or OsFileOps(), token)

    @property
    def directory(self) -> str:
        """The store directory."""
        return self._directory

    def statistics(self) -> JsonlStatistics:
        """Counters since the store was opened."""
        return JsonlStatistics(**attrs.asdict(self._counters))

    def torn_tails(self) -> tuple[TornTail, ...]:
        """Torn tails found by reads since the store was opened, in the order found.

        A read reports a torn tail each time it finds one, except while this store is
        appending to that run. A process reading a run that another process is appending to
        at that moment cannot tell a half-written line from a torn one: the writer's own
        check, under the file's lock, decides what is cut.
        """
        return tuple(self._torn)

    def run_file(self, run_id: str) -> str:
        """The file that holds (or will hold) the run's log."""
        return os.path.join(self._directory, run_file_name(run_id))

    async def read_log(self, run_id: str) -> RunLog:
        """Read the run's whole log, after the writes queued for it here are written.

        The log includes what other store objects (or processes) appended. A torn tail is
        left out and reported (`torn_tails`); reading never cuts it.

        Returns:
            The log, records in seq order; an empty log for a run that does not exist.

        Raises:
            LogCorrupted: a line before the last is damaged, a seq is missing or a record
                does not decode (``offset``: the byte offset of that line).
            SchemaTooNew: the file or its run-started record is from a newer version.
            StoreError: the file cannot be read, or the store is closed.
        """
        self._check_open()
        state = self._runs.get(run_id)
        if state is not None and state.last is not None:
            await self._wait_done(state.last)
        path = self.run_file(run_id)
        found = await trio.to_thread.run_sync(read_run_file, path)
        self._check_open()
        self._check_run_id(path, run_id, found)
        state = self._runs.get(run_id)
        if state is None or (state.inflight == 0 and state.error is None):
            self._runs[run_id] = _state_of(path, found)  # the next write continues from here
            self._note_torn(run_id, path, found.torn)
        elif found.torn is not None and found.torn.offset < state.end:
            self._note_torn(run_id, path, found.torn)  # not our append in flight
        return RunLog(run_id=run_id, records=found.records)

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one written record, in first-write order.

        First-write order is the order of the ``created_ns`` instants in the files' headers
        (the wall clock of the writer that created each file), then of run ids.

        Raises:
            StoreError: the directory cannot be read, or the store is closed.
        """
        self._check_open()
        if self._last is not None:
            await self._wait_done(self._last)
        known = set(self._listed)
        try:
            found = await trio.to_thread.run_sync(probe_directory, self._directory, known)
        except OSError as exc:
            raise StoreError(f"cannot list {self._directory}: {exc.strerror or exc}") from exc
        for name, listing in found.items():
            if listing is not None:
                self._listed[name] = listing
        listings = sorted(self._listed.values(), key=lambda x: (x.created_ns, x.run_id))
        return tuple(listing.run_id for listing in listings)

    async def aclose(self) -> None:
        """Write and sync everything queued, stop the committer and close every file.

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
            raise StoreError(f"{self._directory}: the committer did not stop in {CLOSE_GRACE_S} s")
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
        if barrier:  # waiting for the sync below is the schedule point
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            await trio.lowlevel.checkpoint()
        self._check_open()
        line = _encode_line(run_id, seq, records)
        state = self._runs.get(run_id)
        if state is None:
            state = await self._load_state(run_id)
        self._check_open()
        if state.error is not None:
            state.reported = True
            raise refusal(run_id, state.error)
        if seq != state.next_seq:
            raise ConflictError(run_id, expected=state.next_seq, got=seq)
        data = line if state.header else self._header(run_id) + line
        write = Write(
            run_id=run_id,
            path=state.path,
            seq=seq,
            start=state.tail,
            data=data,
            records=len(records),
            barrier=barrier,
            create=not state.exists,
            closes=closes,
        )
        wait = barrier or self._counters.pending >= MAX_PENDING_WRITES
        if wait:
            write.event = trio.Event()
        self._committer.inbox.put(write, flush=wait)  # StoreError if the committer is gone
        state.exists = state.header = True
        state.next_seq += len(records)
        state.tail += len(data)
        state.inflight += 1
        state.last = self._last = write
        self._counters.pending += 1
        if write.event is None:
            return
        await write.event.wait()
        if write.error is not None:
            state.reported = True
            raise write.error

    def _header(self, run_id: str) -> bytes:
        self._created_ns = max(self._created_ns + 1, time.time_ns())
        return header_frame(run_id, created_ns=self._created_ns)

    async def _load_state(self, run_id: str) -> _RunState:
        path = self.run_file(run_id)
        found = await trio.to_thread.run_sync(read_run_file, path)
        self._check_run_id(path, run_id, found)
        # another task may have loaded (and advanced) it meanwhile: keep that one
        state = self._runs.setdefault(run_id, _state_of(path, found))
        if state.inflight == 0:
            self._note_torn(run_id, path, found.torn)
        return state

    def _check_run_id(self, path: str, run_id: str, found: RunFile) -> None:
        if found.run_id is not None and found.run_id != run_id:
            raise LogCorrupted(f"the header names run {found.run_id!r}", where=path, offset=0)

    def _note_torn(self, run_id: str, path: str, torn: TornSpan | None) -> None:
        if torn is None:
            return
        tail = TornTail(
            run_id=run_id,
            path=path,
            offset=torn.offset,
            length=torn.length,
            reason=torn.reason,
            head=torn.head,
        )
        self._torn.append(tail)
        self._counters.torn_tails += 1
        _LOG.warning(
            "%s: torn tail of %d bytes at offset %d (%s); it was never acknowledged and is "
            "cut off before the next append of run %r",
            path,
            torn.length,
            torn.offset,
            torn.reason,
            run_id,
        )

    async def _wait_done(self, write: Write) -> None:
        if write.done:
            return
        if write.event is None:
            write.event = trio.Event()
            self._committer.inbox.flush()
        await write.event.wait()

    def _deliver(self, batch: list[Write], counts: Counts) -> None:
        """In the trio thread: record the outcome of one batch and wake its waiters."""
        ok = 0
        records = 0
        for write in batch:
            write.done = True
            state = self._runs[write.run_id]
            state.inflight -= 1
            if write.error is None:
                ok += 1
                records += write.records
                state.end = max(state.end, write.end)
                state.records += write.records
            elif state.error is None:
                state.error = write.error
            if write.event is not None:
                write.event.set()
        for run_id, error in counts.failures:
            failed = self._runs.get(run_id)
            if failed is not None and failed.error is None:
                failed.error = error
        self._count(len(batch), ok, records, counts)

    def _count(self, taken: int, ok: int, records: int, counts: Counts) -> None:
        counters = self._counters
        counters.pending -= taken
        counters.syncs += counts.syncs
        counters.tails_cut += counts.cuts
        counters.sync_rounds += 1 if counts.synced_files else 0
        if ok:
            counters.batches += 1
            counters.writes_committed += ok
            counters.records_written += records
            counters.max_batch = max(counters.max_batch, ok)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the JSONL store {self._directory} is closed")

    def _raise_unreported(self) -> None:
        unreported = sorted(r for r, s in self._runs.items() if s.error and not s.reported)
        if unreported:
            for run_id in unreported:
                self._runs[run_id].reported = True
            first = self._runs[unreported[0]].error
            raise StoreError(
                f"{self._directory}: writes of runs {unreported} failed after returning"
            ) from first


def _state_of(path: str, found: RunFile) -> _RunState:
    return _RunState(
        path=path,
        exists=found.exists,
        next_seq=found.next_seq,
        end=found.end,
        tail=found.end,
        records=len(found.records),
        header=found.run_id is not None,
    )


def _encode_line(run_id: str, seq: int, records: tuple[Record, ...]) -> bytes:
    for record in records:
        if record.run_id != run_id:
            raise UsageError(f"a write of run {run_id!r} holds a record of run {record.run_id!r}")
    try:
        return records_frame(seq, records)
    except Exception as exc:
        raise UsageError(f"run {run_id!r}: cannot encode {records!r}: {exc}") from exc


@contextlib.asynccontextmanager
async def open_jsonl_store(
    directory: str | PathLike[str], *, file_ops: FileOps | None = None
) -> AsyncIterator[JsonlStore]:
    """Open a `JsonlStore` for the duration of an ``async with`` block, then `aclose` it.

    Args:
        directory: the store directory (see `JsonlStore.open`).
        file_ops: the committer's file operations (fault injection in tests).

    Yields:
        The open store.

    Raises:
        StoreError: as `JsonlStore.open` and `JsonlStore.aclose`.
    """
    store = await JsonlStore.open(directory, file_ops=file_ops)
    try:
        yield store
    finally:
        await store.aclose()
