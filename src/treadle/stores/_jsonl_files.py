"""The files of the JSONL store: names, frames, reading and checking them.

Blocking functions: the store (`treadle.stores.jsonl`) calls them in worker threads. The
format is described in docs/decisions/0004-jsonl-format.md (frames) and
docs/decisions/0085-compact-log-records.md (the records in them)::

    <directory>/<name>.jsonl              a run's log: a header frame, then record frames
    <directory>/.control/<name>.jsonl     the run's control stream: one frame per entry
    <directory>/.leases/<name>.lock       held with flock(LOCK_EX) by the lease holder
    <directory>/.leases/<name>.lease      the lease sidecar: owner, generation, heartbeat
    <directory>/.repairs/                 what `treadle repair` removed, with a note

``<name>`` is the run id, percent-encoded (`run_file_name`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat as stat_module
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote

import attrs
import msgspec

from treadle._exceptions import (
    LogCorrupted,
    RepairRefused,
    SchemaTooNew,
    StoreError,
    TreadleError,
)
from treadle._paths import is_directory, stat_or_none
from treadle._state import fold
from treadle.stores._codec import check_schema, pack, record_from_dict, record_to_json, unpack
from treadle.stores._lines import FrameError, TornSpan, check_frame, frame, scan_lines
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    CancelRequested,
    ControlEntry,
    Lease,
    Record,
    RunFinished,
)

if sys.platform != "win32":
    import fcntl

FORMAT: Final = "treadle.jsonl"
"""The ``format`` of a run file's header."""

FORMAT_VERSION: Final = 4
"""The frame format version written in every new header; a newer file is refused.

2: record frames carry the writer's lease generation (``gen``); control streams and leases
live in ``.control/`` and ``.leases/`` (version 1 kept a control log as a pseudo-run).
3: record frames hold their records in the compact encoding (``["mi",1,1,...]``,
docs/decisions/0085-compact-log-records.md). A file keeps the encoding its header names: one
begun in version 2 (or 1) is read, and appended to, in the JSON-object encoding.
4: records may hold the fields of record schema 3 (`treadle.types.SCHEMA_VERSION`), which a
version-3 reader cannot decode; the encoding is version 3's. Raised whenever the records' wire
shape changes (docs/crash-safety.md, "Versions")."""

COMPACT_FROM: Final = 3
"""The first format version whose record frames are compact-encoded."""

MAX_NAME_CHARS: Final = 200
"""Longest encoded run id kept in a file name; longer ones are named by their SHA-256."""

CONTROL_DIR: Final = ".control"
LEASE_DIR: Final = ".leases"
REPAIR_DIR: Final = ".repairs"

_SAFE: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_NAME: Final = re.compile(r"([^/.][^/]*)\.jsonl")
_CHUNK: Final = 65_536
_V1_CONTROL_SUFFIX: Final = "#control"


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


HASHED_NAME: Final = re.compile(r"~[0-9a-f]{64}")
"""A hashed file stem, ``~<sha256>``: no run id has it (an id starts with a letter or digit)."""


def run_file_name(run_id: str) -> str:
    """The name of a run's file: its encoded id, or ``~`` and the SHA-256 of the id.

    A hashed stem itself (`HASHED_NAME`, the name a run whose header is damaged is listed
    under) names its own file.
    """
    if HASHED_NAME.fullmatch(run_id):
        return f"{run_id}.jsonl"
    encoded = encode_run_id(run_id)
    if not encoded or encoded.startswith(".") or len(encoded) > MAX_NAME_CHARS:
        digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()
        encoded = f"~{digest}"
    return f"{encoded}.jsonl"


def id_from_name(name: str) -> str:
    """The run id a file name stands for (for a file whose header cannot be read).

    A hashed name (``~<sha256>``) cannot be turned back: the name itself stands for it.
    """
    stem = name[: -len(".jsonl")]
    return stem if stem.startswith("~") else unquote(stem, errors="surrogateescape")


# --------------------------------------------------------------------------- frames


def header_frame(run_id: str, *, created_ns: int) -> bytes:
    """The header line of a run file (newline included).

    ``created_ns`` (UTC wall clock, nanoseconds) orders `JsonlStore.list_runs`.
    """
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "run_id": run_id,
        "created_ns": created_ns,
    }
    return frame(0, "header", json.dumps(header, ensure_ascii=False, separators=(",", ":")))


def records_frame(
    seq: int,
    records: Sequence[Record],
    *,
    generation: int,
    run_id: str,
    version: int = FORMAT_VERSION,
) -> bytes:
    """The line of one store operation (newline included), for a file of format ``version``.

    Compact-encoded records from version 3 on; JSON objects (with their ``kind``) before.

    Raises:
        UnicodeEncodeError: a text cannot be written as UTF-8.
        TypeError, ValueError: a record cannot be written as JSON, or is of another run.
    """
    if version >= COMPACT_FROM:
        parts = [b"["]
        for index, record in enumerate(records):
            if index:
                parts.append(b",")
            parts.append(pack(record, run_id))
        parts.append(b"]")
        return frame(seq, "records", parts, generation=generation)  # one copy of each record
    for record in records:
        if record.run_id != run_id:
            raise ValueError(f"a record of run {record.run_id!r} in the file of run {run_id!r}")
    text = "[" + ",".join(record_to_json(written_in(r, version)) for r in records) + "]"
    return frame(seq, "records", text, generation=generation)


def control_frame(
    position: int, record: CancelRequested | ApprovalDecided, *, version: int = FORMAT_VERSION
) -> bytes:
    """The line of one control-stream entry (newline included).

    ``version`` is the format of the run's file: the entry is written as that format's
    treadle reads it (`written_in`).
    """
    return frame(position, "control", record_to_json(written_in(record, version)))


def written_in(record: Record, version: int) -> Record:
    """``record`` as a file of format ``version`` (and its control stream) holds it.

    A file begun before format 3 holds JSON objects, and the treadle that began it refuses
    an object with a field it does not know. A decision's ``tool``, which no treadle of
    those formats wrote, is left out there: the decision answers its request by step, call
    id and digest, and one read back without a tool has its edited arguments redacted by
    every tool's secrets (`treadle.redaction.Redaction.arguments`). Other fields are written
    as they are (docs/crash-safety.md, "Versions").
    """
    if version < COMPACT_FROM and isinstance(record, ApprovalDecided) and record.tool:
        return attrs.evolve(record, tool="")
    return record


# --------------------------------------------------------------------------- reading run files


@attrs.frozen(kw_only=True)
class RunFile:
    """A run file as read back.

    Attributes:
        exists: the file exists.
        run_id: from the header (``None`` while the file holds no intact header).
        created_ns: from the header (0 without one).
        version: the header's format version (0 without one).
        records: every record, in seq order.
        generations: the lease generation of each record's writer (0 for version 1 files).
        next_seq: the seq the next record gets.
        end: bytes of the good prefix.
        torn: the torn tail, if any.
        identity: the file's `file_identity` while it was read, ``None`` when it changed
            meanwhile (or does not exist).
    """

    exists: bool
    run_id: str | None
    created_ns: int
    version: int
    records: tuple[Record, ...]
    generations: tuple[int, ...]
    next_seq: int
    end: int
    torn: TornSpan | None
    identity: tuple[int, ...] | None = None


_MISSING: Final = RunFile(
    exists=False,
    run_id=None,
    created_ns=0,
    version=0,
    records=(),
    generations=(),
    next_seq=1,
    end=0,
    torn=None,
)


def _content(where: str, line: bytes, offset: int) -> dict[str, Any]:
    try:
        data = json.loads(line.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        raise LogCorrupted(f"undecodable frame: {exc}", where=where, offset=offset) from exc
    keys = set(data) if isinstance(data, dict) else set()
    payload = keys - {"seq", "crc", "gen"}
    if {"seq", "crc"} - keys or len(payload) != 1 or not payload & {"header", "records", "control"}:
        raise LogCorrupted(
            "a frame must hold seq, crc and header, records or control", where=where, offset=offset
        )
    return data  # type: ignore[no-any-return]


def read_header(where: str, found: tuple[int, bytes, int]) -> tuple[str, int, int]:
    """``(run_id, created_ns, version)`` from a run file's first frame.

    Raises:
        LogCorrupted: it is not a header.
        SchemaTooNew: the header's version is newer than `FORMAT_VERSION`.
    """
    seq, line, offset = found
    data = _content(where, line, offset)
    header = data.get("header")
    if seq != 0 or not isinstance(header, dict) or header.get("format") != FORMAT:
        raise LogCorrupted(f"the first line is not a {FORMAT} header", where=where, offset=offset)
    version = header.get("version")
    if not isinstance(version, int) or not isinstance(header.get("run_id"), str):
        raise LogCorrupted("the header lacks version or run_id", where=where, offset=offset)
    if version > FORMAT_VERSION:
        raise SchemaTooNew(version, FORMAT_VERSION, what=f"the file format of {where}")
    created = header.get("created_ns", 0)
    return header["run_id"], created if isinstance(created, int) else 0, version


class _RecordFrame(msgspec.Struct, forbid_unknown_fields=True):
    """A record frame of format 3: its records left undecoded (`unpack` decodes each)."""

    seq: int
    crc: str
    gen: int
    records: list[msgspec.Raw]


class _FrameHead(msgspec.Struct):
    """What `read_run_head` needs of a record frame of any format: seq and record count."""

    seq: int
    records: list[msgspec.Raw]


_RECORD_FRAME: Final = msgspec.json.Decoder(_RecordFrame)
_FRAME_HEAD: Final = msgspec.json.Decoder(_FrameHead)


def _read_records(
    where: str, run_id: str, found: tuple[int, bytes, int], expected: int, version: int
) -> tuple[list[Record], int]:
    seq, line, offset = found
    if seq != expected:
        raise LogCorrupted(f"frame seq {seq}, expected {expected}", where=where, offset=offset)
    if version >= COMPACT_FROM:
        return _read_compact(where, run_id, line, offset)
    data = _content(where, line, offset)
    items = data.get("records")
    if not isinstance(items, list) or not items:
        raise LogCorrupted("a frame holds no records", where=where, offset=offset)
    generation = data.get("gen", 0)
    if not isinstance(generation, int):
        raise LogCorrupted("a frame's generation is not a number", where=where, offset=offset)
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
    return records, generation


def _compact_frame(where: str, line: bytes, offset: int) -> tuple[list[Any], int]:
    """A compact record frame's records (undecoded) and generation.

    Raises:
        LogCorrupted: not such a frame.
    """
    items: list[Any]
    try:
        found = _RECORD_FRAME.decode(line)
        items, generation = found.records, found.gen
    except msgspec.DecodeError as exc:  # ValidationError included
        if b"\\u" not in line:
            raise LogCorrupted(f"undecodable frame: {exc}", where=where, offset=offset) from exc
        # an escaped lone surrogate, which msgspec's parser refuses; the standard library's
        # reads it, and each record is handed on as JSON text again
        data = _content(where, line, offset)
        found_items, found_gen = data.get("records"), data.get("gen")
        if not isinstance(found_items, list) or type(found_gen) is not int:
            raise LogCorrupted("not a record frame", where=where, offset=offset) from exc
        items = [json.dumps(x, ensure_ascii=True, separators=(",", ":")) for x in found_items]
        generation = found_gen
    if not items:
        raise LogCorrupted("a frame holds no records", where=where, offset=offset)
    return items, generation


def _read_compact(where: str, run_id: str, line: bytes, offset: int) -> tuple[list[Record], int]:
    items, generation = _compact_frame(where, line, offset)
    records: list[Record] = []
    for item in items:
        try:
            record = unpack(item, run_id)
        except ValueError as exc:  # msgspec's errors included
            raise LogCorrupted(f"undecodable record: {exc}", where=where, offset=offset) from exc
        check_schema(record)
        records.append(record)
    return records, generation


def header_version(path: str) -> int:
    """The format version a run file's header names (blocking; reads its first line only).

    `FORMAT_VERSION` when the file has no intact header (none written yet: its first write
    gives it this one) or cannot be read; what is wrong with it is reported by its reads.

    Raises:
        SchemaTooNew: the header names a format newer than `FORMAT_VERSION`: nothing of this
            treadle's may be written for the file (docs/crash-safety.md, "Versions").
    """
    try:
        head, _ = _first_line(path)
        return read_header(path, _checked(path, head.rstrip(b"\n"), 0))[2]
    except SchemaTooNew:
        raise
    except (OSError, TreadleError):
        return FORMAT_VERSION


def _first_line(path: str) -> tuple[bytes, int]:
    """A run file's first line (at most `_CHUNK` bytes) and its modification time (ns).

    Blocking; a FIFO in the store's folder never blocks it (`open_regular`).

    Raises:
        OSError: the file cannot be opened or read.
    """
    with open(open_regular(path), "rb") as file:
        return file.readline(_CHUNK), os.fstat(file.fileno()).st_mtime_ns


def read_bytes(path: str) -> bytes | None:
    """A file's bytes, or ``None`` when it does not exist.

    Raises:
        StoreError: it cannot be read.
    """
    return _read_identified(path)[0]


def file_identity(stat: os.stat_result) -> tuple[int, ...]:
    """Device, inode, size and modification time (ns): another write changes one of them."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


FileId = tuple[int, int]
"""A file's identity: ``(st_dev, st_ino)``; unique among the files that exist or are open."""


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` names the file ``fd`` holds open: device and inode compared.

    ``False`` when nothing is at ``path`` (it was deleted, or renamed away).

    Raises:
        StoreError: ``path`` cannot be looked at (its folder made unreadable, say).
    """
    return names_file(path, file_id(fd))


def file_id(fd: int) -> FileId:
    """The identity of the file ``fd`` holds open (``fd`` must be open: its owner's call)."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def names_file(path: str, file: FileId) -> bool:
    """Whether ``path`` names the file of identity ``file`` (taken with `file_id`).

    Needs no descriptor, so a thread that does not own one can ask it; the answer holds
    while a descriptor of ``file`` stays open (an inode is not reused before). ``False``
    when nothing is at ``path``.

    Raises:
        StoreError: ``path`` cannot be looked at (its folder made unreadable, say).
    """
    named = stat_or_none(path)
    return named is not None and (named.st_dev, named.st_ino) == file


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """``os.open`` of a store file that must be a regular file (a run or control file).

    Opened without blocking, so that a FIFO put in a run file's place does not hang the
    reader; anything but a regular file (a directory, a FIFO, a device) is refused.

    Raises:
        OSError: it cannot be opened, or is not a regular file (``strerror`` says so).
    """
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        regular = stat_module.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def _read_identified(path: str) -> tuple[bytes | None, tuple[int, ...] | None]:
    """A file's bytes and its identity while they were read (``None``: it changed meanwhile).

    ``(None, None)`` when nothing is at ``path``.

    Raises:
        StoreError: it cannot be read (a symbolic link to nothing included).
    """
    try:
        with open(open_regular(path), "rb") as file:
            before = file_identity(os.fstat(file.fileno()))
            data = file.read()
            after = file_identity(os.fstat(file.fileno()))
    except FileNotFoundError as exc:
        dangling = _dangling_link(path)
        if dangling is None:
            return None, None
        raise dangling from exc
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return data, before if before == after and after[2] == len(data) else None


def _dangling_link(path: str) -> StoreError | None:
    """The error of a symbolic link at ``path`` to nothing; ``None`` when no link is there.

    Opening such a link fails as a missing file does, but the run file is listed: read as
    missing, the run vanished from `treadle runs` without a word, where a link loop is
    listed as unreadable (docs/crash-safety.md, "What the JSONL store detects").
    """
    try:
        target = os.readlink(path)
    except OSError:  # nothing there (removed meanwhile), or no link: missing as it was
        return None
    return StoreError(
        f"cannot read {path}: it is a symbolic link to {target}, which does not exist"
    )


def read_run_file(path: str) -> RunFile:
    """Read and check a run file (blocking; call it in a worker thread).

    Returns:
        The records and where the good prefix ends; a missing file reads as empty.

    Raises:
        LogCorrupted: a damaged line (not a torn tail), a bad header, a seq gap, a record
            that does not decode or belongs to another run (``offset``: the line's byte).
        SchemaTooNew: the header or the run-started record is from a newer version.
        StoreError: the file cannot be read.
    """
    data, identity = _read_identified(path)
    if data is None:
        return _MISSING
    return _parsed(path, data, identity)


def _parsed(path: str, data: bytes, identity: tuple[int, ...] | None) -> RunFile:
    """`read_run_file` of the bytes ``data`` read from ``path`` (raises as it does)."""
    scanned = scan_lines(data, check_frame, where=path)
    if not scanned.items:
        return attrs.evolve(
            _MISSING, exists=True, end=scanned.end, torn=scanned.torn, identity=identity
        )
    run_id, created_ns, version = read_header(path, scanned.items[0])
    records: list[Record] = []
    generations: list[int] = []
    for found in scanned.items[1:]:
        more, generation = _read_records(path, run_id, found, len(records) + 1, version)
        records.extend(more)
        generations.extend([generation] * len(more))
    return RunFile(
        exists=True,
        run_id=run_id,
        created_ns=created_ns,
        version=version,
        records=tuple(records),
        generations=tuple(generations),
        next_seq=len(records) + 1,
        end=scanned.end,
        torn=scanned.torn,
        identity=identity,
    )


@attrs.frozen(kw_only=True)
class RunHead:
    """Where a run file stands, read without decoding its records (`read_run_head`).

    Attributes:
        exists: the file exists.
        run_id: from the header (``None`` while the file holds no intact header).
        version: the header's format version; `FORMAT_VERSION` without a header (the
            version the first write gives the file).
        next_seq: the seq the next record gets.
        end: bytes of the good prefix.
    """

    exists: bool
    run_id: str | None
    version: int
    next_seq: int
    end: int


def head_of(found: RunFile) -> RunHead:
    """The `RunHead` of a file `read_run_file` read."""
    version = found.version if found.run_id is not None else FORMAT_VERSION
    return RunHead(
        exists=found.exists,
        run_id=found.run_id,
        version=version,
        next_seq=found.next_seq,
        end=found.end,
    )


def read_run_head(path: str) -> RunHead:
    """The next seq and good prefix of a run file (blocking), its records left undecoded.

    Every line's checksum, the header and the seqs are checked as `read_run_file` checks
    them; what the records hold is not (`read_run_file` decodes them).

    Raises:
        LogCorrupted: a damaged line (not a torn tail), a bad header, a seq gap.
        SchemaTooNew: the header is from a newer format version.
        StoreError: the file cannot be read.
    """
    data = read_bytes(path)
    if data is None:
        return RunHead(exists=False, run_id=None, version=FORMAT_VERSION, next_seq=1, end=0)
    scanned = scan_lines(data, check_frame, where=path)
    if not scanned.items:
        return RunHead(
            exists=True, run_id=None, version=FORMAT_VERSION, next_seq=1, end=scanned.end
        )
    run_id, _, version = read_header(path, scanned.items[0])
    next_seq = 1
    for seq, line, offset in scanned.items[1:]:
        if seq != next_seq:
            raise LogCorrupted(f"frame seq {seq}, expected {next_seq}", where=path, offset=offset)
        try:
            count = len(_FRAME_HEAD.decode(line).records)
        except msgspec.DecodeError as exc:
            if b"\\u" not in line:  # else an escaped lone surrogate: see _compact_frame
                raise LogCorrupted(f"undecodable frame: {exc}", where=path, offset=offset) from exc
            items = _content(path, line, offset).get("records")
            count = len(items) if isinstance(items, list) else 0
        if not count:
            raise LogCorrupted("a frame holds no records", where=path, offset=offset)
        next_seq += count
    return RunHead(exists=True, run_id=run_id, version=version, next_seq=next_seq, end=scanned.end)


@attrs.frozen(kw_only=True)
class Probe:
    """What listing learns of a run file without reading all of it.

    Attributes:
        name: the file name.
        run_id: from the header, or from the file name when the header cannot be read.
        created_ns: from the header; the file's modification time when the header cannot
            be read, 0 when the file cannot be (as `entered_ns` says).
        first: the run-started record, when the first record frame is intact.
        tail: the records of the intact frames in the file's end that was read (its last
            64 KiB, widened until it holds a whole record line), in order.
        records: the seq of the last record, or ``None`` when no record line was intact
            (the file shrank while it was read).
        error: why the file cannot be read, or ``None``.
    """

    name: str
    run_id: str
    created_ns: int
    first: Record | None = None
    tail: tuple[Record, ...] = ()
    records: int | None = None
    error: TreadleError | None = None


def probe_run_file(path: str) -> Probe | None:
    """The header, first record and last records of a run file (``None``: no record yet).

    Reads the first lines and the file's end only: its last 64 KiB (and the byte before
    them, which says whether they start a line), doubled until they hold a whole record
    line (a record of any size, up to the whole file), so the last record is always found
    and a finished run is never taken for a running one. A damaged file is reported in
    ``error`` (reading its log raises the same), never left out.
    """
    name = os.path.basename(path)
    try:
        with open(open_regular(path), "rb") as file:
            return _probe_file(path, name, file)
    except FileNotFoundError:
        error = _dangling_link(path)
        if error is None:
            return None
    except OSError as exc:
        error = StoreError(f"cannot read {path}: {exc.strerror or exc}")
    return Probe(name=name, run_id=id_from_name(name), created_ns=0, error=error)


def _probe_file(path: str, name: str, file: Any) -> Probe | None:
    """`probe_run_file` of an open file: reads its end, widening it while no record line fits.

    The first lines are read and checked once, however often the end is widened: a first
    record line of any size (it holds the run's input) is the one line in the window of a
    run of one record line.

    Raises:
        OSError: the file cannot be read.
    """
    head = _first_lines(file, 2)
    status = os.fstat(file.fileno())
    opening: _Opening | None = None
    window = _CHUNK
    while True:
        # with the byte before the window: a newline there says the window starts a line
        tail_at = max(0, status.st_size - window - 1)
        file.seek(tail_at)
        tail = file.read()
        try:
            if opening is None:
                # NUL bytes are a lost write only when they run to the file's end
                # (`scan_lines`); a file that ends with a newline has none.
                opening = _opening(path, name, head, lost=not tail.endswith(b"\n"))
                if opening is None:
                    return None
            records, next_seq = _tail_records(path, tail, tail_at, opening.run_id, opening.version)
        except TreadleError as exc:
            created = _header_created_ns(path, name, head)
            return Probe(
                name=name,
                run_id=id_from_name(name),
                created_ns=status.st_mtime_ns if created is None else created,
                error=exc,
            )
        if next_seq is not None or not tail_at:
            return Probe(
                name=name,
                run_id=opening.run_id,
                created_ns=opening.created_ns,
                first=opening.first,
                tail=tuple(records),
                records=None if next_seq is None else next_seq - 1,
            )
        window *= 2


def entered_ns(path: str) -> int:
    """When a run file's run entered the store (ns), from its first line only.

    The ``created_ns`` its `Probe` has (`probe_run_file`): the header's, the file's
    modification time when the header cannot be read, 0 when the file cannot be. Cheap
    enough to order a store's every file before probing a few (``treadle runs --last``).
    """
    try:
        head, modified_ns = _first_line(path)
    except OSError:
        return 0
    created = _header_created_ns(path, os.path.basename(path), head)
    return modified_ns if created is None else created


def _header_created_ns(path: str, name: str, head: bytes) -> int | None:
    """The ``created_ns`` of the header line that starts ``head`` (``None``: no such header).

    A header must be intact, of a known version, and name the run of the file's ``name``.
    """
    complete = head.split(b"\n")[:-1]
    if not complete:
        return None
    try:
        run_id, created_ns, _ = read_header(path, _checked(path, complete[0], 0))
    except TreadleError:
        return None
    return created_ns if run_file_name(run_id) == name else None


def _first_lines(file: Any, count: int) -> bytes:
    """The file's next bytes, read `_CHUNK` at a time, until they hold ``count`` newlines.

    All its bytes when it holds fewer. Each chunk's newlines are counted once, so a first
    record line of n bytes (it holds the run's input, of any size) costs O(n) to read, as
    in a full read of the log: counting them in all the bytes read so far, at each chunk,
    cost O(n²).
    """
    chunks: list[bytes] = []
    found = 0
    while found < count:
        chunk = file.read(_CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
        found += chunk.count(b"\n")
    return b"".join(chunks)


@attrs.frozen(kw_only=True)
class _Opening:
    """What a run file's first two lines say.

    Attributes:
        run_id: the header's run id (the file's name names it).
        created_ns: the header's creation time, ns since the epoch.
        version: the header's format version.
        first: the first record of the first record line, the run-started record.
    """

    run_id: str
    created_ns: int
    version: int
    first: Record


def _opening(path: str, name: str, head: bytes, *, lost: bool) -> _Opening | None:
    """What the first two lines in ``head`` say (``None``: no record line reached the file).

    ``lost``: the file does not end with a newline, so a line of NUL bytes may be a torn
    tail (a first write that crashed) rather than damage.

    Raises:
        LogCorrupted: a line is damaged, or the header names another run.
        SchemaTooNew: the file or its run-started record is of a newer version.
    """
    complete = head.split(b"\n")[:-1]  # the lines that end with a newline
    if not complete or (lost and not complete[0].strip(b"\0")):
        return None  # no header line reached the file: a first write that crashed
    run_id, created_ns, version = read_header(path, _checked(path, complete[0], 0))
    if run_file_name(run_id) != name:  # a copy, or a file renamed: reading it says the same
        raise LogCorrupted(f"the header names run {run_id!r}", where=path, offset=0)
    if len(complete) < 2 or (lost and not complete[1].strip(b"\0")):
        return None  # no record line reached the file (a torn first record was never written)
    first_found = _checked(path, complete[1], len(complete[0]) + 1)
    first_records, _ = _read_records(path, run_id, first_found, 1, version)
    return _Opening(run_id=run_id, created_ns=created_ns, version=version, first=first_records[0])


def _checked(path: str, line: bytes, offset: int) -> tuple[int, bytes, int]:
    try:
        return check_frame(line, offset)
    except FrameError as exc:
        raise LogCorrupted(f"a line is damaged: {exc}", where=path, offset=offset) from exc


def _tail_records(
    path: str, tail: bytes, tail_at: int, run_id: str, version: int
) -> tuple[list[Record], int | None]:
    """The records of the record frames in ``tail``, and the seq after the last of them.

    ``tail`` is the file's bytes from ``tail_at`` on; the seq is ``None`` when it holds no
    record frame. Unless ``tail`` starts the file, its bytes up to its first newline are
    skipped: they may be the end of a line, whatever they look like (a ``{"seq":`` there may
    be a value's, which are plain JSON), so a line is kept when ``tail`` starts with the
    newline before it. The rest is judged as the full read judges it
    (`treadle.stores._lines.scan_lines`): a torn tail (an unterminated last line, or NUL
    bytes to the end) is left out, as the full read leaves it out, and any other line must
    be an intact frame whose seq follows the frame before it.

    Raises:
        LogCorrupted: a complete line in ``tail`` is damaged (an empty line or NUL bytes a
            newline ends included), or its seq does not follow (a line lost, repeated or
            moved); ``offset``: where it starts.
    """
    records: list[Record] = []
    start = 0 if tail_at == 0 else tail.find(b"\n") + 1
    scanned = scan_lines(tail[start:], check_frame, where=path, base=tail_at + start)
    expected: int | None = None
    for seq, line, offset in scanned.items:
        if not seq:  # the header
            continue
        if expected is not None and seq != expected:
            raise LogCorrupted(f"frame seq {seq}, expected {expected}", where=path, offset=offset)
        if version >= COMPACT_FROM:
            found = _read_compact(path, run_id, line, offset)[0]
        else:
            try:
                items = json.loads(line).get("records", ())
                found = [record_from_dict(item) for item in items]
            except Exception as exc:  # checksum intact, content not a record frame
                raise LogCorrupted(f"a line is damaged: {exc}", where=path, offset=offset) from exc
        records.extend(found)
        expected = seq + len(found)
    return records, expected


def list_run_files(directory: str) -> list[str]:
    """The names of the run files of ``directory`` (no control, lease or repair files).

    Every entry named as a run file is listed, whatever it is: one that is not a regular file
    (a directory, a FIFO, a symbolic link that leads nowhere) is a damaged run, reported when
    it is read, never left out nor allowed to stop the listing.
    """
    return [entry.name for entry in os.scandir(directory) if _NAME.fullmatch(entry.name)]


# --------------------------------------------------------------------------- control streams


def read_control_file(path: str, run_id: str) -> tuple[ControlEntry, ...]:
    """A run's control entries (blocking); a torn last line is left out.

    Raises:
        LogCorrupted: a damaged line, a position out of order, an entry of another run.
        StoreError: the file cannot be read.
    """
    data = read_bytes(path)
    return scan_control(data, path, run_id)[0] if data else ()


def scan_control(data: bytes, path: str, run_id: str) -> tuple[tuple[ControlEntry, ...], int]:
    """The control entries in ``data`` (a control file's bytes) and where the good ones end.

    Raises:
        LogCorrupted: as `read_control_file`.
    """
    scanned = scan_lines(data, check_frame, where=path)
    entries = []
    for position, (seq, line, offset) in enumerate(scanned.items, start=1):
        if seq != position:
            raise LogCorrupted(
                f"control entry {seq}, expected {position}", where=path, offset=offset
            )
        item = _content(path, line, offset).get("control")
        try:
            record = record_from_dict(item) if isinstance(item, dict) else None
        except Exception as exc:
            raise LogCorrupted(
                f"undecodable control entry: {exc}", where=path, offset=offset
            ) from exc
        if not isinstance(record, CancelRequested | ApprovalDecided) or record.run_id != run_id:
            raise LogCorrupted(f"not a control entry of run {run_id!r}", where=path, offset=offset)
        entries.append(ControlEntry(run_id=run_id, position=position, record=record))
    return tuple(entries), scanned.end


# --------------------------------------------------------------------------- lease sidecars


def read_sidecar(path: str, run_id: str) -> tuple[Lease | None, int]:
    """The lease a sidecar records, and the control position its last holder handled.

    A missing sidecar is no lease; an unreadable one is reported as a lease of an unknown
    holder (generation 0), so that nobody takes it for a free run by mistake.
    """
    data = read_bytes(path)
    if data is None:
        return None, 0
    try:
        item = json.loads(data)
        lease = Lease(
            run_id=run_id,
            owner=str(item["owner"]),
            generation=int(item["generation"]),
            expires_at=float(item["expires_at"]),
            heartbeat_at=float(item["heartbeat_at"]),
        )
        return lease, int(item.get("control_seen", 0))
    except (ValueError, KeyError, TypeError):
        return Lease(
            run_id=run_id, owner="unknown", generation=0, expires_at=0.0, heartbeat_at=0.0
        ), 0


def write_sidecar(path: str, lease: Lease, control_seen: int, *, durable: bool) -> None:
    """Replace the sidecar atomically (write, rename); ``durable`` syncs file and directory.

    Raises:
        OSError: it cannot be written.
    """
    data = json.dumps(
        {
            "owner": lease.owner,
            "generation": lease.generation,
            "expires_at": lease.expires_at,
            "heartbeat_at": lease.heartbeat_at,
            "control_seen": control_seen,
        }
    ).encode()
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "the lease file was written in part")
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):  # no half-written file left beside the lease
            os.unlink(temporary)
        raise
    if durable:
        sync_dir(os.path.dirname(path))


def sync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (``fsync`` on the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the directory


def open_directory(directory: str) -> None:
    """Make sure the store directory and its sub-directories exist (creating them).

    Raises:
        StoreError: the path is a file, its parent is missing, or it cannot be created.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise StoreError(f"cannot open JSONL store {directory}: not a directory")
    if not path.parent.exists():
        raise StoreError(
            f"cannot open JSONL store {directory}: the folder {path.parent} does not exist"
        )
    if not path.parent.is_dir():
        raise StoreError(f"cannot open JSONL store {directory}: {path.parent} is not a directory")
    try:
        for sub in (path, path / CONTROL_DIR, path / LEASE_DIR):
            if not sub.is_dir():
                try:
                    sub.mkdir()
                except FileExistsError:
                    continue
                sync_dir(str(sub.parent))
    except OSError as exc:
        raise StoreError(f"cannot open JSONL store {directory}: {exc.strerror or exc}") from exc


def holds_a_store(directory: str) -> bool:
    """Whether ``directory`` holds a JSONL store (blocking; reads at most a few lines).

    A store once opened has its ``.leases`` and ``.control`` sub-directories; one written
    by an older treadle is known by a run file whose first line is a treadle header. A
    command that only reads uses this to refuse any other folder instead of creating those
    sub-directories in it and listing its own files as damaged runs.

    Raises:
        StoreError: the folder cannot be looked at (its permissions, say).
    """
    path = Path(directory)
    if not is_directory(path):
        return False
    if is_directory(path / LEASE_DIR) or is_directory(path / CONTROL_DIR):
        return True
    for name in list_run_files(directory)[:8]:
        try:
            with open(open_regular(str(path / name)), "rb") as file:  # a FIFO never blocks
                first = file.readline(4096).rstrip(b"\n")
            read_header(name, _checked(name, first, 0))
        except (OSError, TreadleError):
            continue
        return True
    return False


def v1_control_run(name: str | None) -> str | None:
    """The run whose version-1 control pseudo-run ``name`` (``<run_id>#control``) names.

    ``None`` when ``name`` is no such name. The run id is not checked: no run id has a ``#``
    (docs/concepts.md, "Run ids"), so only a version-1 treadle wrote such a name.
    """
    if name is None or not name.endswith(_V1_CONTROL_SUFFIX):
        return None
    return name[: -len(_V1_CONTROL_SUFFIX)]


def v1_control_name(run_id: str) -> str:
    """The name of run ``run_id``'s version-1 control pseudo-run: ``<run_id>#control``."""
    return f"{run_id}{_V1_CONTROL_SUFFIX}"


def migrate_v1_control(directory: str) -> int:
    """Turn version-1 control pseudo-runs (``<run_id>#control``) into control streams.

    Each is moved by `move_v1_control`; one that cannot be (damaged) stays where it is and
    never stops the others, nor the store's opening. Returns how many were moved.

    Raises:
        OSError: a control stream cannot be written, or a moved pseudo-run removed.
    """
    moved = 0
    for name in list_run_files(directory):
        if name.endswith("%23control.jsonl") and move_v1_control(directory, name):
            moved += 1
    return moved


def move_v1_control(directory: str, name: str) -> bool:
    """Move the version-1 control pseudo-run in file ``name`` into its run's control stream.

    Blocking. Its cancel and decision records are appended, in order, to the control stream of
    its run, under the stream's ``flock`` (as `treadle.stores.jsonl.JsonlStore.append_control`
    appends), then the pseudo-run file is removed. A move cut short between the two (a crash)
    left the stream ending with those very entries: they are not appended again.

    A pseudo-run that cannot be read (damaged, or of a newer format), or whose run's control
    stream cannot (damaged), stays where it is, and a damaged run blocks no other
    (docs/crash-safety.md, "Torn tails and damage"): listing shows it as an unreadable run
    under its name, ``<run_id>#control``, which `treadle repair` takes
    (docs/decisions/0122-a-control-stream-is-repaired-with-its-run.md); the run's stream,
    once repaired, takes the entries at the next move (the run's repair makes it).

    Returns:
        Whether it was moved.

    Raises:
        OSError: the control stream cannot be written, or the pseudo-run removed.
    """
    path = os.path.join(directory, name)
    if not os.path.isfile(path):  # not a run file at all: listed as unreadable, not moved
        return False
    try:
        found = read_run_file(path)
    except TreadleError:  # listed as an unreadable run, repaired by its name
        return False
    run_id = v1_control_run(found.run_id)
    if run_id is None:
        return False
    controls = [
        attrs.evolve(r, run_id=run_id)
        for r in found.records
        if isinstance(r, CancelRequested | ApprovalDecided)
    ]
    target = os.path.join(directory, CONTROL_DIR, run_file_name(run_id))
    if not _appended_once(target, run_id, controls):
        return False
    with contextlib.suppress(FileNotFoundError):  # another process moved it meanwhile
        os.unlink(path)
    sync_dir(os.path.join(directory, CONTROL_DIR))
    sync_dir(directory)
    return True


def _appended_once(
    path: str, run_id: str, controls: Sequence[CancelRequested | ApprovalDecided]
) -> bool:
    """Append ``controls`` to control stream ``path`` of ``run_id``, unless it ends with them.

    Under the stream's ``flock``; a torn entry of an appender that died is cut first. Returns
    ``False`` (nothing written) when the stream is damaged.

    Raises:
        OSError: the stream cannot be written.
    """
    fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        try:
            entries, good = scan_control(os.pread(fd, size, 0), path, run_id)
        except TreadleError:  # its run's error (listing shows it) until repaired
            return False
        if [entry.record for entry in entries[len(entries) - len(controls) :]] == controls:
            return True  # a move that stopped before removing the pseudo-run wrote them
        if size != good:
            os.ftruncate(fd, good)
        lines = b"".join(
            control_frame(position, record)
            for position, record in enumerate(controls, start=len(entries) + 1)
        )
        if os.write(fd, lines) != len(lines):
            raise OSError(errno.ENOSPC, "the control entries were written in part", path)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


@attrs.frozen(kw_only=True)
class Repair:
    """What `repair_run_file` removed from a run file.

    Attributes:
        path: the run file.
        offset: where the cut starts (the damaged line's first byte).
        removed: bytes removed.
        saved: the file in ``.repairs/`` holding the removed bytes.
        note: the JSON note written beside it.
        reason: the damage found.
        readable_removed: records the cut removed that could still be read (the damaged
            line's own included, when it decodes); of a control stream, its entries.
    """

    path: str
    offset: int
    removed: int
    saved: str
    note: str
    reason: str
    readable_removed: int = 0


def repair_run_file(directory: str, name: str, *, force: bool = False) -> Repair | None:
    """Cut a run file at its first damaged line, keeping what was removed (blocking).

    The removed bytes go to ``.repairs/<name>.<ns>.removed`` with a JSON note beside them
    (offset, length, SHA-256, the damage); the file is cut and synced. The caller must hold
    the run's lease (nobody writes meanwhile).

    The lines after the damaged one are removed too. Unless ``force``, a cut is refused
    (docs/crash-safety.md, "Torn tails and damage") when what it removes, the damaged line
    included, still reads as an action intent or result (a call that may have run, which a
    resume would run again) or the run-finished record (a resume would reopen the run), unless
    the kept part holds an equal record already (a line written twice); when
    the damaged line is unreadable and follows a model reply whose calls have no intent yet
    (it may have held one); and when the first line is no treadle header (the cut would
    empty what may be another program's file; the refusal names the calls its lines still
    show, as above). A version-1 control pseudo-run (``<run_id>#control``) holds a control
    stream's entries: its cut is refused as `repair_control_file` refuses one.

    Returns:
        What was removed, or ``None`` when the file reads without damage.

    Raises:
        RepairRefused: one of the cuts above, ``force`` being false; nothing was changed.
        StoreError: the file cannot be read or written.
    """
    path = os.path.join(directory, name)
    data = read_bytes(path) or b""
    damage = _first_damage(lambda: _parsed(path, data, None))
    if damage is None:
        return None
    offset = min(damage.offset or 0, len(data))
    if offset == 0:
        lost = _readable_without_header(name, data)
        if not force:
            _refuse_emptying(path, damage, lost)
    else:
        kept = _parsed(path, data[:offset], None)  # the lines before the first damaged one
        lost = _readable(data[offset:], kept)
        if not force:
            _refuse_cut(path, kept, lost)
    return _cut(directory, name, data, damage, lost)


def _first_damage(scan: Callable[[], object]) -> LogCorrupted | None:
    """What ``scan`` (a whole read of a file's bytes) found damaged, ``None`` when nothing."""
    try:
        scan()
    except LogCorrupted as exc:
        return exc
    return None


def _cut(
    directory: str, relative: str, data: bytes, damage: LogCorrupted, lost: Sequence[object]
) -> Repair:
    """Cut the file ``relative`` (of ``directory``, holding ``data``) where ``damage`` is.

    What the cut removes is kept first (`_cut_keeping`); ``lost`` is what of it still read.

    Raises:
        StoreError: the removed part cannot be kept (a full disk), or the file not cut.
    """
    path = os.path.join(directory, relative)
    offset = min(damage.offset or 0, len(data))
    try:
        saved, note = _cut_keeping(directory, relative, offset, data[offset:], damage)
    except OSError as exc:  # a full disk, say: the file is cut only after all is kept
        raise StoreError(f"cannot repair {path}: {exc.strerror or exc}") from exc
    return Repair(
        path=path,
        offset=offset,
        removed=len(data) - offset,
        saved=saved,
        note=note,
        reason=str(damage),
        readable_removed=len(lost),
    )


def _refuse_cut(path: str, kept: RunFile, lost: Sequence[Record]) -> None:
    """Raise `RepairRefused` for a cut that keeps ``kept`` and loses the records ``lost``.

    A run log's cut loses no call that may have run, nor the run's end (`_refuse_losing_facts`,
    `_refuse_cutting_after_calls`); a version-1 control pseudo-run's, no cancel or decision
    (`_refuse_losing_entries`).
    """
    if v1_control_run(kept.run_id) is not None:
        controls = [r for r in lost if isinstance(r, CancelRequested | ApprovalDecided)]
        _refuse_losing_entries(path, controls)
        return
    _refuse_losing_facts(path, lost)
    _refuse_cutting_after_calls(path, kept.records)


def repair_control_file(
    directory: str, name: str, run_id: str, *, force: bool = False
) -> Repair | None:
    """Cut run ``run_id``'s control stream at its first damaged line, keeping what is removed.

    Blocking. ``.control/<name>`` is cut as `repair_run_file` cuts a run file, what it loses
    kept in ``.repairs/.control/``. The caller holds the run's lease and the stream's
    ``flock`` (no entry is appended meanwhile).

    The lines after the damaged one are removed too. Unless ``force``, a cut is refused when
    what it removes, the damaged line included, still reads as a cancel or a decision of the
    run that the kept entries do not hold: the run's next driver would never see it
    (docs/crash-safety.md, "Torn tails and damage").

    Returns:
        What was removed, or ``None`` when the stream reads without damage (or is missing).

    Raises:
        RepairRefused: such a cut, ``force`` being false; nothing was changed.
        StoreError: the stream cannot be read or written.
    """
    relative = os.path.join(CONTROL_DIR, name)
    path = os.path.join(directory, relative)
    data = read_bytes(path) or b""
    damage = _first_damage(lambda: scan_control(data, path, run_id))
    if damage is None:
        return None
    offset = min(damage.offset or 0, len(data))
    kept, _ = scan_control(data[:offset], path, run_id)  # the lines before the damaged one
    lost = _entries_readable(data[offset:], run_id, kept)
    if not force:
        _refuse_losing_entries(path, lost)
    return _cut(directory, relative, data, damage, lost)


def _entries_readable(
    lines: bytes, run_id: str, kept: Sequence[ControlEntry]
) -> list[CancelRequested | ApprovalDecided]:
    """The cancels and decisions of run ``run_id`` readable in ``lines``, not in ``kept``.

    As `_readable` reads a run file's lines: a damaged line may still hold its entry, read
    whatever its frame's other keys hold; an entry equal to a kept one (a line written
    twice) is no instruction the cut removes.
    """
    held = [entry.record for entry in kept]
    found: list[CancelRequested | ApprovalDecided] = []
    for line in lines.split(b"\n"):
        try:
            data = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError included
            continue
        values = data.values() if isinstance(data, dict) else ()
        for item in (value for value in values if isinstance(value, dict)):
            try:
                record = record_from_dict(item)
            except Exception:  # not an entry: nothing the cut removes can be named
                continue
            if (
                isinstance(record, CancelRequested | ApprovalDecided)
                and record.run_id == run_id
                and record not in held
            ):
                found.append(record)
    return found


def _refuse_losing_entries(path: str, lost: Sequence[CancelRequested | ApprovalDecided]) -> None:
    """Raise `RepairRefused` naming the control entries ``lost`` a cut removes, if any."""
    if not lost:
        return
    named = ", ".join(_entry_named(record) for record in lost[:5])
    more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
    raise RepairRefused(
        where=path,
        message=f"{path}: the cut would remove {len(lost)} readable control entr"
        f"{'y' if len(lost) == 1 else 'ies'} from the damaged line on, which the run's next "
        f"driver would never see: {named}{more}. Nothing was changed. Cut anyway with force "
        "(treadle repair --force), then write again those that still stand (treadle cancel, "
        "treadle approve)",
    )


def _entry_named(record: CancelRequested | ApprovalDecided) -> str:
    """A control entry in a few words: a cancel's reason and canceller, a decision's call."""
    if isinstance(record, CancelRequested):
        return f"a cancel (reason {record.reason!r}, by {record.canceller or 'no one named'})"
    call = f"{record.tool or 'a call'} (call {record.call_id}, step {record.step})"
    return f"a decision ({record.decision}) on {call}"


def _keep_removed(
    directory: str, name: str, offset: int, removed: bytes, damage: LogCorrupted
) -> tuple[str, str]:
    """Save what a repair removes and its note in ``.repairs/``, synced; their paths.

    ``name`` is the repaired file's path in the store's folder: a run file's name, or
    ``.control/<name>`` for a control stream, kept in ``.repairs/.control/``.

    Raises:
        OSError: they cannot be written.
    """
    stamp = time.time_ns()
    repairs = os.path.join(directory, REPAIR_DIR)
    saved = os.path.join(repairs, f"{name}.{stamp}.removed")
    note = os.path.join(repairs, f"{name}.{stamp}.json")
    folder = os.path.dirname(saved)
    os.makedirs(folder, exist_ok=True)
    with open(saved, "wb") as file:
        file.write(removed)
        file.flush()
        os.fsync(file.fileno())
    description = {
        "file": os.path.join(directory, name),
        "offset": offset,
        "removed_bytes": len(removed),
        "sha256": hashlib.sha256(removed).hexdigest(),
        "damage": str(damage),
        "repaired_at_ns": stamp,
    }
    with open(note, "w", encoding="utf-8") as file:
        json.dump(description, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    sync_dir(folder)
    if folder != repairs:
        sync_dir(repairs)
    return saved, note


def _cut_keeping(
    directory: str, name: str, offset: int, removed: bytes, damage: LogCorrupted
) -> tuple[str, str]:
    """Cut file ``name`` to ``offset`` bytes, synced, once what it loses is kept; their paths.

    ``name``: as `_keep_removed` takes it. The file is opened for writing first, so that one
    that cannot be written (read-only, say) is refused before anything is kept; a cut that
    fails after all leaves no note of it.

    Raises:
        OSError: the file cannot be cut, or what it loses cannot be kept; nothing changed.
    """
    fd = os.open(os.path.join(directory, name), os.O_RDWR)
    try:
        saved, note = _keep_removed(directory, name, offset, removed, damage)
        try:
            os.ftruncate(fd, offset)
            os.fsync(fd)
        except OSError:
            for kept in (saved, note):  # they describe a cut never made
                with contextlib.suppress(OSError):
                    os.unlink(kept)
            raise
    finally:
        os.close(fd)
    return saved, note


def _readable(lines: bytes, kept: RunFile) -> list[Record]:
    """The records readable in ``lines`` (from the damaged line on) and not in ``kept``.

    A line flagged as damaged may be intact (a line out of its place, or written twice) or
    readable despite a wrong checksum or a damaged frame key: what it holds counts, as it
    may be an acknowledged intent. So neither the checksum nor the frame's other keys are
    required here, only records that decode (as the run ``kept``'s header says); anything
    else is left out. A record equal to one the kept part holds (a line written twice) is
    no fact the cut removes.
    """
    assert kept.run_id is not None
    held = _by_key(kept.records)
    found: list[Record] = []
    for line in lines.split(b"\n"):
        for record in _records_in(line, kept.run_id, kept.version):
            if record not in held.get(_key(record), ()):
                found.append(record)
    return found


def _readable_without_header(name: str, data: bytes) -> list[Record]:
    """The records readable in ``data``, the bytes of run file ``name`` without an intact header.

    Such a file may be another program's, or a run log whose first line alone is damaged:
    what its lines hold counts as `_readable` counts it, each record decoded as its encoding
    shows (`_decoded`), under the run id the damaged header still names (when its JSON reads)
    or else the one the file name stands for (`id_from_name`).
    """
    first = data.split(b"\n", 1)[0]
    run_id = _run_id_in_header(first) or id_from_name(name)
    return [record for line in data.split(b"\n") for record in _records_in(line, run_id, None)]


def _run_id_in_header(line: bytes) -> str | None:
    """The run id a header line names, its checksum left unchecked (``None``: it names none)."""
    try:
        data = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return None
    header = data.get("header") if isinstance(data, dict) else None
    run_id = header.get("run_id") if isinstance(header, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def _records_in(line: bytes, run_id: str, version: int | None) -> list[Record]:
    """Every record that decodes in any array of the JSON object ``line`` (in order).

    A frame's records are its one array; the other keys (``seq``, ``crc``, ``gen``) are
    not needed to read them, so a damaged key leaves them readable. ``version`` is the
    file's format (``None``: unknown, each record decoded as its shape shows).
    """
    try:
        data = json.loads(line.decode("utf-8"))  # reads escaped lone surrogates, too
    except ValueError:  # UnicodeDecodeError included
        return []
    if not isinstance(data, dict):
        return []
    found: list[Record] = []
    for items in (value for value in data.values() if isinstance(value, list)):
        for item in items:
            try:
                found.append(_decoded(item, run_id, version))
            except (LogCorrupted, ValueError, KeyError, TypeError):
                continue
    return found


def _decoded(item: Any, run_id: str, version: int | None) -> Record:
    """The record ``item`` (a frame's array element, as `json.loads` gave it) holds.

    ``version`` is the file's format; ``None`` (a file without an intact header) reads an
    array as the compact encoding and an object as the JSON-object one.

    Raises:
        ValueError, KeyError, TypeError, LogCorrupted: it holds no record.
    """
    if isinstance(item, list) if version is None else version >= COMPACT_FROM:
        return unpack(json.dumps(item, ensure_ascii=True, separators=(",", ":")), run_id)
    return record_from_dict(item)


def _key(record: Record) -> tuple[str, object, object]:
    """What two equal records share, to look one up among many."""
    return type(record).__name__, getattr(record, "step", None), getattr(record, "intent_id", None)


def _by_key(records: Sequence[Record]) -> dict[tuple[str, object, object], list[Record]]:
    index: dict[tuple[str, object, object], list[Record]] = {}
    for record in records:
        index.setdefault(_key(record), []).append(record)
    return index


def _refuse_cutting_after_calls(path: str, kept: tuple[Record, ...]) -> None:
    """Raise `RepairRefused` when ``kept`` ends on a model reply whose calls lack intents.

    The next record after such a reply is the intent of one of its calls (or its approval
    request): an unreadable line there may have held an acknowledged intent, whose call a
    resume would run again.
    """
    pending = fold(kept).pending
    reply = pending.reply
    if reply is None or len(pending.action_intents) >= len(reply.tool_calls):
        return
    started = {intent.call_id for intent in pending.action_intents}
    calls = [c for c in reply.tool_calls if c.id not in started]
    named = ", ".join(f"{c.name} (call {c.id})" for c in calls[:5])
    raise RepairRefused(
        where=path,
        message=f"{path}: the damaged line follows the model reply of step {pending.step}, "
        f"whose calls {named} have no intent before it: it may have held the intent of one, "
        "whose call a resume would run again. Check those calls' effects first, then cut "
        "anyway with force (treadle repair --force)",
    )


def _refuse_losing_facts(path: str, lost: Sequence[Record]) -> None:
    """Raise `RepairRefused` when ``lost`` shows a call that may have run, or the run's end.

    An action intent or an action result (the call ran) in the cut would make a resume run
    the call again; a run-finished record, reopen the run.
    """
    facts = _facts(lost)
    if not facts:
        return
    raise RepairRefused(
        where=path,
        message=f"{path}: the cut would remove {len(lost)} readable record(s) from the damaged "
        f"line on, among them {facts}. {_check_first(lost)} anyway with force (treadle repair "
        "--force)",
    )


def _refuse_emptying(path: str, damage: LogCorrupted, lost: Sequence[Record]) -> None:
    """Raise `RepairRefused` for a cut that would empty a file without an intact header.

    It may be another program's file; when its lines read as a run's records, the refusal
    names them as `_refuse_losing_facts` does (the calls a resume would run again).
    """
    removing = f", removing {len(lost)} readable record(s)" if lost else ""
    facts = _facts(lost)
    among = f", among them {facts}" if facts else ""
    raise RepairRefused(
        where=path,
        message=f"{path}: its first line is no treadle header ({damage}), so it may not be a "
        f"treadle run log at all; the cut would empty it{removing}{among}. Nothing was changed. "
        f"{_check_first(lost)} anyway with force (treadle repair --force)",
    )


def _facts(lost: Sequence[Record]) -> str:
    """What in ``lost`` a cut must not remove unknowingly, in words (``""``: nothing).

    The action calls that may have run (their intents or results, five named), and the
    run-finished record.
    """
    calls = {r.intent_id: r for r in lost if isinstance(r, ActionIntent | ActionResult)}
    what = []
    if calls:
        named = ", ".join(f"{c.tool} (intent {c.intent_id})" for c in list(calls.values())[:5])
        more = f" and {len(calls) - 5} more" if len(calls) > 5 else ""
        what.append(
            f"{len(calls)} action call(s) that may have run, which a resume would run "
            f"again: {named}{more}"
        )
    if any(isinstance(r, RunFinished) for r in lost):
        what.append("the run-finished record, which a resume would reopen")
    return " and ".join(what)


def _check_first(lost: Sequence[Record]) -> str:
    """How a refusal's advice starts: check the calls' effects first, when ``lost`` has some."""
    if any(isinstance(r, ActionIntent | ActionResult) for r in lost):
        return "Check those calls' effects first, then cut"
    return "Cut"
