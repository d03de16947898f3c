"""Line framing for append-only logs: recovery after a crash, and the JSONL store's frames.

A crash in the middle of an append leaves at most the end of a file unwritten: the last line
without its trailing newline, or (after a power cut, when the file's new length reached the
disk before its data) a tail of NUL bytes. `scan_lines` applies the recovery rules the JSONL
store relies on (docs/crash-safety.md, "Torn tails and damage"):

* every line is decoded on its own (the caller's ``check`` decodes strict UTF-8 and verifies
  the line's checksum, if its format has one);
* what a lost write looks like is a **torn tail**: a last segment without a trailing newline,
  or a tail made only of NUL bytes (and newlines). It was never acknowledged; it is reported
  and excluded from the good prefix (its bytes are cut before the next append);
* anything else that fails its check is **damage**: `LogCorrupted` with the byte offset of the
  line, never cut silently, whether more lines follow it or not. An operator removes it
  knowingly with ``treadle repair``.

The rules do not depend on the record shape, so the same function reads our own format
(`treadle.stores.jsonl`) and foreign logs in tests.

The frame of the JSONL store (`frame`, `check_frame`) is one line of JSON whose ``crc`` field
is the CRC-32 of the line itself, with the 8 hex digits of the field taken as zeros::

    {"seq":5,"crc":"00c0ffee","gen":2,"records":[...]}

``frame`` takes the payload as JSON text; what the records in it look like is the codec's
(`treadle.stores._codec`).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from typing import Final, Generic, TypeVar

import attrs

from treadle._exceptions import LogCorrupted, TreadleError

T = TypeVar("T")

_PREFIX: Final = re.compile(rb'\{"seq":(0|[1-9][0-9]{0,17}),"crc":"([0-9a-f]{8})",')
_ZEROS: Final = b"00000000"


class FrameError(TreadleError):
    """A line that is not an intact frame (bad UTF-8, not a frame, checksum mismatch).

    Raised by a line check. At the end of a file it marks a torn tail; anywhere else the
    scanner turns it into `LogCorrupted`.
    """


@attrs.frozen(kw_only=True)
class TornSpan:
    """Where a torn tail lies in a file.

    Attributes:
        offset: byte offset of the torn line's first byte; also the length of the good prefix
            (the size the file is cut to before the next append).
        length: bytes from ``offset`` to the end of the file.
        reason: ``no trailing newline``, or the frame error of a complete last line.
        head: up to the first 256 bytes of the torn line, for diagnostics.
    """

    offset: int
    length: int
    reason: str
    head: bytes = b""


@attrs.frozen(kw_only=True)
class ScannedLines(Generic[T]):
    """What `scan_lines` found.

    Attributes:
        items: what ``check`` returned for each good line, in file order.
        offsets: the byte offset of each good line, in file order.
        end: bytes of the good prefix (the end of the last good line's newline).
        torn: the torn tail, or ``None`` when the file ends with an intact line (or is empty).
    """

    items: tuple[T, ...]
    offsets: tuple[int, ...]
    end: int
    torn: TornSpan | None


def scan_lines(
    data: bytes, check: Callable[[bytes, int], T], *, where: str, base: int = 0
) -> ScannedLines[T]:
    """Split ``data`` into newline-terminated lines and apply the torn-tail rules.

    Args:
        data: the file from byte ``base`` on (``base`` must be the start of a line).
        check: called with each complete line (newline excluded) and its byte offset, in
            order; returns the decoded line, or raises `FrameError` when the line is not an
            intact frame. Any other exception propagates unchanged.
        where: the file, for error messages.
        base: the file offset of ``data[0]``; every offset reported is a file offset.

    Returns:
        The good lines, the length of the good prefix, and the torn tail if any (an
        unterminated last segment, or a tail of NUL bytes).

    Raises:
        LogCorrupted: a complete line fails its frame check (``offset`` is the line's first
            byte); the ``__cause__`` is the `FrameError`.
    """
    items: list[T] = []
    offsets: list[int] = []
    pos = 0
    size = len(data)
    # Where the tail of NUL bytes and newlines begins, if there is one (computed once: asking
    # at every line whether only such bytes follow would read the rest of the file each time).
    zeros = _nul_tail(data)
    while pos < size:
        if pos >= zeros and data.find(b"\0", pos) >= 0:
            return _done(items, offsets, base + pos, _torn(data, pos, base, "a tail of NUL bytes"))
        newline = data.find(b"\n", pos)
        if newline < 0:
            _refuse_whole_frame(data[pos:], where=where, offset=base + pos)
            return _done(items, offsets, base + pos, _torn(data, pos, base, "no trailing newline"))
        try:
            item = check(data[pos:newline], base + pos)
        except FrameError as exc:
            after = size - newline - 1
            more = f" followed by {after} more bytes" if after else " (the last line)"
            raise LogCorrupted(
                f"damaged line{more}: {exc}; a torn write never looks like this "
                "(`treadle repair` removes it knowingly)",
                where=where,
                offset=base + pos,
            ) from exc
        items.append(item)
        offsets.append(base + pos)
        pos = newline + 1
    return _done(items, offsets, base + pos, None)


def _refuse_whole_frame(segment: bytes, *, where: str, offset: int) -> None:
    """Refuse an unterminated last segment that holds a whole frame and then other bytes.

    A lost write leaves a prefix of what was appended (a frame and its newline), or zeros
    where the data did not reach the disk, so such a segment (other bytes than NUL after the
    frame) is no torn tail: its newline was damaged, and the frame may be an acknowledged
    intent (cutting it would run that call again). The frame is found by its checksum,
    computed once along the segment (a brace at a time).

    Raises:
        LogCorrupted: the segment starts with a whole frame that other bytes follow.
    """
    match = _PREFIX.match(segment)
    if match is None:
        return
    start, stop = match.span(2)
    wanted = int(match[2], 16)
    crc = zlib.crc32(_ZEROS, zlib.crc32(segment[:start]))
    at = stop
    while True:
        brace = segment.find(b"}", at)
        if brace < 0 or brace + 1 >= len(segment):
            return  # no whole frame before the end: what a lost write leaves
        crc = zlib.crc32(segment[at : brace + 1], crc)
        at = brace + 1
        if crc == wanted:
            if not segment[at:].strip(b"\0"):
                return  # zeros where the newline was: a power cut's lost write
            raise LogCorrupted(
                f"the last line is whole and intact but {len(segment) - at} other bytes "
                "stand where its newline belongs; a torn write never looks like this "
                "(`treadle repair` removes it knowingly)",
                where=where,
                offset=offset,
            )


def _nul_tail(data: bytes) -> int:
    """Where the tail of NUL bytes and newlines of ``data`` begins (``len(data)``: none).

    A tail counts only if it holds one NUL byte at least and does not end with a newline (a
    lost append's zeros run to the end of the file). ``data[pos:]`` holds nothing but NUL
    bytes and newlines exactly when ``pos`` is at or after it.
    """
    if data.find(b"\0") < 0 or data.endswith(b"\n"):
        # A write that did not reach the disk leaves zeros up to the file's end, its final
        # newline included: NUL bytes that a newline ends were never a lost append. They
        # are a damaged line, left to its frame check.
        return len(data)
    end = len(data.rstrip(b"\0\n"))
    return end if b"\0" in data[end:] else len(data)


def _torn(data: bytes, pos: int, base: int, reason: str) -> TornSpan:
    return TornSpan(
        offset=base + pos, length=len(data) - pos, reason=reason, head=data[pos : pos + 256]
    )


def _done(items: list[T], offsets: list[int], end: int, torn: TornSpan | None) -> ScannedLines[T]:
    return ScannedLines(items=tuple(items), offsets=tuple(offsets), end=end, torn=torn)


def strict_utf8(line: bytes) -> str:
    """Decode one line as strict UTF-8.

    Raises:
        FrameError: the bytes are not valid UTF-8 (a torn multi-byte character included).
    """
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(f"invalid UTF-8 at byte {exc.start} of the line") from exc


# --------------------------------------------------------------------------- JSONL frames


def frame(
    seq: int, key: str, payload: str | bytes | list[bytes], *, generation: int | None = None
) -> bytes:
    """One frame line (newline included).

    ``{"seq":<seq>,"crc":"<hex>","<key>":<payload>}``, with ``"gen":<generation>`` before the
    key when a generation is given. ``payload`` is JSON text (UTF-8 when bytes), or UTF-8
    pieces of it to be written end to end: the line is made with one copy of them, so a
    record of 50 MB is not copied again for each part of the frame around it.

    Raises:
        UnicodeEncodeError: ``payload`` holds a lone surrogate.
    """
    head = b'{"seq":%d,"crc":"' % seq
    gen = b"" if generation is None else b'"gen":%d,' % generation
    if isinstance(payload, str):
        payload = [payload.encode()]
    elif isinstance(payload, bytes):
        payload = [payload]
    parts = [b'",%s"%s":' % (gen, key.encode()), *payload, b"}"]
    crc = zlib.crc32(_ZEROS, zlib.crc32(head))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b"".join((head, b"%08x" % crc, *parts, b"\n"))


def check_frame(line: bytes, offset: int) -> tuple[int, bytes, int]:
    """The frame check of one line (newline excluded): its prefix and its checksum.

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
