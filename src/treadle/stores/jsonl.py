"""A run store of plain files: one JSON-lines file per run in a directory, with group commit.

Layout (format ``treadle.jsonl`` version 3; docs/decisions/0004-jsonl-format.md and
docs/decisions/0085-compact-log-records.md)::

    <directory>/run-42.jsonl              one file per run, named by its percent-encoded id
    <directory>/%52un%2F1.jsonl           (only a-z 0-9 . _ - are kept; "Run/1" here)
    <directory>/~<sha256 of the id>.jsonl an id whose encoding is longer than 200 characters
    <directory>/.control/<name>.jsonl     a run's control stream (cancels and decisions)
    <directory>/.leases/<name>.lock       flock(LOCK_EX) held by the run's lease holder
    <directory>/.leases/<name>.lease      the lease sidecar: owner, generation, heartbeat

Each line of a run file is one frame, the result of ONE store operation::

    {"seq":0,"crc":"1c291ca3","header":{"format":"treadle.jsonl","version":3,"run_id":"r",...}}
    {"seq":1,"crc":"8d0b5e1a","gen":1,"records":[["rs",1796160068255627,[["user","go"]],...]]}
    {"seq":5,"crc":"00c0ffee","gen":1,"records":[["ar",1,1,"c0","noop",...],["st",1,...]]}

``seq`` is the seq of the frame's first record (0 for the header); ``gen`` the lease generation
of its writer; ``crc`` the CRC-32 (zlib) of the line's bytes, newline excluded, with its own 8
hex digits taken as ``00000000``. Records are in the compact encoding of
`treadle.stores._codec` (a tag, then the fields; the run id is the header's); a file begun in
format 2 holds, and is appended, JSON objects naming their run and kind. An action result and
its step record are one line, so they reach the disk together or not at all.

Reading (`treadle.stores._lines.scan_lines`): what a lost write looks like (an unterminated
last line, or a tail of NUL bytes after a power cut) is a torn tail: never acknowledged, left
out, reported (`JsonlStore.torn_tails`) and cut before the run's next append. Any other damage,
a complete last line included, is `LogCorrupted` with its byte offset; `JsonlStore.repair`
(``treadle repair``) removes it knowingly and keeps what it removed.

Leases: the holder of a run's lease holds ``flock(LOCK_EX)`` on the run's lock file for as
long as it drives the run, and its sidecar records owner, generation and heartbeat. The OS
lock is the exclusion: it drops the moment the holder's process dies (so a takeover needs no
TTL to pass), and a paused holder keeps it for as long as the process lives. Writes are
checked against the lease this store object holds (an ``fcntl`` lock would drop when any
descriptor of the file closes; ``flock`` does not). A lock file deleted or replaced under its
holder is found at the holder's next renewal, which gives the lease up (docs/fleet.md, "Leases").

Threads and processes: the store's commit engine appends every run's lines and syncs the
files of each batch's barriers concurrently; reads run in trio worker threads and never change
what the writer knows. Several store objects, in one process or several, may share a
directory: the leases keep each run to one writer.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs
import trio

from treadle._exceptions import (
    InvalidRunId,
    LogCorrupted,
    RunLeased,
    StoreError,
    TreadleError,
    UsageError,
)
from treadle._ids import check_run_id
from treadle._paths import stat_or_none
from treadle._trio_only import require_trio
from treadle.stores import _leases
from treadle.stores._engine import CommitEngine, StoreStatistics
from treadle.stores._index import checked_last, index_delta
from treadle.stores._jsonl_backend import FileOps, JsonlBackend, OsFileOps
from treadle.stores._jsonl_files import (
    CONTROL_DIR,
    HASHED_NAME,
    LEASE_DIR,
    FileId,
    Probe,
    Repair,
    RunFile,
    control_frame,
    entered_ns,
    file_id,
    header_version,
    holds_a_store,
    list_run_files,
    migrate_v1_control,
    move_v1_control,
    names_file,
    open_directory,
    open_regular,
    probe_run_file,
    read_control_file,
    read_run_file,
    read_sidecar,
    repair_control_file,
    repair_run_file,
    run_file_name,
    same_file,
    scan_control,
    sync_dir,
    v1_control_name,
    v1_control_run,
    write_sidecar,
)
from treadle.stores._ops import EngineStore
from treadle.types import (
    ApprovalDecided,
    CancelRequested,
    ControlEntry,
    Lease,
    RunLog,
    RunState,
    RunSummary,
)

if sys.platform != "win32":
    import fcntl

_LOG = logging.getLogger(__name__)


LOCK_RETRIES: Final = 20
"""Tries (5 ms apart) to take a free lease's lock while a listing probes it."""

__all__ = [
    "FileOps",
    "JsonlStore",
    "OsFileOps",
    "Repair",
    "TornTail",
    "open_jsonl_store",
    "run_file_name",
]

_T = TypeVar("_T")


@attrs.frozen(kw_only=True)
class TornTail:
    """A torn tail found in a run file (a crash interrupted an append).

    Attributes:
        run_id: the run.
        path: the run file.
        offset: byte offset where the torn part starts; the file is cut to this size before
            the run's next append.
        length: bytes of the torn part (to the end of the file when it was read).
        reason: ``no trailing newline`` or ``a tail of NUL bytes``.
        head: up to the first 256 bytes of the torn part.
    """

    run_id: str
    path: str
    offset: int
    length: int
    reason: str
    head: bytes = b""


@attrs.define(eq=False)
class _Held:
    """A lease this store object holds: the lock file's descriptor and the lease.

    ``fd`` (holding the ``flock``) belongs to the entry while it is in the store's held
    leases: whoever takes it out (`JsonlStore.release_lease`, a lost lease's
    `JsonlStore._drop`, `JsonlStore.aclose`), in the trio thread, closes it, once. No worker
    thread uses it, since its number is another file's once closed: a renewal checks the
    lock file by ``lock_id``, the identity it had when the lock was taken (docs/fleet.md,
    "Leases": exclusion never depends on timing).
    """

    fd: int
    lock_id: FileId
    lease: Lease
    control_seen: int


class JsonlStore(EngineStore):
    """A run store of JSON-lines files, one per run, in one directory.

    It implements the run store seam and the capabilities `LeaseStore`, `ControlStream` and
    `RunIndex` (no fleet queue: use SQLite or PostgreSQL for a fleet). Open it with
    `JsonlStore.open` or `open_jsonl_store`, inside a trio run; the store belongs to that trio
    run, and every call from another one raises `UsageError` (docs/asyncio.md, "Calling
    treadle from asyncio"). Any number of runs may share one store object: their writes are
    appended and synced together by its commit engine (group commit).

    Barriers return once their line and every earlier line of the run are synced. The other
    writes return once queued; if their append later fails, the error is raised by the next
    write of that run. After a write of a run fails, the store refuses every further write of
    that drive of the run; resume the run (its lease taken again, the store reads it from its
    file again) once the cause is gone.

    Every write raises:
        ConflictError: ``seq`` is not the run's next seq, or whole lines are in the file
            beyond what this store knows of it. Nothing of the write is stored.
        LeaseLost: this store object does not hold the run's lease with ``generation``.
        UsageError: a record cannot be encoded as JSON or UTF-8, or names another run.
        LogCorrupted: the run's file is damaged (its first write here reads it).
        StoreError: the append or sync of this barrier failed (disk full, I/O error; the
            `OSError` is the ``__cause__``), an earlier write of the run failed, or the
            store is closed.

    Cancellation:
        Every operation is a checkpoint. A write cancelled before it was queued writes
        nothing. A barrier cancelled while awaiting its sync stays queued and WILL be
        written (the run's next seq has advanced).
    """

    def __init__(
        self,
        directory: str,
        ops: FileOps,
        token: trio.lowlevel.TrioToken,
        clock: Callable[[], float],
    ) -> None:
        """Private: use `JsonlStore.open`."""
        self._directory = directory
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._sidecar_lock = threading.Lock()  # one sidecar write at a time (worker threads)
        self._torn: list[TornTail] = []
        self._heads: dict[str, tuple[tuple[int, int], int]] = {}
        self._backend = JsonlBackend(directory, self.run_file, ops, self._held_lease)
        self._engine = CommitEngine(self._backend, token)

    @classmethod
    async def open(
        cls,
        directory: str | PathLike[str],
        *,
        file_ops: FileOps | None = None,
        clock: Callable[[], float] = time.time,
    ) -> JsonlStore:
        """Open (creating if needed) the store in ``directory`` and start its committer.

        A version-1 directory is brought forward: its control pseudo-runs
        (``<run_id>#control``) become control streams. One that is damaged stays where it is,
        listed as an unreadable run under that name, which `repair` takes; the store opens.

        Args:
            directory: the store directory; created when missing (its parent must exist).
            file_ops: the file operations of the committer; ``None`` for the real ones. Tests
                pass a `treadle.testing.faults.FailingFileOps` to simulate a full disk.
            clock: the clock lease instants are taken from (epoch seconds).

        Returns:
            The open store; the caller owns it and must `aclose` it.

        Raises:
            StoreError: the directory cannot be created, the path is not a directory, or a
                version-1 directory's control streams cannot be moved.
        """
        text = str(Path(directory))
        token = trio.lowlevel.current_trio_token()
        await trio.to_thread.run_sync(open_directory, text)
        try:
            await trio.to_thread.run_sync(migrate_v1_control, text)
        except OSError as exc:
            raise StoreError(f"cannot open JSONL store {text}: {exc.strerror or exc}") from exc
        return cls(text, file_ops or OsFileOps(), token, clock)

    @property
    def directory(self) -> str:
        """The store directory."""
        return self._directory

    def statistics(self) -> StoreStatistics:
        """Counters since the store was opened (``counters["tails_cut"]``: torn tails cut)."""
        return self._engine.statistics()

    def torn_tails(self) -> tuple[TornTail, ...]:
        """Torn tails found by reads since the store was opened, in the order found.

        A read reports a torn tail it finds in a run this store object does not hold the
        lease of (a run it writes may have its own append in flight; its next append cuts a
        real torn tail and counts it in ``statistics().counters["tails_cut"]``).
        """
        return tuple(self._torn)

    def run_file(self, run_id: str) -> str:
        """The file that holds (or will hold) the run's log.

        A listed id of the form ``~<sha256>`` (a file whose header cannot be read and whose
        name is a hash) names that file itself.
        """
        return os.path.join(self._directory, run_file_name(run_id))

    @staticmethod
    def is_hashed_name(name: str) -> bool:
        """Whether ``name`` is a hashed file name (``~<sha256>``) rather than a run id.

        The store lists a run whose file header cannot be read under its file's name, and
        a long run id's file is named by its hash: `run_file` takes that name back.
        """
        return HASHED_NAME.fullmatch(name) is not None

    @staticmethod
    def is_store(directory: str | os.PathLike[str]) -> bool:
        """Whether ``directory`` holds a JSONL store (blocking; reads at most a few lines).

        A store once opened has its ``.leases`` and ``.control`` sub-directories; one written
        by an older treadle is known by a run file whose first line is a treadle header.
        Opening a store makes it one: a program that only reads (``treadle runs``) asks
        first, so as to leave any other folder as it is.
        """
        return holds_a_store(os.fspath(directory))

    @staticmethod
    def is_v1_control_name(name: str) -> bool:
        """Whether ``name`` is a version-1 control pseudo-run's, ``<run_id>#control``.

        The store lists such a file that it could not move into its run's control stream
        (a damaged one) under that name; `repair` takes it, under the run's lease.
        """
        run_id = v1_control_run(name)
        if run_id is None:
            return False
        try:
            check_run_id(run_id)
        except InvalidRunId:
            return False
        return True

    def _check_named(self, run_id: str) -> None:
        """Refuse what names no run here: not a run id, nor a hashed file name.

        A run whose file header cannot be read is listed by its file's name (``~<sha256>``,
        `is_hashed_name`), so that reading it (or taking its lease to repair it) reports
        the damage.

        Raises:
            InvalidRunId: neither (docs/concepts.md, "Run ids").
        """
        if not self.is_hashed_name(run_id):
            check_run_id(run_id)

    async def _in_worker(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in one of the store object's worker threads for the runs' own calls.

        At most `treadle.stores._engine.MAX_WORKERS` less `SHARED_WORKERS` at once, as the
        SQL stores' (docs/performance.md, "Memory").
        """
        return await self._engine.in_thread(fn, *args)

    async def _in_shared_worker(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in the thread kept for the work a store's runs share.

        Lease renewals, lease and control readings: never behind the runs' reads
        (docs/decisions/0096-lease-and-control-calls-apart.md).
        """
        return await self._engine.in_thread(fn, *args, shared=True)

    # ------------------------------------------------------------------ the run store seam

    async def read_log(self, run_id: str) -> RunLog:
        """Read the run's whole log, after the writes queued for it here are written.

        The log includes what other store objects (or processes) appended. A torn tail is
        left out; reading never cuts it and never changes what this store's writer knows.

        Returns:
            The log, records in seq order; an empty log for a run that does not exist.

        Raises:
            LogCorrupted: a line is damaged (a complete last line included), a seq is
                missing or a record does not decode (``offset``: the byte offset of the line).
            SchemaTooNew: the file or its run-started record is from a newer version.
            StoreError: the file cannot be read, or the store is closed; or ``run_id`` names
                a version-1 control pseudo-run `list_runs` gave (`is_v1_control_name`) that
                reads, and waits for its run (`_unmoved`).
            InvalidRunId: not an allowed run id (nor a hashed file name or a version-1
                control pseudo-run's name `list_runs` gave); nothing is read.
        """
        if self.is_v1_control_name(run_id):
            await self._in_worker(self._refuse_unmoved, run_id)
        self._check_named(run_id)
        await self._engine.settle(run_id)
        path = self.run_file(run_id)
        found = await self._in_worker(read_run_file, path)
        self._check_run_id(path, run_id, found)
        if run_id not in self._held:
            self._note_torn(run_id, path, found)
        else:
            self._backend.remember(path, found)  # its first write here need not read it again
        return RunLog(run_id=run_id, records=found.records)

    def _last_generation(self, run_id: str) -> int:
        """The highest lease generation in the run's log (0: none), read in a worker thread.

        A lease file lost or damaged (a restored backup, a disk error) must not start the
        generations over: a new holder's generation stays above every one that wrote.

        A damaged log counts as none (reading the run reports the damage).
        """
        try:
            found = read_run_file(self.run_file(run_id))
        except TreadleError:  # a damaged log: reading the run reports it, not taking its lease
            return 0
        return max(found.generations, default=0)

    async def read_generations(self, run_id: str) -> tuple[int, ...]:
        """The lease generation of each record's writer, in seq order (0 for version-1 lines)."""
        await self._engine.settle(run_id)
        found = await self._in_worker(read_run_file, self.run_file(run_id))
        return found.generations

    async def list_runs(self) -> tuple[str, ...]:
        """Every run with at least one written record, in the order the runs were created.

        A run whose file is damaged is listed too (by the id its file name encodes), so
        that reading it reports the damage; it never hides the others. So is a version-1
        control pseudo-run left where it was (`is_v1_control_name`): reading it says why.

        Raises:
            StoreError: the directory cannot be read, or the store is closed.
        """
        probes = await self._probes()
        return tuple(p.run_id for p in probes)

    async def list_summaries(self, *, last: int | None = None) -> tuple[RunSummary, ...]:
        """Every run with a record, with state and liveness from its file's ends and lease.

        Reads each file's header, first record and end (its last 64 KiB, or as much as its
        last record line takes), never whole logs. With ``last``, only the last ``last``
        runs (`treadle.ports.RunIndex.list_summaries`): every file's first line is read to
        order them, and only the newest files are probed so.

        Raises:
            UsageError: ``last`` is below 1.
            StoreError: the directory cannot be read, or the store is closed.
        """
        last = checked_last(last)
        probes = await self._probes(last)
        return tuple(await self._in_worker(self._summaries, probes))

    async def read_summary(self, run_id: str) -> RunSummary | None:
        """One run's summary, or ``None`` for a run without records."""
        await self._engine.settle(run_id)
        probe = await self._in_worker(probe_run_file, self.run_file(run_id))
        if probe is None:
            return None
        (summary,) = await self._in_worker(self._summaries, [probe])
        return summary

    async def _probes(self, last: int | None = None) -> list[Probe]:
        """The probes of the runs with a record, in the order they entered the store.

        ``last``: of the last ``last`` of them only (``None``: of every run).
        """
        self._engine.check_open()
        await self._engine.settle()
        probing = self._probe_all if last is None else functools.partial(self._probe_last, last)
        try:
            probes = await self._in_worker(probing)
        except OSError as exc:
            raise StoreError(f"cannot list {self._directory}: {exc.strerror or exc}") from exc
        ordered = sorted(probes, key=lambda p: (p.created_ns, p.run_id))
        return ordered if last is None else ordered[-last:]

    def _probe_all(self) -> list[Probe]:
        found = []
        for name in list_run_files(self._directory):
            probe = probe_run_file(os.path.join(self._directory, name))
            if probe is not None:
                found.append(probe)
        return found

    def _probe_last(self, last: int) -> list[Probe]:
        """Probes enough for the last ``last`` runs: the files probed newest first.

        Files are ordered by `entered_ns` (their first line), which is what their probes'
        ``created_ns`` say; probing stops once ``last`` runs with a record were found and
        the next file entered before them (a file without a record is not a run).
        """
        paths = [os.path.join(self._directory, name) for name in list_run_files(self._directory)]
        newest_first = sorted(((entered_ns(path), path) for path in paths), reverse=True)
        found: list[Probe] = []
        found_ns: list[int] = []
        for ns, path in newest_first:
            if len(found) >= last and ns < found_ns[last - 1]:
                break
            probe = probe_run_file(path)
            if probe is not None:
                found.append(probe)
                found_ns.append(ns)
        return found

    def _summaries(self, probes: Sequence[Probe]) -> list[RunSummary]:
        now = self._clock()
        return [self._summary(probe, now) for probe in probes]

    def _summary(self, probe: Probe, now: float) -> RunSummary:
        """One run's summary from its probe and lease file, read in a worker thread.

        A lease file that cannot be read (a directory in its place, no permission), or a
        control stream that cannot (`_control_damage`), makes the summary an error naming it,
        the log's state kept, and never fails the listing: a damaged run never blocks the
        others (docs/crash-safety.md, "Torn tails and damage"). A version-1 control
        pseudo-run that reads, left where it was, is no run: its summary is the error
        `_unmoved` gives, with no state.
        """
        if probe.error is None and self.is_v1_control_name(probe.run_id):
            probe = attrs.evolve(probe, error=self._unmoved(probe.run_id))
        path = os.path.join(self._directory, probe.name)
        try:
            lease = self._lease_now(probe.run_id, now)
        except StoreError as exc:
            summary = self._summary_of_log(probe, path, None, now)
            return attrs.evolve(summary, error=summary.error or str(exc))  # the log's first
        summary = self._summary_of_log(probe, path, lease, now)
        if summary.error is not None:
            return summary
        return attrs.evolve(summary, error=self._control_damage(probe.run_id))

    def _control_damage(self, run_id: str) -> str | None:
        """Why the run's control stream cannot be read; ``None``: it can, or there is none.

        Every drive of the run reads the stream first, so a damaged one stops the run as a
        damaged log does. Read in a worker thread; an unchanged stream is not read again
        (`_control_heads`). A hashed file name has no stream it can check: its entries
        name the run by its id.
        """
        if self.is_hashed_name(run_id):
            return None
        try:
            self._control_heads((run_id,))
        except StoreError as exc:
            return str(exc)
        return None

    def _unmoved(self, name: str) -> StoreError:
        """Why the readable version-1 control pseudo-run ``name`` is still here (a worker thread).

        Opening the store moves it into its run's control stream unless that stream cannot be
        read (`move_v1_control`); `repair_control` of the run moves it once the stream reads
        (docs/crash-safety.md, "Versions"). The error names the file, and the stream's damage.
        """
        run = v1_control_run(name)
        assert run is not None, name  # `is_v1_control_name` said so
        path = self.run_file(name)
        damage = self._control_damage(run)
        if damage is None:
            return StoreError(
                f"{path}: a format-1 control pseudo-run that waits for run {run!r}: "
                f"`treadle repair {run}` or the store's next opening moves it into the "
                "run's control stream"
            )
        return StoreError(
            f"{path}: a format-1 control pseudo-run that waits for run {run!r}, whose control "
            f"stream cannot be read ({damage}): `treadle repair {run}` repairs that stream "
            "and moves it there"
        )

    def _refuse_unmoved(self, name: str) -> None:
        """Raise why the version-1 control pseudo-run ``name`` is still here (a worker thread).

        Nothing is raised when there is no such file (it was moved): the name is no run's.

        Raises:
            LogCorrupted, SchemaTooNew: its file is damaged, or of a newer format.
            StoreError: it reads (`_unmoved`), or cannot be read.
        """
        if read_run_file(self.run_file(name)).exists:
            raise self._unmoved(name)

    def _summary_of_log(
        self, probe: Probe, path: str, lease: Lease | None, now: float
    ) -> RunSummary:
        if probe.error is not None:
            return RunSummary(
                run_id=probe.run_id,
                state=None,
                liveness=_leases.liveness(state=None, lease=lease, quarantined=None, now=now),
                observed_at=now,
                lease=lease,
                error=str(probe.error),
                where=path,
            )
        records = (probe.first, *probe.tail) if probe.first is not None else probe.tail
        delta = index_delta(records)
        state = delta.state if delta is not None else None
        if state is None:
            state = RunState.RUNNING
        started = probe.first
        return RunSummary(
            run_id=probe.run_id,
            state=state,
            liveness=_leases.liveness(state=state, lease=lease, quarantined=None, now=now),
            observed_at=now,
            lease=lease,
            agent=getattr(started, "agent", None),
            agent_version=getattr(started, "agent_version", None),
            steps=(delta.steps or 0) if delta is not None else 0,
            stop_reason=delta.stop_reason if delta is not None else None,
            started_at=getattr(started, "ts", None),
            awaiting_until=(delta.awaiting_until or None) if delta is not None else None,
            where=path,
            records=probe.records,
        )

    def _check_run_id(self, path: str, run_id: str, found: RunFile) -> None:
        if found.run_id is not None and found.run_id != run_id:
            raise LogCorrupted(f"the header names run {found.run_id!r}", where=path, offset=0)

    def _note_torn(self, run_id: str, path: str, found: RunFile) -> None:
        torn = found.torn
        if torn is None:
            return
        self._torn.append(
            TornTail(
                run_id=run_id,
                path=path,
                offset=torn.offset,
                length=torn.length,
                reason=torn.reason,
                head=torn.head,
            )
        )
        _LOG.warning(
            "%s: torn tail of %d bytes at offset %d (%s); it was never acknowledged and is "
            "cut off before the next append of run %r",
            path,
            torn.length,
            torn.offset,
            torn.reason,
            run_id,
        )

    async def repair(self, run_id: str, *, owner: str, force: bool = False) -> Repair | None:
        """Cut the run's file at its first damaged line, keeping what is removed.

        Run it knowingly (``treadle repair``): records after the damage are removed too. The
        removed bytes and a note (offset, length, SHA-256, the damage) are kept in
        ``.repairs/``. The store takes the run's lease for the repair (nobody may write it
        meanwhile) and releases it after. The run's control stream is `repair_control`'s.

        A version-1 control pseudo-run left where it was (`is_v1_control_name`: a damaged
        one) is repaired by its name, under its run's lease, as a control stream is
        (`repair_control`), then moved into its run's control stream. While that stream
        cannot be read, the repair is refused and nothing is changed: `repair_control` of the
        run cuts the stream, then moves the pseudo-run.

        Args:
            run_id: the run (or a version-1 control pseudo-run's name).
            owner: the lease owner id of the repair.
            force: cut even what a repair refuses to cut: a call that may have
                run (a resume would run it again), the run-finished record (a resume would
                reopen the run), or a file without a treadle header; of a control
                pseudo-run, a cancel or decision that still reads.

        Returns:
            What was removed, or ``None`` when the file reads without damage.

        Raises:
            RunLeased: another driver holds the run's lease.
            RepairRefused: such a cut, ``force`` being false (nothing was changed;
                docs/crash-safety.md, "Torn tails and damage").
            StoreError: the file cannot be repaired, or the run's lease cannot be taken (a
                full disk: the `OSError` is the ``__cause__``; the run file is cut only
                once what it loses is kept); of a version-1 control pseudo-run, its run's
                control stream cannot be read (nothing was changed).
        """
        pseudo = self.is_v1_control_name(run_id)
        run = v1_control_run(run_id) if pseudo else None
        lease = await self.acquire_lease(run or run_id, owner=owner, ttl_s=_leases.LEASE_TTL_S)
        try:
            if run is not None:
                await self._in_worker(self._refuse_unmovable, run_id, run)
            repaired = await self._in_worker(
                functools.partial(repair_run_file, force=force),
                self._directory,
                run_file_name(run_id),
            )
            if pseudo:
                await self._in_worker(self._move_v1_control, run_id)
            return repaired
        finally:
            await self.release_lease(lease)

    def _refuse_unmovable(self, name: str, run: str) -> None:
        """Refuse to repair the pseudo-run ``name`` while run ``run``'s stream is damaged.

        A worker thread. The pseudo-run could not be moved after its cut: it would stay where
        it is, and the repair would not say why.

        Raises:
            StoreError: the stream cannot be read; the error names its damage (`_unmoved`).
        """
        if self._control_damage(run) is not None:
            raise self._unmoved(name)

    def _move_v1_control(self, name: str) -> None:
        """`move_v1_control` of the pseudo-run ``name`` (a worker thread).

        Nothing is moved when there is no such file, or it cannot be read (it stays where
        it is, and listing says why).

        Raises:
            StoreError: its run's control stream cannot be written.
        """
        try:
            move_v1_control(self._directory, run_file_name(name))
        except OSError as exc:
            raise StoreError(f"cannot move {name!r}: {exc.strerror or exc}") from exc

    async def repair_control(
        self, run_id: str, *, owner: str, force: bool = False
    ) -> Repair | None:
        """Cut the run's control stream at its first damaged line, keeping what is removed.

        Run it knowingly (``treadle repair`` runs it after `repair`): the entries after the
        damage are removed too; a cancel or decision cut so is never applied. What is removed
        and a note are kept in ``.repairs/.control/``. The store takes the run's lease for
        the repair, and the stream's lock (no entry is appended meanwhile). A version-1
        control pseudo-run of the run that waited for the stream (`is_v1_control_name`) is
        moved into it after, as opening the store moves one.

        Args:
            run_id: the run.
            owner: the lease owner id of the repair.
            force: cut even what a repair refuses to cut: a cancel or decision that still
                reads (write again those that still stand after the cut).

        Returns:
            What was removed, or ``None`` when the stream reads without damage, the run has
            none, or ``run_id`` is a hashed file name (`is_hashed_name`: its stream's
            entries cannot be told to be its run's) or a version-1 control pseudo-run's
            (`is_v1_control_name`: a stream itself, which `repair` cuts).

        Raises:
            RunLeased: another driver holds the run's lease.
            RepairRefused: such a cut, ``force`` being false (nothing was changed;
                docs/crash-safety.md, "Torn tails and damage").
            StoreError: the stream cannot be repaired, or the run's lease cannot be taken.
            InvalidRunId: not an allowed run id, nor a hashed file name.
        """
        if self.is_hashed_name(run_id) or self.is_v1_control_name(run_id):
            await trio.lowlevel.checkpoint()
            return None
        lease = await self.acquire_lease(run_id, owner=owner, ttl_s=_leases.LEASE_TTL_S)
        try:
            repaired = await self._in_worker(self._repair_control, run_id, force)
            await self._in_worker(self._move_v1_control, v1_control_name(run_id))
            return repaired
        finally:
            await self.release_lease(lease)

    def _repair_control(self, run_id: str, force: bool) -> Repair | None:
        """`repair_control_file` of the run's stream under its ``flock`` (a worker thread).

        Raises:
            RepairRefused, StoreError: as `repair_control_file`.
        """
        path = self._control_path(run_id)
        try:
            fd = open_regular(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot repair {path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # no entry is appended while it is cut
            return repair_control_file(self._directory, run_file_name(run_id), run_id, force=force)
        except OSError as exc:  # a lock the file system refuses (ENOLCK), say
            raise StoreError(f"cannot repair {path}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)

    async def aclose(self) -> None:
        """Write and sync everything queued, stop the committer, drop the held leases' locks.

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
            for held in self._held.values():
                with contextlib.suppress(OSError):
                    os.close(held.fd)
            self._held.clear()

    # ------------------------------------------------------------------ leases

    def _lease_paths(self, run_id: str) -> tuple[str, str]:
        stem = run_file_name(run_id)[: -len(".jsonl")]
        base = os.path.join(self._directory, LEASE_DIR, stem)
        return base + ".lock", base + ".lease"

    def _held_lease(self, run_id: str) -> Lease | None:
        held = self._held.get(run_id)
        return held.lease if held is not None else None

    async def acquire_lease(self, run_id: str, *, owner: str, ttl_s: float) -> Lease:
        """Take the run's lease: its lock file's ``flock`` and a new generation in the sidecar.

        Raises:
            RunLeased: another driver (here or in another process) holds it.
            InvalidRunId: not an allowed run id.
            StoreError: the lock file cannot be opened or locked, or the sidecar cannot be
                written (a full disk: the `OSError` is the ``__cause__``); the lease is not
                taken.
        """
        self._check_named(run_id)
        _leases.check_ttl(ttl_s)
        self._engine.check_open()
        now = self._clock()
        held = self._held.get(run_id)
        if held is not None:
            renewed = _leases.acquire(held.lease, run_id=run_id, owner=owner, ttl_s=ttl_s, now=now)
            held.lease = renewed
            await self._in_worker(self._write_sidecar, held, False)
            return renewed
        held = await self._in_worker(self._lock, run_id, owner, ttl_s, now)
        self._held[run_id] = held
        self._engine.forget(run_id)
        return held.lease

    def _lock(self, run_id: str, owner: str, ttl_s: float, now: float) -> _Held:
        """Take the run's lock file's ``flock`` and write the next generation's sidecar.

        Raises:
            RunLeased, StoreError: as `acquire_lease` (the lock file is closed again).
        """
        lock_path, sidecar = self._lease_paths(run_id)
        fd = _open_locked(lock_path, run_id, sidecar, now)
        try:
            current, seen = read_sidecar(sidecar, run_id)
            last = current.generation if current is not None else 0
            if last == 0:  # no lease file, or a damaged one: the log says what was written
                last = self._last_generation(run_id)
            generation = last + 1
            lease = Lease(
                run_id=run_id,
                owner=owner,
                generation=generation,
                expires_at=now + ttl_s,
                heartbeat_at=now,
            )
            _sidecar_written(sidecar, lease, seen, durable=True)
            return _Held(fd=fd, lock_id=file_id(fd), lease=lease, control_seen=seen)
        except BaseException:
            os.close(fd)
            raise

    def _write_sidecar(self, held: _Held, durable: bool, *, released: bool = False) -> None:
        """Write ``held``'s sidecar (in a worker thread), one write at a time.

        A renewal that comes after the lease was released here writes nothing.

        Raises:
            StoreError: the sidecar cannot be written (nothing of the write is left behind).
        """
        run_id = held.lease.run_id
        _, sidecar = self._lease_paths(run_id)
        with self._sidecar_lock:
            if released or self._held.get(run_id) is held:
                _sidecar_written(sidecar, held.lease, held.control_seen, durable=durable)

    async def renew_leases(self, leases: Sequence[Lease], *, ttl_s: float) -> tuple[Lease, ...]:
        """Renew the held leases (their heartbeat in the sidecars); a missing one was lost.

        A lease whose lock file was deleted or replaced is lost (docs/fleet.md, "Leases").
        A lease whose sidecar cannot be written, or whose lock file cannot be looked at, is
        logged and kept, its lock still held, and tried again at the next renewal; the
        others are renewed all the same. Leases released here while the renewal runs are
        left alone: their lock files' descriptors are closed by their release only.
        """
        _leases.check_ttl(ttl_s)
        now = self._clock()
        renewed = []
        for lease in leases:
            held = self._held.get(lease.run_id)
            fresh = _leases.renew(held.lease if held else None, lease, ttl_s=ttl_s, now=now)
            if held is not None and fresh is not None:
                held.lease = fresh
                renewed.append(held)
        if not renewed:
            await trio.lowlevel.checkpoint()
            return ()
        gone, failed = await self._in_shared_worker(self._write_sidecars, renewed)
        for held in gone:  # its lock file was deleted or replaced: another may lock the run
            self._drop(held)
        if failed:
            _renewals_failed(failed)
        return tuple(h.lease for h in renewed if h not in gone)

    def _write_sidecars(
        self, helds: list[_Held]
    ) -> tuple[list[_Held], list[tuple[_Held, StoreError]]]:
        """Write the renewed sidecars (in a worker thread; no lock file descriptor is used).

        Returns:
            The leases whose lock file is no longer theirs, and the leases whose renewal
            failed with the error (the sidecar not written; the lock file not looked at).
        """
        gone, failed = [], []
        for held in helds:
            try:
                if names_file(self._lease_paths(held.lease.run_id)[0], held.lock_id):
                    self._write_sidecar(held, False)
                else:
                    gone.append(held)
            except StoreError as exc:
                failed.append((held, exc))
        return gone, failed

    def _drop(self, held: _Held) -> None:
        """Give up a lease whose lock file was taken away (its writes are refused from now).

        A lease released meanwhile is left alone: its release closed its descriptor, whose
        number may be another lock file's by now.
        """
        run_id = held.lease.run_id
        if self._held.get(run_id) is not held:
            return
        del self._held[run_id]
        self._engine.forget(run_id)
        _LOG.warning(
            "run %r: its lease's lock file was deleted or replaced; the lease is lost", run_id
        )
        with contextlib.suppress(OSError):
            os.close(held.fd)

    async def release_lease(self, lease: Lease, *, control_seen: int = 0) -> None:
        """Release the lease if held here: sidecar owner cleared, then the lock dropped."""
        held = self._held.get(lease.run_id)
        if held is None or held.lease.generation != lease.generation:
            await trio.lowlevel.checkpoint()
            return
        await self._engine.settle(lease.run_id)
        if self._held.get(lease.run_id) is not held:  # lost meanwhile, or the store closed
            return
        held.lease = attrs.evolve(held.lease, owner="")
        held.control_seen = max(held.control_seen, control_seen)
        del self._held[lease.run_id]
        try:
            await self._in_worker(
                functools.partial(self._write_sidecar, held, False, released=True)
            )
        finally:
            os.close(held.fd)
            self._engine.forget(lease.run_id)

    async def read_lease(self, run_id: str) -> Lease | None:
        """The run's lease: the one held here, else the sidecar's, expired if its lock is free."""
        held = self._held.get(run_id)
        if held is not None:
            await trio.lowlevel.checkpoint()
            return held.lease
        return await self._in_shared_worker(self._lease_now, run_id, self._clock())

    def _lease_now(self, run_id: str, now: float) -> Lease | None:
        held = self._held.get(run_id)
        if held is not None:
            return held.lease
        lock_path, sidecar = self._lease_paths(run_id)
        current, _ = read_sidecar(sidecar, run_id)
        if current is None or not current.owner:
            return current
        if _lock_is_free(lock_path):  # the holder's process is gone: its lease is over
            return attrs.evolve(current, expires_at=min(current.expires_at, now))
        return current

    # ------------------------------------------------------------------ control streams

    def _control_path(self, run_id: str) -> str:
        return os.path.join(self._directory, CONTROL_DIR, run_file_name(run_id))

    async def append_control(self, record: CancelRequested | ApprovalDecided) -> ControlEntry:
        """Append to the run's control stream (under the file's ``flock``); synced on return.

        The entry is written as the treadle of the run file's format reads it (a decision's
        tool is left out for a file of format 1 or 2: docs/crash-safety.md, "Versions").

        Raises:
            UsageError: the store holds no such run.
            InvalidRunId: not an allowed run id.
            SchemaTooNew: the run file is of a newer format; nothing is written.
            StoreError: the append or its sync failed.
        """
        run_id = check_run_id(record.run_id)
        self._engine.check_open()
        await self._engine.settle(run_id)
        return await self._in_worker(self._append_control, record)

    def _append_control(self, record: CancelRequested | ApprovalDecided) -> ControlEntry:
        run_id = record.run_id
        if not os.path.exists(self.run_file(run_id)):
            raise UsageError(f"there is no run {run_id!r} in {self._directory}")
        version = header_version(self.run_file(run_id))  # a newer format: nothing written
        path = self._control_path(run_id)
        created = not os.path.exists(path)
        try:
            fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            raise StoreError(f"cannot open {path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            entries, good = scan_control(os.pread(fd, size, 0), path, run_id)
            if size != good:
                os.ftruncate(fd, good)  # a torn entry of an appender that died
            line = control_frame(len(entries) + 1, record, version=version)
            os.write(fd, line)
            os.fsync(fd)
            if created:
                sync_dir(os.path.dirname(path))
        except OSError as exc:
            raise StoreError(f"cannot append to {path}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        return ControlEntry(run_id=run_id, position=len(entries) + 1, record=record)

    async def read_control(self, run_id: str, *, after: int = 0) -> tuple[ControlEntry, ...]:
        """The run's control entries after position ``after``."""
        entries = await self._in_shared_worker(
            read_control_file, self._control_path(run_id), run_id
        )
        return entries[after:]

    async def control_heads(self, run_ids: Sequence[str]) -> Mapping[str, int]:
        """The last control position of each run that has entries (files re-read on change).

        Raises:
            StoreError: a control file or its folder cannot be read (its permissions, say).
        """
        return await self._in_shared_worker(self._control_heads, tuple(run_ids))

    def _control_heads(self, run_ids: tuple[str, ...]) -> dict[str, int]:
        heads = {}
        for run_id in run_ids:
            path = self._control_path(run_id)
            info = stat_or_none(path)
            if info is None:
                continue
            key = (info.st_size, info.st_mtime_ns)
            cached = self._heads.get(run_id)
            if cached is None or cached[0] != key:
                cached = (key, len(read_control_file(path, run_id)))
                self._heads[run_id] = cached
            if cached[1]:
                heads[run_id] = cached[1]
        return heads


def _renewals_failed(failed: Sequence[tuple[_Held, StoreError]]) -> None:
    """Log the leases a renewal could not renew; they are kept, and tried again next time."""
    held, exc = failed[0]
    _LOG.warning(
        "lease renewal of %d run(s) failed (run %r: %s); their locks are still held, and "
        "the renewal is tried again",
        len(failed),
        held.lease.run_id,
        exc,
    )


def _sidecar_written(path: str, lease: Lease, control_seen: int, *, durable: bool) -> None:
    """`write_sidecar`, its `OSError` (a full disk, say) made a `StoreError`.

    A store that cannot write stops with `StoreError`, the `OSError` as ``__cause__``
    (docs/crash-safety.md, "What is guaranteed", item 7): taking a lease, renewing or
    releasing it alike. Nothing of the write is left behind.
    """
    try:
        write_sidecar(path, lease, control_seen, durable=durable)
    except OSError as exc:
        raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _open_locked(lock_path: str, run_id: str, sidecar: str, now: float) -> int:
    """Open the run's lock file and take its exclusive lock; return the descriptor.

    A lock file deleted or replaced between the open and the lock is opened again.

    Raises:
        RunLeased: another process (or store object) holds the lock.
        StoreError: the lock file cannot be opened.
    """
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise StoreError(f"cannot open {lock_path}: {exc.strerror or exc}") from exc
        try:
            _lock_or_refuse(fd, run_id, sidecar, now)
            if same_file(fd, lock_path):
                return fd
        except OSError as exc:  # a lock the file system refuses (ENOLCK), say
            os.close(fd)
            raise StoreError(f"cannot lock {lock_path}: {exc.strerror or exc}") from exc
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _lock_or_refuse(fd: int, run_id: str, sidecar: str, now: float) -> None:
    """Take the lock file's exclusive lock, or raise `RunLeased` naming its holder."""
    if not _try_lock(fd, fcntl.LOCK_EX, retries=LOCK_RETRIES):
        raise _leased(run_id, sidecar, now)


def _leased(run_id: str, sidecar: str, now: float) -> RunLeased:
    """The error for a run whose lock another process (or store object) holds."""
    current, _ = read_sidecar(sidecar, run_id)
    holder = current or Lease(
        run_id=run_id, owner="another process", generation=0, expires_at=now, heartbeat_at=now
    )
    return RunLeased(run_id, holder)


def _try_lock(fd: int, kind: int, *, retries: int) -> bool:
    for attempt in range(retries):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            if attempt + 1 < retries:
                time.sleep(0.005)
            continue
        return True
    return False


def _lock_is_free(lock_path: str) -> bool:
    """Whether nobody holds the lock file's exclusive lock (a shared one for an instant).

    Raises:
        StoreError: the lock file is there but cannot be opened.
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return True
    except OSError as exc:
        raise StoreError(f"cannot open {lock_path}: {exc.strerror or exc}") from exc
    try:
        if _try_lock(fd, fcntl.LOCK_SH, retries=1):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        return False
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def open_jsonl_store(
    directory: str | PathLike[str],
    *,
    file_ops: FileOps | None = None,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[JsonlStore]:
    """Open a `JsonlStore` for the duration of an ``async with`` block, then `aclose` it.

    Args:
        directory: the store directory (see `JsonlStore.open`).
        file_ops: the committer's file operations (fault injection in tests).
        clock: the clock lease instants are taken from (epoch seconds).

    Yields:
        The open store.

    Raises:
        StoreError: as `JsonlStore.open` and `JsonlStore.aclose`.
    """
    require_trio("treadle.open_jsonl_store")
    store = await JsonlStore.open(directory, file_ops=file_ops, clock=clock)
    try:
        yield store
    finally:
        await store.aclose()
