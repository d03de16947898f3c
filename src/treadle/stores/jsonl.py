"""A run store of plain files: one JSON-lines file per run in a directory, with group commit.

Layout (format ``treadle.jsonl`` version 1; docs/decisions/0004-jsonl-format.md)::

    <directory>/LOCK                        held (flock) by the one store object writing here
    <directory>/00000001-run-42.jsonl       one file per run, numbered in first-write order
    <directory>/00000002-%41BC.jsonl        run ids are percent-encoded (only a-z 0-9 . _ - kept)
    <directory>/00000003-~<sha256>.jsonl    run ids whose encoding is too long for a file name

Each line of a run file is one frame, the result of ONE store operation::

    {"seq":0,"crc":"1c291ca3","header":{"format":"treadle.jsonl","version":1,"run_id":"r"}}
    {"seq":1,"crc":"8d0b5e1a","records":[{"kind":"run_started",...}]}
    {"seq":5,"crc":"00c0ffee","records":[{"kind":"action_result",...},{"kind":"step",...}]}

``seq`` is the seq of the frame's first record (0 for the header, which comes first and only
once); ``records`` holds the records of the operation in seq order, so an action result and
its step record are one line and reach the disk together or not at all. ``crc`` is the
CRC-32 (zlib) of the line's bytes, newline excluded, with the 8 hex digits of ``crc`` taken as
``00000000``.

Reading (`treadle.stores._lines`): each line is decoded on its own as strict UTF-8. A last line
without a trailing newline, or a last line whose checksum does not match, is a torn tail left
by a crash mid-append: it was never acknowledged, it is reported (`JsonlStore.torn_tails`,
`JsonlStatistics.torn_tails` and a ``treadle.stores.jsonl`` log warning) and cut off before
the run's next append. A damaged line with more lines after it is corruption:
`LogCorrupted` with the byte offset of that line.

Threads: one committer thread per store object appends every run's lines and syncs the files
of each batch's barriers concurrently (`treadle.stores._jsonl_commit`). Reads run in trio
worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import zlib
from collections.abc import AsyncIterator, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote

import attrs
import trio

from treadle._exceptions import ConflictError, LogCorrupted, SchemaTooNew, StoreError, UsageError
from treadle.stores._codec import check_schema, encode, record_from_dict
from treadle.stores._jsonl_commit import Committer, Counts, FileOps, OsFileOps, Write, refusal
from treadle.stores._lines import FrameError, ScannedLines, TornSpan, scan_lines
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
)

if sys.platform != "win32":
    import fcntl

FORMAT: Final = "treadle.jsonl"
"""The ``format`` of a run file's header."""

FORMAT_VERSION: Final = 1
"""The frame format version written in every header; a newer file is refused."""

MAX_PENDING_WRITES: Final = 10_000
"""Queued, unwritten writes above which a non-barrier write waits for its batch."""

CLOSE_GRACE_S: Final = 30.0
"""Seconds `JsonlStore.aclose` waits (shielded) for the committer to sync and stop."""

MAX_NAME_CHARS: Final = 200
"""Longest encoded run id kept in a file name; longer ones are named by their SHA-256."""

_LOG = logging.getLogger(__name__)
_SAFE: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_NAME: Final = re.compile(r"([0-9]{8,})-([^/]*)\.jsonl")
_PREFIX: Final = re.compile(rb'\{"seq":(0|[1-9][0-9]{0,17}),"crc":"([0-9a-f]{8})",')
_ZEROS: Final = b"00000000"
_PROBE_CHUNK: Final = 65_536


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
        torn_tails: torn tails found since opening (see `JsonlStore.torn_tails`).
    """

    batches: int = 0
    syncs: int = 0
    sync_rounds: int = 0
    writes_committed: int = 0
    records_written: int = 0
    max_batch: int = 0
    pending: int = 0
    torn_tails: int = 0


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


@attrs.define(eq=False)
class _RunState:
    """What the trio side knows about one run's file.

    Attributes:
        path: the run file; ``None`` until the run's first write creates it.
        next_seq: the seq of the next write.
        end: bytes of the file holding complete, written lines (reads stop here).
        records: records written to the file.
        header: the header line is in the file or queued.
        cut_to: a torn tail to cut off with the next append.
    """

    path: str | None
    next_seq: int = 1
    end: int = 0
    records: int = 0
    header: bool = False
    cut_to: int | None = None
    last: Write | None = None
    error: StoreError | None = None
    reported: bool = False


# --------------------------------------------------------------------------- file names


def encode_run_id(run_id: str) -> str:
    """The file-name form of a run id: ``a-z 0-9 . _ -`` kept, every other byte ``%XX``.

    Upper-case letters are encoded too, so names never collide on case-insensitive
    filesystems.
    """
    return "".join(
        ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        for ch in run_id
    )


def run_file_name(counter: int, run_id: str) -> str:
    """The name of a run's file: its first-write number and its encoded (or hashed) id."""
    encoded = encode_run_id(run_id)
    if len(encoded) > MAX_NAME_CHARS:
        digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()
        encoded = f"~{digest}"
    return f"{counter:08d}-{encoded}.jsonl"


# --------------------------------------------------------------------------- frames


def _frame(seq: int, key: str, payload: str) -> bytes:
    head = b'{"seq":%d,"crc":"' % seq
    tail = f'","{key}":{payload}}}'.encode()
    crc = zlib.crc32(tail, zlib.crc32(_ZEROS, zlib.crc32(head)))
    return b"%s%08x%s\n" % (head, crc, tail)


def header_frame(run_id: str) -> bytes:
    """The header line of a run file (newline included)."""
    header = {"format": FORMAT, "version": FORMAT_VERSION, "run_id": run_id}
    return _frame(0, "header", json.dumps(header, ensure_ascii=False, separators=(",", ":")))


def records_frame(seq: int, records: Sequence[Record]) -> bytes:
    """The line of one store operation (newline included).

    Raises:
        UnicodeEncodeError: a text holds a lone surrogate (not valid UTF-8).
        TypeError, ValueError: a record cannot be written as JSON.
    """
    return _frame(seq, "records", "[" + ",".join(encode(r) for r in records) + "]")


def check_frame(line: bytes, offset: int) -> tuple[int, bytes, int]:
    """The frame check of one line: the prefix and the checksum.

    Returns:
        ``(seq, line, offset)``.

    Raises:
        FrameError: the line does not start like a frame, or its checksum does not match.
    """
    match = _PREFIX.match(line)
    if match is None:
        raise FrameError("not a frame")
    start, stop = match.span(2)
    crc = zlib.crc32(line[stop:], zlib.crc32(_ZEROS, zlib.crc32(line[:start])))
    if crc != int(match[2], 16):
        raise FrameError("checksum mismatch")
    return int(match[1]), line, offset


@attrs.frozen(kw_only=True)
class RunFile:
    """A run file as read back.

    Attributes:
        run_id: from the header (``None`` when the file holds no intact header yet).
        records: every record, in seq order.
        next_seq: the seq the next record gets.
        end: bytes of the good prefix.
        torn: the torn tail, if any.
    """

    run_id: str | None
    records: tuple[Record, ...]
    next_seq: int
    end: int
    torn: TornSpan | None


def _content(where: str, line: bytes, offset: int) -> dict[str, Any]:
    try:
        data = json.loads(line.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        raise LogCorrupted(f"undecodable frame: {exc}", where=where, offset=offset) from exc
    if not isinstance(data, dict) or len(data) != 3 or not ({"header", "records"} & set(data)):
        raise LogCorrupted(
            "a frame must hold seq, crc and header or records", where=where, offset=offset
        )
    return data


def _read_header(where: str, frame: tuple[int, bytes, int]) -> str:
    seq, line, offset = frame
    data = _content(where, line, offset)
    header = data.get("header")
    if seq != 0 or not isinstance(header, dict) or header.get("format") != FORMAT:
        raise LogCorrupted(f"the first line is not a {FORMAT} header", where=where, offset=offset)
    version = header.get("version")
    if not isinstance(version, int) or not isinstance(header.get("run_id"), str):
        raise LogCorrupted("the header lacks version or run_id", where=where, offset=offset)
    if version > FORMAT_VERSION:
        raise SchemaTooNew(version, FORMAT_VERSION)
    run_id: str = header["run_id"]
    return run_id


def _read_records(
    where: str, run_id: str, frame: tuple[int, bytes, int], expected: int
) -> list[Record]:
    seq, line, offset = frame
    if seq != expected:
        raise LogCorrupted(f"frame seq {seq}, expected {expected}", where=where, offset=offset)
    items = _content(where, line, offset).get("records")
    if not isinstance(items, list) or not items:
        raise LogCorrupted("a frame holds no records", where=where, offset=offset)
    records: list[Record] = []
    for item in items:
        try:
            record = record_from_dict(item)
        except Exception as exc:
            raise LogCorrupted(f"undecodable record: {exc}", where=where, offset=offset) from exc
        if record.run_id != run_id:
            raise LogCorrupted(
                f"a record of run {record.run_id!r} in the file of run {run_id!r}",
                where=where,
                offset=offset,
            )
        check_schema(record)
        records.append(record)
    return records


def read_run_file(path: str, *, limit: int | None = None) -> RunFile:
    """Read and check a run file (blocking; call it in a worker thread).

    Args:
        path: the file.
        limit: read only this many bytes (a prefix known to end with a complete line).

    Returns:
        The records and where the good prefix ends; a missing file reads as empty.

    Raises:
        LogCorrupted: a damaged line with more after it, a bad header, a seq gap, a record
            that does not decode or belongs to another run (``offset``: the line's byte).
        SchemaTooNew: the header or the run-started record is from a newer version.
        StoreError: the file cannot be read.
    """
    try:
        with open(path, "rb") as file:
            data = file.read() if limit is None else file.read(limit)
    except FileNotFoundError:
        data = b""
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    scanned: ScannedLines[tuple[int, bytes, int]] = scan_lines(data, check_frame, where=path)
    if not scanned.items:
        return RunFile(run_id=None, records=(), next_seq=1, end=scanned.end, torn=scanned.torn)
    run_id = _read_header(path, scanned.items[0])
    records: list[Record] = []
    for frame in scanned.items[1:]:
        records.extend(_read_records(path, run_id, frame, len(records) + 1))
    return RunFile(
        run_id=run_id,
        records=tuple(records),
        next_seq=len(records) + 1,
        end=scanned.end,
        torn=scanned.torn,
    )


def _has_records(path: str) -> bool:
    """Whether the file holds a header and at least one record line (reads only the start).

    A damaged second line counts when more bytes follow it (reading the run then fails
    loudly); a torn one does not.
    """
    data = b""
    with open(path, "rb") as file:
        while data.count(b"\n") < 2:
            chunk = file.read(_PROBE_CHUNK)
            if not chunk:
                return False
            data += chunk
    first = data.index(b"\n")
    second = data.index(b"\n", first + 1)
    try:
        check_frame(data[first + 1 : second], first + 1)
    except FrameError:
        return os.path.getsize(path) > second + 1
    return True


# --------------------------------------------------------------------------- the directory


@attrs.frozen(kw_only=True)
class _Found:
    counter: int
    run_id: str | None
    path: str


def _scan_directory(directory: str) -> list[_Found]:
    found: list[_Found] = []
    for entry in os.scandir(directory):
        match = _NAME.fullmatch(entry.name)
        if match is None or not entry.is_file():
            continue
        encoded = match[2]
        if encoded.startswith("~"):
            run_id = read_run_file(entry.path, limit=_header_limit(entry.path)).run_id
        else:
            try:
                run_id = unquote(encoded, errors="strict")
            except UnicodeDecodeError as exc:
                raise StoreError(f"{entry.path}: not a run file name") from exc
        found.append(_Found(counter=int(match[1]), run_id=run_id, path=entry.path))
    found.sort(key=lambda f: (f.counter, f.path))
    return found


def _header_limit(path: str) -> int:
    """Bytes up to the end of the first line (0 when there is none)."""
    with open(path, "rb") as file:
        data = file.read(_PROBE_CHUNK)
    newline = data.find(b"\n")
    return newline + 1 if newline >= 0 else 0


def _open_directory(directory: str) -> tuple[int | None, list[_Found]]:
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise StoreError(f"cannot open JSONL store {directory}: not a directory")
    if not path.parent.is_dir():
        raise StoreError(f"cannot open JSONL store {directory}: {path.parent} is not a directory")
    try:
        if not path.exists():
            path.mkdir()
            OsFileOps().sync_dir(str(path.parent))
        lock = _lock(directory)
    except OSError as exc:
        raise StoreError(f"cannot open JSONL store {directory}: {exc.strerror or exc}") from exc
    try:
        return lock, _scan_directory(directory)
    except BaseException:
        _unlock(lock)
        raise


def _lock(directory: str) -> int | None:
    if sys.platform == "win32":  # pragma: no cover
        return None
    fd = os.open(os.path.join(directory, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreError(
            f"JSONL store {directory} is in use by another store object (in this or another "
            "process); a run directory has one writer at a time"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # releases the flock


# --------------------------------------------------------------------------- the store


class JsonlStore:
    """A `treadle.ports.RunStore` of JSON-lines files, one per run, in one directory.

    Open it with `JsonlStore.open` or `open_jsonl_store`, inside a trio run; the store belongs
    to that trio run, and holds the directory's lock until `aclose` (one writer at a time,
    in any process). Any number of runs may share one store object: their writes are appended
    and synced together by its committer thread (group commit).

    Barriers (`write_intent`, `write_control`, `write_run_finished`) return once their line
    and every earlier line of the run are synced. The other writes return once queued; if
    their append later fails, the error is raised by the next write of that run. After a
    write of a run fails, the store refuses every further write of that run with
    `StoreError`; open the store again to resume it.

    Every write raises:
        ConflictError: ``seq`` is not the run's next seq. Nothing is written.
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

    def __init__(
        self,
        directory: str,
        lock: int | None,
        found: list[_Found],
        ops: FileOps,
        token: trio.lowlevel.TrioToken,
    ) -> None:
        """Private: use `JsonlStore.open`."""
        self._directory = directory
        self._lock: int | None = lock
        self._paths: dict[str, str] = {}
        self._order: list[str] = []
        self._counter = max((f.counter for f in found), default=0) + 1
        for entry in found:
            if entry.run_id is None:
                continue
            if entry.run_id in self._paths:
                _unlock(lock)
                raise StoreError(
                    f"{directory}: run {entry.run_id!r} has two files: "
                    f"{self._paths[entry.run_id]} and {entry.path}"
                )
            self._paths[entry.run_id] = entry.path
            self._order.append(entry.run_id)
        self._runs: dict[str, _RunState] = {}
        self._listed: set[str] = set()
        self._torn: list[TornTail] = []
        self._last: Write | None = None
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
            StoreError: the directory cannot be created or locked (another store object,
                in this or another process, has it open), or two files hold one run.
            LogCorrupted, SchemaTooNew: the header of a hashed-name run file is bad or newer.
        """
        text = str(Path(directory))
        token = trio.lowlevel.current_trio_token()
        lock, found = await trio.to_thread.run_sync(_open_directory, text)
        return cls(text, lock, found, file_ops or OsFileOps(), token)

    @property
    def directory(self) -> str:
        """The store directory."""
        return self._directory

    def statistics(self) -> JsonlStatistics:
        """Counters since the store was opened."""
        return JsonlStatistics(**attrs.asdict(self._counters))

    def torn_tails(self) -> tuple[TornTail, ...]:
        """Torn tails found since the store was opened, in the order they were found.

        A torn tail is reported once per store object, when its file is first read (by
        `read_log`, or by the run's first write), and cut off with the run's next append.
        """
        return tuple(self._torn)

    def run_file(self, run_id: str) -> str | None:
        """The path of the run's file, or ``None`` while the run has none."""
        state = self._runs.get(run_id)
        if state is not None and state.path is not None:
            return state.path
        return self._paths.get(run_id)

    async def write_run_started(self, record: RunStarted, *, seq: int) -> None:
        """Queue the run-started record (not a barrier; raises an earlier write's failure)."""
        await self._submit(record.run_id, seq, (record,), barrier=False)

    async def write_intent(self, record: ModelIntent | ActionIntent, *, seq: int) -> None:
        """Append an intent; a barrier: returns once synced with all before it."""
        await self._submit(record.run_id, seq, (record,), barrier=True)

    async def write_model_result(self, record: ModelResult, *, seq: int) -> None:
        """Queue a model-call result (not a barrier)."""
        await self._submit(record.run_id, seq, (record,), barrier=False)

    async def write_step(
        self, action_results: Sequence[ActionResult] | None, step: StepRecord, *, seq: int
    ) -> None:
        """Queue the action results and step record as one line (not a barrier).

        The records take seqs ``seq, seq + 1, ...``; the step record comes last. One line
        holds them all, so they are durable together or not at all.
        """
        await self._submit(step.run_id, seq, (*(action_results or ()), step), barrier=False)

    async def write_control(
        self, record: CancelRequested | ApprovalRequested | ApprovalDecided, *, seq: int
    ) -> None:
        """Append an approval or cancel record; a barrier."""
        await self._submit(record.run_id, seq, (record,), barrier=True)

    async def write_run_finished(self, record: RunFinished, *, seq: int) -> None:
        """Append the run-finished record; a barrier. The run's file is closed after it."""
        await self._submit(record.run_id, seq, (record,), barrier=True, closes=True)

    async def read_log(self, run_id: str) -> RunLog:
        """Read the run's whole log, after the writes queued for it here are written.

        A torn tail is left out and reported (`torn_tails`); it is not cut off by reading.

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
        if path is None:
            return RunLog(run_id=run_id)
        limit = state.end if state is not None else None
        found = await trio.to_thread.run_sync(lambda: read_run_file(path, limit=limit))
        self._check_run_id(path, run_id, found)
        if state is None:
            self._adopt(run_id, path, found)
        return RunLog(run_id=run_id, records=found.records)

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one written record, in first-write order.

        Raises:
            StoreError: a file cannot be read, or the store is closed.
        """
        self._check_open()
        if self._last is not None:
            await self._wait_done(self._last)
        unknown = [
            (run_id, self._paths[run_id])
            for run_id in self._order
            if run_id not in self._runs and run_id not in self._listed
        ]
        if unknown:
            probed = await trio.to_thread.run_sync(_probe_all, unknown)
            self._listed.update(probed)
        return tuple(run_id for run_id in self._order if self._has_records(run_id))

    async def aclose(self) -> None:
        """Write and sync everything queued, stop the committer and release the directory.

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
        lock, self._lock = self._lock, None
        _unlock(lock)
        self._raise_unreported()

    # ------------------------------------------------------------------ internals

    async def _submit(
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
        create = state.path is None
        path = state.path or self._new_path(run_id)
        write = Write(
            run_id=run_id,
            path=path,
            data=line if state.header else header_frame(run_id) + line,
            records=len(records),
            barrier=barrier,
            create=create,
            cut_to=state.cut_to,
            closes=closes,
        )
        wait = barrier or self._counters.pending >= MAX_PENDING_WRITES
        if wait:
            write.event = trio.Event()
        self._committer.inbox.put(write, flush=wait)  # StoreError if the committer is gone
        if create:
            self._paths[run_id] = path
            self._order.append(run_id)
            self._counter += 1
        state.path, state.header, state.cut_to = path, True, None
        state.next_seq += len(records)
        state.last = self._last = write
        self._counters.pending += 1
        if write.event is None:
            return
        await write.event.wait()
        if write.error is not None:
            state.reported = True
            raise write.error

    def _new_path(self, run_id: str) -> str:
        return os.path.join(self._directory, run_file_name(self._counter, run_id))

    async def _load_state(self, run_id: str) -> _RunState:
        path = self._paths.get(run_id)
        if path is None:
            state = _RunState(path=None)
        else:
            found = await trio.to_thread.run_sync(read_run_file, path)
            self._check_run_id(path, run_id, found)
            state = _state_of(path, found)
            self._note_torn(run_id, path, found.torn)
        # another task may have loaded (and advanced) it meanwhile: keep that one
        return self._runs.setdefault(run_id, state)

    def _adopt(self, run_id: str, path: str, found: RunFile) -> None:
        """Keep what a read learnt about a run not yet written here (saves a re-read)."""
        if run_id not in self._runs:
            self._runs[run_id] = _state_of(path, found)
            self._note_torn(run_id, path, found.torn)

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

    def _has_records(self, run_id: str) -> bool:
        state = self._runs.get(run_id)
        if state is not None:
            return state.records > 0
        return run_id in self._listed

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
        next_seq=found.next_seq,
        end=found.end,
        records=len(found.records),
        header=found.run_id is not None,
        cut_to=found.torn.offset if found.torn is not None else None,
    )


def _probe_all(files: list[tuple[str, str]]) -> set[str]:
    return {run_id for run_id, path in files if _has_records(path)}


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
