"""The committer side of the JSONL store: appends and syncs over many files.

`JsonlBackend.commit` takes one batch of the commit engine, appends each run's frame lines to
its file with one ``write`` per file, then syncs (``fdatasync``) every file that holds a barrier
of the batch, once per file, concurrently on a small thread pool: the filesystem journal joins
concurrent syncs into one commit, which is where the barriers of concurrent runs share their
fsync work. A non-barrier write is appended without a sync; the next barrier of the same run
syncs the same file and so makes it durable first (prefix durability per run).

Before appending, the committer compares the file's size with the end of what it knows is in
the file. Bytes beyond are either a torn tail left by a crash (an unterminated line or a tail of
NUL bytes: cut off, durably, before appending) or something else (lines another writer
appended: `ConflictError`; a damaged line: `LogCorrupted`). A write that fails part way is cut
back off, so no half line is left for the next append to fuse with.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Protocol

import attrs

from treadle._exceptions import ConflictError, LeaseLost, LogCorrupted, StoreError, TreadleError
from treadle.stores._engine import BatchReport, RunHead, Write, fail_writes
from treadle.stores._jsonl_files import (
    FORMAT_VERSION,
    RunFile,
    file_identity,
    head_of,
    header_frame,
    open_regular,
    read_run_head,
    records_frame,
    same_file,
)
from treadle.stores._jsonl_files import RunHead as FileRunHead
from treadle.stores._lines import check_frame, scan_lines
from treadle.types import Lease, Record

SYNC_WORKERS: Final = 8
"""Threads that sync files concurrently when a batch holds barriers of several files."""

MAX_OPEN_FILES: Final = 256
"""Run files kept open at once; the least recently written is synced and closed beyond it."""

CLOSED_ENDS_KEEP: Final = 4 * MAX_OPEN_FILES
"""Ends of closed files of runs still going, kept so that reopening one reads nothing; beyond
it the oldest is dropped (a reopen then reads the file's head again). A process that leaves
many runs unfinished (parked, interrupted, handed to another process) keeps no more."""

_LOG = logging.getLogger("treadle.stores.jsonl")
"""The JSONL store's logger (`treadle.stores.jsonl`): torn tails cut before an append."""


FILE_CHECK_INTERVAL_S: Final = 0.05
"""How often (seconds, at most) the committer checks, before a barrier, that a run's file is
still the file it holds open (docs/crash-safety.md, "What the JSONL store detects"): one
``stat`` and one ``fstat``."""


class FileOps(Protocol):
    """The file operations the committer uses; `OsFileOps` is the real one.

    A test replaces it to inject faults (a full disk, a failing sync); see
    `treadle.testing.faults.FailingFileOps`. Every method raises `OSError` on failure.
    """

    def open(self, path: str, *, create: bool) -> int:
        """Open ``path`` to read and append (``create``: it must not exist yet); the fd."""
        ...

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """Write some of ``data`` at the end of the file; return how many bytes were written."""
        ...

    def read(self, fd: int, offset: int, size: int) -> bytes:
        """Read up to ``size`` bytes at ``offset``."""
        ...

    def sync(self, fd: int) -> None:
        """Make the file's data durable (``fdatasync``)."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make the directory entries of ``path`` (a directory) durable."""
        ...

    def truncate(self, fd: int, size: int) -> None:
        """Cut the file to ``size`` bytes."""
        ...

    def size(self, fd: int) -> int:
        """The file's size in bytes."""
        ...

    def close(self, fd: int) -> None:
        """Close the fd."""
        ...

    def same_file(self, fd: int, path: str) -> bool:
        """Whether ``path`` still names the file open as ``fd`` (not removed nor replaced)."""
        ...


_SYNC: Final = getattr(os, "fdatasync", os.fsync)


@attrs.frozen
class OsFileOps:
    """`FileOps` on the real filesystem (``os`` calls)."""

    def open(self, path: str, *, create: bool) -> int:
        """Open to read and append; ``create`` uses ``O_CREAT | O_EXCL``.

        Raises:
            OSError: as `treadle.stores._jsonl_files.open_regular` (not a regular file).
        """
        flags = os.O_RDWR | os.O_APPEND
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        return open_regular(path, flags)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """``os.write``."""
        return os.write(fd, data)

    def read(self, fd: int, offset: int, size: int) -> bytes:
        """``os.pread``."""
        return os.pread(fd, size, offset)

    def sync(self, fd: int) -> None:
        """``fdatasync`` (``fsync`` where there is none)."""
        _SYNC(fd)

    def sync_dir(self, path: str) -> None:
        """``fsync`` of the directory (a no-op on Windows, which cannot open directories)."""
        if sys.platform == "win32":  # pragma: no cover
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, fd: int, size: int) -> None:
        """``ftruncate``."""
        os.ftruncate(fd, size)

    def size(self, fd: int) -> int:
        """``fstat(fd).st_size``."""
        return os.fstat(fd).st_size

    def close(self, fd: int) -> None:
        """``os.close``."""
        os.close(fd)

    def same_file(self, fd: int, path: str) -> bool:
        """Device and inode of ``path`` (``stat``) and of ``fd`` (``fstat``) compared."""
        return same_file(fd, path)


@attrs.frozen(kw_only=True)
class FileHead:
    """What a run's file held when the engine first loaded the run (`Write.head`).

    Attributes:
        exists: the file exists.
        end: bytes of its good prefix (its torn tail, if any, starts here).
        header: it holds an intact header line.
        version: the format version its records are written in: its header's, or
            `FORMAT_VERSION` for a file the first write gives a header.
    """

    exists: bool
    end: int
    header: bool
    version: int = FORMAT_VERSION


@attrs.define(eq=False)
class _File:
    run_id: str
    path: str
    fd: int
    end: int
    header: bool
    version: int = FORMAT_VERSION
    dirty: bool = False
    checked: float = -FILE_CHECK_INTERVAL_S
    """When (monotonic seconds) the path was last found to name this open file."""


@attrs.define(eq=False)
class _Group:
    """One file's writes of a batch."""

    path: str
    writes: list[Write]
    file: _File | None = None

    @property
    def barrier(self) -> bool:
        return any(w.barrier for w in self.writes)


class JsonlBackend:
    """The `treadle.stores._engine.Backend` of the JSONL store.

    Args:
        directory: the store directory (synced after a run file is created).
        path_of: the file of a run.
        ops: the file operations.
        held: the leases this store object holds, by run (its OS locks guarantee that no
            other process writes those runs); a write of a generation not held is refused.
    """

    def __init__(
        self,
        directory: str,
        path_of: Callable[[str], str],
        ops: FileOps,
        held: Callable[[str], Lease | None],
    ) -> None:
        self.description = f"JSONL store {directory}"
        self._directory = directory
        self._path_of = path_of
        self._ops = ops
        self._held = held
        self._files: collections.OrderedDict[str, _File] = collections.OrderedDict()
        self._closed_ends: dict[str, FileHead] = {}  # files evicted while their run goes on
        self._dir_dirty = False
        self._pool: ThreadPoolExecutor | None = None
        self._created_ns = 0
        # What the store's last read of a file found, while nothing else wrote it: a run's
        # first write after a read of its log (a resume) then skips reading it again.
        self._read: dict[str, tuple[tuple[int, ...], FileRunHead]] = {}

    # ------------------------------------------------------------------ the trio side

    def encode(self, run_id: str, seq: int, generation: int, records: tuple[Record, ...]) -> object:
        """The write's frame line, in the current format.

        A file begun in an older format gets its own at append time (`_payload`).
        """
        return records_frame(seq, records, generation=generation, run_id=run_id)

    def size(self, payload: object) -> int:
        """The bytes of the frame line."""
        line: bytes = payload  # type: ignore[assignment]
        return len(line)

    def admit(self, run_id: str, generation: int) -> None:
        """Refuse a write whose generation is not the lease this store object holds.

        Raises:
            LeaseLost: it is not.
        """
        lease = self._held(run_id)
        if lease is None or lease.generation != generation:
            current = lease.generation if lease is not None else None
            raise LeaseLost(run_id, generation=generation, current=current)

    def remember(self, path: str, found: RunFile) -> None:
        """Note what a read of ``path`` found, for `load` (in the trio thread)."""
        if found.identity is None:
            return
        if len(self._read) >= MAX_OPEN_FILES:
            self._read.clear()
        self._read[path] = (found.identity, head_of(found))

    def load(self, run_id: str) -> RunHead:
        """Read the run's file: its next seq, where its good prefix ends, its format.

        Its frames are checked, its records not decoded (`read_run_head`); a file the store
        read last (`remember`) and that has not changed since is not read again (should it
        have changed unseen, the tail check of the first append refuses it).
        """
        path = self._path_of(run_id)
        read = self._read.pop(path, None)
        found = read[1] if read is not None and _identity(path) == read[0] else None
        if found is None:
            found = read_run_head(path)
        if found.run_id is not None and found.run_id != run_id:
            raise LogCorrupted(
                f"the header names run {found.run_id!r}", where=self._path_of(run_id), offset=0
            )
        return RunHead(next_seq=found.next_seq, state=_file_head(found))

    # ------------------------------------------------------------------ one batch

    commits_here = True
    """A batch waits for no other process (a run's file is written only under its lease)."""

    def commit_here(self, batch: list[Write]) -> BatchReport:
        """`commit`, in the trio thread: it never waits for another process."""
        return self.commit(batch)

    def commit(self, batch: list[Write]) -> BatchReport:
        """Append and sync one batch, at most half of `MAX_OPEN_FILES` files at a time."""
        groups: dict[str, _Group] = {}
        for write in batch:
            path = self._path_of(write.run_id)
            groups.setdefault(path, _Group(path=path, writes=[])).writes.append(write)
        counts: dict[str, int] = {"tails_cut": 0}
        lost: list[tuple[str, TreadleError]] = []
        syncs = 0
        items = list(groups.values())
        size = max(1, MAX_OPEN_FILES // 2)
        for start in range(0, len(items), size):
            syncs += self._commit_files(items[start : start + size], counts, lost)
        return BatchReport(syncs=syncs, lost=tuple(lost), counters=counts)

    def _commit_files(
        self, groups: list[_Group], counts: dict[str, int], lost: list[tuple[str, TreadleError]]
    ) -> int:
        for group in groups:
            group.file = self._append(group, counts)
        to_sync = [g for g in groups if g.file is not None and g.barrier]
        syncs = self._sync_groups(to_sync) if to_sync else 0
        for group in groups:
            if (
                group.file is not None
                and group.writes[-1].closes
                and group.writes[-1].error is None
            ):
                self._close(group.path, finished=True)
        while len(self._files) > MAX_OPEN_FILES:
            syncs += self._evict(next(iter(self._files)), lost)
        return syncs

    def _append(self, group: _Group, counts: dict[str, int]) -> _File | None:
        """Append a file's writes with one write call; fail them all on an error."""
        first = group.writes[0]
        try:
            file = self._open(group.path, first)
            if group.barrier:
                self._check_identity(file)
            data = b"".join([self._payload(file, w) for w in group.writes])
            if not file.header:
                data = self._header(first.run_id) + data
            self._append_at(file, data, first, counts)
            file.header = True
        except TreadleError as exc:
            fail_writes(group.writes, exc)
            return None
        except OSError as exc:
            fail_writes(group.writes, _store_error(group.path, "cannot append to", exc))
            return None
        return file

    def _check_identity(self, file: _File) -> None:
        """Refuse to confirm writes into a run file that was removed or replaced meanwhile.

        Appends to an fd whose file was unlinked succeed and sync, and are lost: the run
        would go on (and a later drive start it over, repeating its tool calls). Checked
        before a barrier, at most every `FILE_CHECK_INTERVAL_S` per file; the file is closed
        and the run's writes fail (the engine then refuses the run's later writes here).

        Raises:
            StoreError: the path names another file, or none.
        """
        now = time.monotonic()
        if now - file.checked < FILE_CHECK_INTERVAL_S:
            return
        if self._ops.same_file(file.fd, file.path):
            file.checked = now
            return
        self._files.pop(file.path, None)
        self._closed_ends.pop(file.path, None)
        with contextlib.suppress(OSError):
            self._ops.close(file.fd)
        raise StoreError(
            f"{file.path}: the run's file was removed or replaced while the store held it "
            "open; nothing more of the run is written "
            '(docs/crash-safety.md, "What the JSONL store detects")'
        )

    @staticmethod
    def _payload(file: _File, write: Write) -> bytes:
        """The write's line in the file's own format.

        Raises:
            StoreError: its records cannot be written in the older format of the file.
        """
        if file.version == FORMAT_VERSION:
            return write.payload  # type: ignore[return-value]
        try:
            return records_frame(
                write.seq,
                write.records,
                generation=write.generation,
                run_id=write.run_id,
                version=file.version,
            )
        except Exception as exc:
            raise StoreError(
                f"cannot write to {file.path} in its format (version {file.version}): {exc}"
            ) from exc

    def _header(self, run_id: str) -> bytes:
        self._created_ns = max(self._created_ns + 1, time.time_ns())
        return header_frame(run_id, created_ns=self._created_ns)

    def _append_at(self, file: _File, data: bytes, first: Write, counts: dict[str, int]) -> None:
        size = self._ops.size(file.fd)
        if size != file.end:
            self._check_tail(file, first, size)
            counts["tails_cut"] += 1
        try:
            self._write_all(file, data)
        except OSError:
            self._undo(file)
            raise
        file.end += len(data)

    def _check_tail(self, file: _File, first: Write, size: int) -> None:
        """Bytes beyond the file's known end: cut a torn tail, refuse anything else.

        Raises:
            ConflictError: another writer appended whole lines, the first at ``first.seq``
                (the seq the file's end awaits) and each after it at the next.
            LogCorrupted: a damaged line, a line at another seq (a line written twice, an
                old one copied back), or the file shrank below what it held.
        """
        start = file.end
        if size < start:
            raise LogCorrupted(
                f"the file is {size} bytes, shorter than its log ({start} bytes)",
                where=file.path,
                offset=size,
            )
        tail = self._ops.read(file.fd, start, size - start)
        scanned = scan_lines(tail, check_frame, where=file.path, base=start)
        frames = list(scanned.items)
        if start == 0 and frames and frames[0][0] == 0:
            del frames[0]  # the header of a first write that crashed is no write
        if frames:
            expected = _check_appended(frames, first.seq, file.path)
            raise ConflictError(first.run_id, expected=expected, got=first.seq)
        self._ops.truncate(file.fd, start)  # a torn tail (or a crashed first write's header)
        self._ops.sync(file.fd)
        torn = scanned.torn
        if torn is not None:  # reported here: a read by the lease holder does not report it
            _LOG.warning(
                "%s: cut a torn tail of %d bytes at offset %d (%s): a write that was never "
                "acknowledged",
                file.path,
                torn.length,
                torn.offset,
                torn.reason,
            )

    def _open(self, path: str, first: Write) -> _File:
        head = first.head if isinstance(first.head, FileHead) else None
        file = self._files.get(path)
        if file is not None:
            self._files.move_to_end(path)
            if head is not None:  # the run was loaded again (its lease moved): trust the read
                file.end, file.header, file.version = head.end, head.header, head.version
            return file
        create = head is not None and not head.exists
        try:
            fd = self._ops.open(path, create=create)
            self._dir_dirty = self._dir_dirty or create
        except FileExistsError:  # created meanwhile: the tail check tells a remnant from a writer
            fd = self._ops.open(path, create=False)
        remembered = self._closed_ends.pop(path, None)
        if head is None:  # the run goes on here: its end as it was closed, or read again
            head = remembered or self._reread(path)
        file = self._files[path] = _File(
            run_id=first.run_id,
            path=path,
            fd=fd,
            end=head.end,
            header=head.header,
            version=head.version,
        )
        return file

    def _reread(self, path: str) -> FileHead:
        return _file_head(read_run_head(path))

    def _write_all(self, file: _File, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self._ops.write(file.fd, view)
            if written <= 0:
                raise OSError(0, "write made no progress")
            file.dirty = True
            view = view[written:]

    def _undo(self, file: _File) -> None:
        """After a failed append, cut the partial bytes off (best effort).

        The run is refused from now on; if the cut fails too, what remains is an unterminated
        line, which a reader treats as a torn tail and the next append (after a reopen) cuts.
        """
        with contextlib.suppress(OSError):
            self._ops.truncate(file.fd, file.end)

    def _sync_groups(self, groups: list[_Group]) -> int:
        """Sync the directory if a file was created, then every file once, concurrently."""
        syncs = 0
        if self._dir_dirty:
            try:
                self._ops.sync_dir(self._directory)
            except OSError as exc:
                error = _store_error(self._directory, "cannot sync", exc)
                for group in groups:
                    fail_writes(group.writes, error)
                return 0
            syncs += 1
            self._dir_dirty = False
        files = [g.file for g in groups if g.file is not None]
        errors = self._sync_all(files)
        for group, failure in zip(groups, errors, strict=True):
            assert group.file is not None
            if failure is None:
                group.file.dirty = False
            else:
                fail_writes(group.writes, _store_error(group.path, "cannot sync", failure))
        return syncs + len(files)

    def _sync_all(self, files: Sequence[_File]) -> list[OSError | None]:
        if len(files) == 1:
            return [self._sync_one(files[0])]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(SYNC_WORKERS, thread_name_prefix="treadle-fsync")
        return list(self._pool.map(self._sync_one, files))

    def _sync_one(self, file: _File) -> OSError | None:
        try:
            self._ops.sync(file.fd)
        except OSError as exc:
            return exc
        return None

    def _evict(self, path: str, lost: list[tuple[str, TreadleError]]) -> int:
        file = self._files[path]
        synced = 0
        if file.dirty:
            synced = 1
            failure = self._sync_one(file)
            if failure is not None:
                lost.append((file.run_id, _store_error(path, "cannot sync", failure)))
        self._close(path)
        return synced

    def _close(self, path: str, *, finished: bool = False) -> None:
        file = self._files.pop(path, None)
        if file is None:
            return
        if not finished:
            ends = self._closed_ends
            ends[path] = FileHead(
                exists=True, end=file.end, header=file.header, version=file.version
            )
            if len(ends) > CLOSED_ENDS_KEEP:
                del ends[next(iter(ends))]
        with contextlib.suppress(OSError):
            self._ops.close(file.fd)

    def finish(self) -> BatchReport:
        """Make every file written here durable, then close it (and stop the sync pool)."""
        lost: list[tuple[str, TreadleError]] = []
        syncs = 0
        if self._dir_dirty:
            try:
                self._ops.sync_dir(self._directory)
                syncs += 1
            except OSError as exc:
                error = _store_error(self._directory, "cannot sync", exc)
                lost.extend((f.run_id, error) for f in self._files.values())
        for path in list(self._files):
            syncs += self._evict(path, lost)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        return BatchReport(syncs=syncs, lost=tuple(lost))


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        return file_identity(os.stat(path))
    except OSError:
        return None


def _file_head(found: FileRunHead) -> FileHead:
    return FileHead(
        exists=found.exists, end=found.end, header=found.run_id is not None, version=found.version
    )


def _check_appended(frames: list[tuple[int, bytes, int]], seq: int, path: str) -> int:
    """The seq after whole lines found past a file's end, which should have been ``seq``.

    Another writer's lines go on from there; a line at any other seq is damage, named as a
    read names it (docs/crash-safety.md, "What the JSONL store detects").

    Raises:
        LogCorrupted: a line's seq is not the one its place awaits.
    """
    for found, line, offset in frames:  # (seq, line, byte offset), in file order
        if found != seq:
            raise LogCorrupted(f"frame seq {found}, expected {seq}", where=path, offset=offset)
        seq = _next_seq(found, line)
    return seq


def _next_seq(seq: int, line: bytes) -> int:
    """The seq after a record frame: its first seq plus its records."""
    try:
        records = json.loads(line).get("records")
    except ValueError:
        records = None
    return seq + (len(records) if isinstance(records, list) else 1)


def _store_error(path: str, what: str, exc: OSError) -> StoreError:
    err = StoreError(f"{what} {path}: {exc.strerror or exc}")
    err.__cause__ = exc
    return err
