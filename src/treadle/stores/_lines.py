"""Recovering the lines of an append-only, newline-framed log after a crash.

A crash in the middle of an append leaves at most the LAST line of a file incomplete: no
trailing newline, or (when the file length reached the disk before all of its data) a line
whose frame check fails. `scan_lines` applies the recovery rules the JSONL store relies on:

* every line is decoded on its own (the caller's ``check`` decodes strict UTF-8 and verifies
  the line's checksum, if its format has one);
* a last segment without a trailing newline is a **torn tail**: never committed, reported,
  and excluded from the good prefix (its bytes are cut before the next append);
* a newline-terminated last line whose frame check fails is a torn tail too;
* a line whose frame check fails and that is followed by more bytes is **corruption in the
  middle**: `LogCorrupted` with the byte offset of that line, never skipped silently.

The rules do not depend on the record shape, so the same function reads our own format
(`treadle.stores.jsonl`) and foreign logs in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

from treadle._exceptions import LogCorrupted

T = TypeVar("T")

NEWLINE = 0x0A


class FrameError(Exception):
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


def scan_lines(data: bytes, check: Callable[[bytes, int], T], *, where: str) -> ScannedLines[T]:
    """Split ``data`` into newline-terminated lines and apply the torn-tail rules.

    Args:
        data: the whole file, from byte 0.
        check: called with each complete line (newline excluded) and its byte offset, in
            order; returns the decoded line, or raises `FrameError` when the line is not an
            intact frame. Any other exception propagates unchanged.
        where: the file, for error messages.

    Returns:
        The good lines, the length of the good prefix, and the torn tail if any.

    Raises:
        LogCorrupted: a line fails its frame check and more bytes follow it (``offset`` is
            the line's first byte); the ``__cause__`` is the `FrameError`.
    """
    items: list[T] = []
    offsets: list[int] = []
    pos = 0
    size = len(data)
    while pos < size:
        newline = data.find(b"\n", pos)
        if newline < 0:
            return _done(items, offsets, pos, _torn(data, pos, "no trailing newline"))
        try:
            item = check(data[pos:newline], pos)
        except FrameError as exc:
            if newline + 1 == size:
                return _done(items, offsets, pos, _torn(data, pos, str(exc)))
            raise LogCorrupted(
                f"damaged line followed by {size - newline - 1} more bytes: {exc}",
                where=where,
                offset=pos,
            ) from exc
        items.append(item)
        offsets.append(pos)
        pos = newline + 1
    return _done(items, offsets, pos, None)


def _torn(data: bytes, offset: int, reason: str) -> TornSpan:
    return TornSpan(
        offset=offset, length=len(data) - offset, reason=reason, head=data[offset : offset + 256]
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
