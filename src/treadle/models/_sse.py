"""An incremental Server-Sent Events decoder over raw bytes (WHATWG HTML, "event stream").

The decoder is fed the response body in whatever pieces the transport delivers and returns the
events completed by each piece. It splits lines on bytes (CRLF, CR or LF, including a CR/LF
pair split across two reads) and only then decodes each complete line as strict UTF-8, so a
multi-byte character cut by a read boundary is never decoded half-way, and Unicode line
separators such as U+0085 or U+2028 inside a value are never taken for line ends.
"""

from __future__ import annotations

import attrs

from treadle._exceptions import TreadleError

_BOM = b"\xef\xbb\xbf"

MAX_EVENT_BYTES = 16 * 1024 * 1024
"""The largest line, and the largest event (its data lines together), in bytes: a model's
whole reply fits many times over (a non-streamed body has the same bound), and a server that
never ends a line or an event cannot fill the memory (`SSEDecodeError` past it)."""


class SSEDecodeError(TreadleError, ValueError):
    """The byte stream is not a valid event stream.

    Its text is not UTF-8, or a line or an event is longer than `MAX_EVENT_BYTES`.

    Attributes:
        offset: byte offset in the whole stream of the start of the bad line.
    """

    def __init__(self, message: str, *, offset: int) -> None:
        super().__init__(f"{message} (line starting at byte {offset})")
        self.offset = offset


@attrs.frozen(kw_only=True)
class SSEEvent:
    """One dispatched event.

    Attributes:
        data: the ``data`` lines of the event joined with a single LF (no trailing LF).
        event: the ``event`` field; ``"message"`` when the event named none.
        id: the last ``id`` field seen so far in the stream, ``None`` when none was sent.
        retry_ms: the ``retry`` field of this event in milliseconds, ``None`` when not sent.
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


@attrs.define(eq=False)
class SSEDecoder:
    """Turns body bytes into `SSEEvent` values, one read at a time.

    Comment lines (starting with ``:``) are ignored wherever they appear; a field's value may
    follow the colon with or without one space; an event is dispatched on an empty line and
    only when it holds at least one ``data`` line. A leading UTF-8 byte order mark is skipped.
    One departure from the standard: an ``error:`` line (a field the standard ignores, which
    some servers use to report a failure) makes its event an ``error`` event whose data starts
    with that line's value, so a failure is never read as an empty success.

    Use `feed` for every read, then `close` at end of stream: an event that was never
    terminated by an empty line is discarded there, and `close` reports it.

    Attributes:
        comments: comment lines seen so far (keep-alive pings), for diagnostics.
        events: events dispatched so far.
    """

    comments: int = 0
    events: int = 0
    max_event_bytes: int = MAX_EVENT_BYTES
    _pieces: list[bytes] = attrs.field(init=False, factory=list)
    """The start of a line not ended yet, as read (joined once, when the line ends)."""
    _line_bytes: int = attrs.field(init=False, default=0)
    _data_bytes: int = attrs.field(init=False, default=0)
    _offset: int = attrs.field(init=False, default=0)
    _skip_lf: bool = attrs.field(init=False, default=False)
    _at_start: bool = attrs.field(init=False, default=True)
    _data: list[str] = attrs.field(init=False, factory=list)
    _errors: list[str] = attrs.field(init=False, factory=list)
    _event: str = attrs.field(init=False, default="")
    _last_id: str | None = attrs.field(init=False, default=None)
    _retry_ms: int | None = attrs.field(init=False, default=None)
    _pending_fields: bool = attrs.field(init=False, default=False)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode one read of the body.

        Args:
            chunk: the next bytes of the body, of any length (possibly empty).

        Returns:
            The events completed by this chunk, in stream order (often empty).

        Raises:
            SSEDecodeError: a complete line is not valid UTF-8, or a line or an event grew
                past `max_event_bytes`.
        """
        if self._skip_lf and chunk:  # the byte after a CR that ended a line: an LF pairs it
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
                self._offset += 1
        if self._at_start:
            buffer = self._joined() + chunk
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                self._keep(buffer)
                return []
            self._at_start = False
            if buffer.startswith(_BOM):
                buffer = buffer[len(_BOM) :]
                self._offset += len(_BOM)
            chunk = buffer
        if b"\n" not in chunk and b"\r" not in chunk:  # a line goes on: keep the piece only
            self._keep(chunk)
            return []
        return self._split(self._joined() + chunk)

    def _joined(self) -> bytes:
        """The pieces of the unended line, as one (each byte is joined once)."""
        joined = b"".join(self._pieces)
        self._pieces.clear()
        self._line_bytes = 0
        return joined

    def _keep(self, piece: bytes) -> None:
        """Keep ``piece`` of a line not ended yet; refuse a line past the bound."""
        self._pieces.append(piece)
        self._line_bytes += len(piece)
        if self._line_bytes > self.max_event_bytes:
            raise SSEDecodeError(
                f"a line longer than {self.max_event_bytes} bytes, not ended", offset=self._offset
            )

    def close(self) -> bool:
        """End the stream.

        Returns:
            True when an unterminated event (a partial line, or field lines without the
            empty line that dispatches them) was discarded; False on a clean end.
        """
        truncated = self._line_bytes > 0 or self._pending_fields
        self._joined()
        self._reset_event()
        return truncated

    def _split(self, buffer: bytes) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        lines = buffer.splitlines(keepends=True)
        rest = b""
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            rest = lines.pop()
        for raw in lines:
            event = self._line(raw)
            if event is not None:
                out.append(event)
        self._skip_lf = not rest and buffer.endswith(b"\r")  # an LF next read pairs that CR
        if rest:
            self._keep(rest)
        return out

    def _line(self, raw: bytes) -> SSEEvent | None:
        start = self._offset
        self._offset += len(raw)
        try:
            line = raw.rstrip(b"\r\n").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEDecodeError(f"invalid UTF-8: {exc.reason}", offset=start) from exc
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            self.comments += 1
            return None
        name, _, value = line.partition(":")
        if name in ("data", "error"):  # what an event keeps: bounded, in bytes as read
            self._data_bytes += len(raw)
            if self._data_bytes > self.max_event_bytes:
                raise SSEDecodeError(
                    f"an event longer than {self.max_event_bytes} bytes, not ended", offset=start
                )
        self._field(name, value[1:] if value.startswith(" ") else value)
        return None

    def _field(self, name: str, value: str) -> None:
        self._pending_fields = True
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry_ms = int(value)
        elif name == "error":
            # Not an SSE field: the standard ignores it. Some servers report a failure as an
            # `error: {...}` line; it becomes an `error` event so that it is never lost.
            self._errors.append(value)

    def _dispatch(self) -> SSEEvent | None:
        if self._errors:
            self._data, self._event = self._errors + self._data, "error"
        if not self._data:
            self._reset_event()
            return None
        event = SSEEvent(
            data="\n".join(self._data),
            event=self._event or "message",
            id=self._last_id,
            retry_ms=self._retry_ms,
        )
        self.events += 1
        self._reset_event()
        return event

    def _reset_event(self) -> None:
        self._data = []
        self._data_bytes = 0
        self._errors = []
        self._event = ""
        self._retry_ms = None
        self._pending_fields = False
