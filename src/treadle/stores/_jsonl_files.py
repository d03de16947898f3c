"""The files of the JSONL store: names, frames, reading and checking a run file.

Blocking functions: the store (`treadle.stores.jsonl`) calls them in worker threads. The
format is described in docs/decisions/0004-jsonl-format.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from treadle._exceptions import LogCorrupted, SchemaTooNew, StoreError
from treadle.stores._codec import check_schema, encode, record_from_dict
from treadle.stores._jsonl_commit import OsFileOps
from treadle.stores._lines import FrameError, TornSpan, check_frame, frame, scan_lines
from treadle.types import Record

FORMAT: Final = "treadle.jsonl"
"""The ``format`` of a run file's header."""

FORMAT_VERSION: Final = 1
"""The frame format version written in every header; a newer file is refused."""

MAX_NAME_CHARS: Final = 200
"""Longest encoded run id kept in a file name; longer ones are named by their SHA-256."""

_SAFE: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_NAME: Final = re.compile(r"([^/]+)\.jsonl")
_PROBE_CHUNK: Final = 65_536


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


def run_file_name(run_id: str) -> str:
    """The name of a run's file: its encoded id, or ``~`` and the SHA-256 of the id."""
    encoded = encode_run_id(run_id)
    if not encoded or encoded.startswith(".") or len(encoded) > MAX_NAME_CHARS:
        digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()
        encoded = f"~{digest}"
    return f"{encoded}.jsonl"


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


def records_frame(seq: int, records: Sequence[Record]) -> bytes:
    """The line of one store operation (newline included).

    Raises:
        UnicodeEncodeError: a text cannot be written as UTF-8.
        TypeError, ValueError: a record cannot be written as JSON.
    """
    return frame(seq, "records", "[" + ",".join(encode(r) for r in records) + "]")


@attrs.frozen(kw_only=True)
class RunFile:
    """A run file as read back.

    Attributes:
        exists: the file exists.
        run_id: from the header (``None`` while the file holds no intact header).
        created_ns: from the header (0 without one).
        records: every record, in seq order.
        next_seq: the seq the next record gets.
        end: bytes of the good prefix.
        torn: the torn tail, if any.
    """

    exists: bool
    run_id: str | None
    created_ns: int
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


def _read_header(where: str, found: tuple[int, bytes, int]) -> tuple[str, int]:
    seq, line, offset = found
    data = _content(where, line, offset)
    header = data.get("header")
    if seq != 0 or not isinstance(header, dict) or header.get("format") != FORMAT:
        raise LogCorrupted(f"the first line is not a {FORMAT} header", where=where, offset=offset)
    version = header.get("version")
    if not isinstance(version, int) or not isinstance(header.get("run_id"), str):
        raise LogCorrupted("the header lacks version or run_id", where=where, offset=offset)
    if version > FORMAT_VERSION:
        raise SchemaTooNew(version, FORMAT_VERSION)
    created = header.get("created_ns", 0)
    return header["run_id"], created if isinstance(created, int) else 0


def _read_records(
    where: str, run_id: str, found: tuple[int, bytes, int], expected: int
) -> list[Record]:
    seq, line, offset = found
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


def read_run_file(path: str) -> RunFile:
    """Read and check a run file (blocking; call it in a worker thread).

    Args:
        path: the file.

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
            data = file.read()
    except FileNotFoundError:
        return RunFile(
            exists=False, run_id=None, created_ns=0, records=(), next_seq=1, end=0, torn=None
        )
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    scanned = scan_lines(data, check_frame, where=path)
    if not scanned.items:
        return RunFile(
            exists=True,
            run_id=None,
            created_ns=0,
            records=(),
            next_seq=1,
            end=scanned.end,
            torn=scanned.torn,
        )
    run_id, created_ns = _read_header(path, scanned.items[0])
    records: list[Record] = []
    for found in scanned.items[1:]:
        records.extend(_read_records(path, run_id, found, len(records) + 1))
    return RunFile(
        exists=True,
        run_id=run_id,
        created_ns=created_ns,
        records=tuple(records),
        next_seq=len(records) + 1,
        end=scanned.end,
        torn=scanned.torn,
    )


@attrs.frozen(kw_only=True)
class Listing:
    """A run file's run id and creation instant (from its header)."""

    run_id: str
    created_ns: int


def _probe(path: str) -> Listing | None:
    """The run of a file that holds a header and at least one record line, else ``None``.

    Reads only the first two lines. A damaged second line counts when more bytes follow it
    (reading the run then fails loudly); a torn one does not.
    """
    data = b""
    try:
        with open(path, "rb") as file:
            while data.count(b"\n") < 2:
                chunk = file.read(_PROBE_CHUNK)
                if not chunk:
                    return None
                data += chunk
    except FileNotFoundError:
        return None
    first = data.index(b"\n")
    second = data.index(b"\n", first + 1)
    try:
        run_id, created_ns = _read_header(path, check_frame(data[:first], 0))
    except (FrameError, LogCorrupted):
        return None  # reading the run reports what is wrong
    try:
        check_frame(data[first + 1 : second], first + 1)
    except FrameError:
        if os.path.getsize(path) <= second + 1:
            return None
    return Listing(run_id=run_id, created_ns=created_ns)


def probe_directory(directory: str, known: set[str]) -> dict[str, Listing | None]:
    """Probe every run file of ``directory`` not in ``known`` (file names)."""
    found: dict[str, Listing | None] = {}
    for entry in os.scandir(directory):
        if entry.name in known or not _NAME.fullmatch(entry.name) or not entry.is_file():
            continue
        found[entry.name] = _probe(entry.path)
    return found


def open_directory(directory: str) -> None:
    """Make sure the store directory exists (creating it, and syncing its parent).

    Raises:
        StoreError: the path is a file, its parent is missing, or it cannot be created.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise StoreError(f"cannot open JSONL store {directory}: not a directory")
    if not path.parent.is_dir():
        raise StoreError(f"cannot open JSONL store {directory}: {path.parent} is not a directory")
    if path.is_dir():
        return
    try:
        path.mkdir()
        OsFileOps().sync_dir(str(path.parent))
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError(f"cannot open JSONL store {directory}: {exc.strerror or exc}") from exc
