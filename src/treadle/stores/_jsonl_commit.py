"""The committer thread of `treadle.stores.jsonl`: appends and group commit over many files.

The trio side (`JsonlStore`) encodes each store operation into one frame line and hands a
`Write` to the `Inbox`. The `Committer` thread takes everything pending, appends each run's
lines to its file with one ``write`` per file, then syncs (``fdatasync``) every file that
holds a barrier of the batch, once per file, concurrently on a small thread pool: the
filesystem journal joins concurrent syncs into one commit, which is where the barriers of
concurrent runs share their fsync work (DESIGN §4, §7). The batch goes back to trio with a
single ``run_sync_soon``.

A non-barrier write is appended without a sync; the next barrier of the same run syncs the
same file and so makes it durable first (prefix durability per run).

Each append holds the file's ``flock`` and first compares the file's size with where the
trio side expects the write to land. Bytes found beyond that point are either a torn tail
left by a crash (no complete frame: cut off, durably, before appending) or lines another
writer appended (`ConflictError`, as a second writer of one run sees in the SQLite store).
A write that fails part way is cut back off under the same lock, so no half line is left for
the next append to fuse with.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Protocol

import attrs
import trio

from treadle._exceptions import ConflictError, LogCorrupted, StoreError
from treadle.stores._lines import check_frame, scan_lines

if sys.platform != "win32":
    import fcntl

LINGER_S: Final = 0.02
"""Seconds a queued non-barrier write may wait for a barrier to share its batch."""

SYNC_WORKERS: Final = 8
"""Threads that sync files concurrently when a batch holds barriers of several files."""

MAX_OPEN_FILES: Final = 256
"""Run files kept open at once; the least recently written is synced and closed beyond it."""


class FileOps(Protocol):
    """The file operations the committer uses; `OsFileOps` is the real one.

    A test replaces it to inject faults (a full disk, a failing sync); see
    `treadle.testing.faults.FailingFileOps`. Every method raises `OSError` on failure.
    """

    def open(self, path: str, *, create: bool) -> int:
        """Open ``path`` to read and append (``create``: it must not exist yet); the fd."""
        ...

    def lock(self, fd: int) -> None:
        """Take the file's exclusive lock (blocking), shared with other processes."""
        ...

    def unlock(self, fd: int) -> None:
        """Release the file's lock."""
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


_SYNC: Final = getattr(os, "fdatasync", os.fsync)


@attrs.frozen
class OsFileOps:
    """`FileOps` on the real filesystem (``os`` calls; ``flock`` where there is one)."""

    def open(self, path: str, *, create: bool) -> int:
        """Open to read and append; ``create`` uses ``O_CREAT | O_EXCL``."""
        flags = os.O_RDWR | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        return os.open(path, flags, 0o644)

    def lock(self, fd: int) -> None:
        """``flock(LOCK_EX)`` (no locking on Windows)."""
        if sys.platform != "win32":
            fcntl.flock(fd, fcntl.LOCK_EX)

    def unlock(self, fd: int) -> None:
        """``flock(LOCK_UN)``."""
        if sys.platform != "win32":
            fcntl.flock(fd, fcntl.LOCK_UN)

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


@attrs.define(eq=False)
class Write:
    """One store operation on its way to the committer: whole frame lines of one run.

    Attributes:
        run_id: the run.
        path: its file.
        seq: the seq of the write's first record.
        start: the file offset the write must land at (the end of the run's writes before).
        data: the frame lines, each ending with a newline.
        records: log records in ``data`` (the header line is not one).
        barrier: sync the file before the write is done.
        create: the file did not exist when the run was read.
        closes: the run's last write (run finished): its file is closed after the batch.
        end: set by the committer: the file's size after this write.
    """

    run_id: str
    path: str
    seq: int
    start: int
    data: bytes
    records: int
    barrier: bool
    create: bool = False
    closes: bool = False
    end: int = 0
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


class Inbox:
    """The writes handed to the committer thread (the same protocol as the SQLite store's).

    A queued non-barrier write does not wake the committer for a batch of its own: it
    lingers for up to `LINGER_S` to ride with the next barrier, unless a flush is requested
    (a barrier, a reader waiting for it) or the committer is stopping.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._items: list[Write] = []
        self._flush = False
        self._stop = False
        self._closed = False

    def put(self, write: Write, *, flush: bool) -> None:
        """Queue ``write``; ``flush`` wakes the committer now.

        Raises:
            StoreError: the committer thread has stopped.
        """
        with self._cond:
            if self._closed:
                raise StoreError("the JSONL committer thread has stopped")
            self._items.append(write)
            self._flush = self._flush or flush
            if flush or len(self._items) == 1:
                self._cond.notify()

    def flush(self) -> None:
        """Wake the committer to take what is queued now."""
        with self._cond:
            self._flush = True
            self._cond.notify()

    def stop(self) -> None:
        """Ask the committer to take what is queued, sync everything and stop."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def close(self) -> list[Write]:
        """Refuse further writes; return those never taken."""
        with self._cond:
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
            batch, self._items = self._items, []
            self._flush = False
            return batch, self._stop


@attrs.define(eq=False)
class _File:
    run_id: str
    path: str
    fd: int
    dirty: bool = False


@attrs.define(eq=False)
class Counts:
    """What one batch did (handed back to trio with the batch).

    Attributes:
        syncs: sync calls made (files and the directory).
        synced_files: run files synced.
        cuts: torn tails cut off before an append.
        failures: runs whose earlier, already answered writes turned out not durable (a
            failed sync at eviction or at stop), with the error.
    """

    syncs: int = 0
    synced_files: int = 0
    cuts: int = 0
    failures: list[tuple[str, StoreError]] = attrs.Factory(list)


class Committer:
    """The thread that owns every run file's fd, appends batches and syncs them.

    Args:
        directory: the store directory (synced after a run file is created).
        ops: the file operations.
        token: the trio run to hand finished batches back to.
        deliver: called in the trio thread with each finished batch and its `Counts`.
        stopped: called in the trio thread once the thread has stopped.
    """

    def __init__(
        self,
        directory: str,
        ops: FileOps,
        token: trio.lowlevel.TrioToken,
        deliver: Callable[[list[Write], Counts], None],
        stopped: Callable[[], None],
    ) -> None:
        self.inbox = Inbox()
        self._directory = directory
        self._ops = ops
        self._token = token
        self._deliver = deliver
        self._stopped = stopped
        self._files: collections.OrderedDict[str, _File] = collections.OrderedDict()
        self._failed: dict[str, StoreError] = {}
        self._dir_dirty = False
        self._pool: ThreadPoolExecutor | None = None
        self._thread = threading.Thread(
            target=self._main, name="treadle-jsonl-committer", daemon=True
        )

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    # ------------------------------------------------------------------ the loop

    def _main(self) -> None:
        try:
            self._loop()
        finally:  # also after a bug in the loop: no waiter is left hanging
            leftover = self.inbox.close()
            if leftover:
                self._fail(leftover, RuntimeError("the committer thread stopped"))
                self._call_soon(self._deliver, leftover, Counts())
            for path in list(self._files):
                self._close(path)
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._call_soon(self._stopped)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self.inbox.take()
            try:
                counts = self._commit(batch)
                if stopping:
                    self._sync_everything(counts)
            except BaseException as exc:  # a bug: fail this batch, then stop the thread
                self._fail(batch, exc)
                self._call_soon(self._deliver, batch, Counts())
                raise
            self._call_soon(self._deliver, batch, counts)

    def _call_soon(self, fn: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    # ------------------------------------------------------------------ one batch

    def _commit(self, batch: list[Write]) -> Counts:
        """Append and sync one batch, at most half of `MAX_OPEN_FILES` files at a time."""
        counts = Counts()
        groups: dict[str, list[Write]] = {}
        for write in batch:
            if not self._refused(write):
                groups.setdefault(write.path, []).append(write)
        items = list(groups.items())
        size = max(1, MAX_OPEN_FILES // 2)
        for start in range(0, len(items), size):
            self._commit_files(items[start : start + size], counts)
        return counts

    def _commit_files(self, items: list[tuple[str, list[Write]]], counts: Counts) -> None:
        to_sync: list[tuple[_File, list[Write]]] = []
        for path, writes in items:
            file = self._append(path, writes, counts)
            if file is not None and any(w.barrier for w in writes):
                to_sync.append((file, writes))
        if to_sync:
            self._sync_files(to_sync, counts)
        for path, writes in items:
            if writes[-1].closes and writes[-1].error is None:
                self._close(path)
        while len(self._files) > MAX_OPEN_FILES:
            self._evict(next(iter(self._files)), counts)

    def _append(self, path: str, writes: list[Write], counts: Counts) -> _File | None:
        """Append the writes of one file with one write call; fail them all on an error."""
        first = writes[0]
        try:
            file = self._open(path, first)
        except OSError as exc:
            self._poison(first.run_id, writes, _store_error(path, "cannot open", exc), counts)
            return None
        try:
            self._ops.lock(file.fd)
            try:
                self._append_locked(file, writes, counts)
            finally:
                self._ops.unlock(file.fd)
        except (ConflictError, LogCorrupted) as exc:
            self._poison(first.run_id, writes, exc, counts)
            return None
        except OSError as exc:
            self._poison(first.run_id, writes, _store_error(path, "cannot append to", exc), counts)
            return None
        return file

    def _append_locked(self, file: _File, writes: list[Write], counts: Counts) -> None:
        start = writes[0].start
        size = self._ops.size(file.fd)
        if size != start:
            self._check_tail(file, writes[0], size)
            counts.cuts += 1
        try:
            self._write_all(file, b"".join(w.data for w in writes))
        except OSError:
            self._undo(file, start)
            raise
        end = start
        for write in writes:
            end += len(write.data)
            write.end = end

    def _check_tail(self, file: _File, first: Write, size: int) -> None:
        """Bytes beyond where ``first`` must land: cut a torn tail, refuse anything else.

        Raises:
            ConflictError: another writer appended whole lines (its seq follows them).
            LogCorrupted: a damaged line is followed by more, or the file shrank.
        """
        start = first.start
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
            seq, line, _ = frames[-1]
            raise ConflictError(first.run_id, expected=_next_seq(seq, line), got=first.seq)
        self._ops.truncate(file.fd, start)  # a torn tail (or a crashed first write's header)
        self._ops.sync(file.fd)

    def _open(self, path: str, first: Write) -> _File:
        file = self._files.get(path)
        if file is not None:
            self._files.move_to_end(path)
            return file
        try:
            fd = self._ops.open(path, create=first.create)
            self._dir_dirty = self._dir_dirty or first.create
        except FileExistsError:  # created meanwhile (by another process): the tail check
            fd = self._ops.open(path, create=False)  # tells a crash remnant from a writer
        file = self._files[path] = _File(run_id=first.run_id, path=path, fd=fd)
        return file

    def _write_all(self, file: _File, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self._ops.write(file.fd, view)
            if written <= 0:
                raise OSError(0, "write made no progress")
            file.dirty = True
            view = view[written:]

    def _undo(self, file: _File, size: int) -> None:
        """After a failed append, cut the partial bytes off (best effort).

        The run is refused from now on; if the cut fails too, a reader treats what remains
        as a torn tail, and the next append (after a reopen) cuts it.
        """
        with contextlib.suppress(OSError):
            self._ops.truncate(file.fd, size)

    def _sync_files(self, to_sync: list[tuple[_File, list[Write]]], counts: Counts) -> None:
        """Sync the directory if a file was created, then every file once, concurrently."""
        if self._dir_dirty:
            try:
                self._ops.sync_dir(self._directory)
            except OSError as exc:
                error = _store_error(self._directory, "cannot sync", exc)
                for file, writes in to_sync:
                    self._poison(file.run_id, writes, error, counts)
                return
            counts.syncs += 1
            self._dir_dirty = False
        errors = self._sync_all([file for file, _ in to_sync])
        counts.syncs += len(to_sync)
        counts.synced_files += len(to_sync)
        for (file, writes), failure in zip(to_sync, errors, strict=True):
            if failure is None:
                file.dirty = False
            else:
                error = _store_error(file.path, "cannot sync", failure)
                self._poison(file.run_id, writes, error, counts)

    def _sync_all(self, files: list[_File]) -> list[OSError | None]:
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

    def _sync_everything(self, counts: Counts) -> None:
        """On stop: make every file written by this committer durable, then close it."""
        dirty: list[tuple[_File, list[Write]]] = [
            (file, []) for file in self._files.values() if file.dirty
        ]
        if dirty or self._dir_dirty:
            self._sync_files(dirty, counts)
        for path in list(self._files):
            self._close(path)

    def _evict(self, path: str, counts: Counts) -> None:
        file = self._files[path]
        if file.dirty:
            failure = self._sync_one(file)
            if failure is not None:
                error = _store_error(path, "cannot sync", failure)
                self._poison(file.run_id, [], error, counts)
        self._close(path)

    def _close(self, path: str) -> None:
        file = self._files.pop(path, None)
        if file is not None:
            with contextlib.suppress(OSError):
                self._ops.close(file.fd)

    # ------------------------------------------------------------------ failures

    def _refused(self, write: Write) -> bool:
        earlier = self._failed.get(write.run_id)
        if earlier is not None and write.error is None:
            write.error = refusal(write.run_id, earlier)
        return earlier is not None

    def _poison(self, run_id: str, writes: list[Write], error: StoreError, counts: Counts) -> None:
        """Fail ``writes`` and refuse every later write of ``run_id``."""
        first = run_id not in self._failed
        self._fail(writes, error)
        self._failed.setdefault(run_id, error)
        if first:
            counts.failures.append((run_id, error))

    def _fail(self, writes: list[Write], exc: BaseException) -> None:
        if isinstance(exc, StoreError):
            err = exc
        else:
            err = StoreError(f"the JSONL committer failed: {exc!r}")
            err.__cause__ = exc
        for write in writes:
            if write.error is None:
                write.error = err
            self._failed.setdefault(write.run_id, write.error)


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
