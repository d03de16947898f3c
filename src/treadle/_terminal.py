r"""What every ``treadle`` command does about the terminal: text it cannot encode, and Ctrl-C.

The group (`treadle.cli`) applies both around every command, so this module imports only
click and the standard library (docs/design.md, "Start-up").

* **Text.** A standard output or error whose encoding is not a Unicode one (a
  ``de_DE.ISO-8859-1`` locale, ``PYTHONIOENCODING=latin-1``) cannot encode every character.
  `escape_unencodable_text` gives such a stream the error handler `ESCAPE`, which writes each
  character it cannot encode as a JSON escape (``\u4e2d``): a command never ends in a
  `UnicodeEncodeError`, whichever path printed (``click.echo``, a rich table, a log line),
  and a JSON line stays JSON that decodes to the same text. treadle's own marks (``→``,
  ``…``, ``·``, ``✗``) are written in ASCII there (`mark`), and rich draws its tables with an
  ASCII box (it does so for an encoding other than UTF-8). Text headed for a table is
  escaped before the table measures it (`escaped_for_output`), so its rows stay aligned
  (docs/events.md, "Reading events").
* **Ctrl-C.** `on_interrupt` turns a `KeyboardInterrupt` (alone or in the exception groups of
  the nurseries it crossed) into one line on standard error, ``interrupted`` or
  ``interrupted: <what it left>``, and exit status 130 (`interrupted`): never click's
  ``Aborted!`` and status 1, which `treadle wait` and `treadle simulate` give a meaning of
  their own (docs/crash-safety.md, "What is guaranteed", item 8).
"""

from __future__ import annotations

import codecs
import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final, NoReturn, TextIO

import click

ESCAPE: Final = "treadle.escape"
"""The codec error handler writing a character its encoding lacks as a JSON escape."""

INTERRUPTED_STATUS: Final = 130
"""The exit status after Ctrl-C (SIGINT): 128 + the signal's number, as a shell reports it."""

_ASCII_MARKS: Final = {"→": "->", "…": "...", "·": "-", "✗": "x"}
"""treadle's own marks and what stands for each where the output cannot encode it."""


def escape(char: str) -> str:
    r"""``char`` as a JSON string escapes it: ``\u00e9``; beyond U+FFFF, a surrogate pair."""
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _escape_errors(error: UnicodeError) -> tuple[str, int]:
    """The `ESCAPE` handler: each character of the failed range escaped (`escape`).

    Raises:
        UnicodeError: ``error`` is not an encoding error (the handler only encodes).
    """
    if not isinstance(error, UnicodeEncodeError):
        raise error
    failed = error.object[error.start : error.end]
    return "".join(map(escape, failed)), error.end


codecs.register_error(ESCAPE, _escape_errors)

PLAIN_ASCII: Final = "treadle_ascii"
"""ASCII under a name of treadle's own: click takes a stream whose codec is named ``ascii``
for a misconfigured locale and writes UTF-8 past it, which would bypass `ESCAPE`."""


def _find_plain_ascii(name: str) -> codecs.CodecInfo | None:
    """The codec search function answering `PLAIN_ASCII`: ASCII's codec under that name."""
    if name != PLAIN_ASCII:
        return None
    ascii_codec = codecs.lookup("ascii")
    return codecs.CodecInfo(
        ascii_codec.encode,
        ascii_codec.decode,
        streamreader=ascii_codec.streamreader,
        streamwriter=ascii_codec.streamwriter,
        incrementalencoder=ascii_codec.incrementalencoder,
        incrementaldecoder=ascii_codec.incrementaldecoder,
        name=PLAIN_ASCII,
    )


codecs.register(_find_plain_ascii)


def _streams() -> tuple[TextIO, ...]:
    """Standard output and error as they are now (a test runner swaps them)."""
    return sys.stdout, sys.stderr


def _encoding(stream: TextIO) -> str:
    """The codec name of ``stream``'s encoding (``utf-8`` when it names none)."""
    try:
        return codecs.lookup(getattr(stream, "encoding", None) or "utf-8").name
    except LookupError:
        return "utf-8"


def _encodes_everything(stream: TextIO) -> bool:
    """Whether ``stream``'s encoding is a Unicode one, which encodes every character."""
    return _encoding(stream).startswith("utf")


def escape_unencodable_text() -> None:
    """Give standard output and error the `ESCAPE` error handler where their encoding needs it.

    Only a stream whose encoding is not a Unicode one is changed (a UTF-8 stream keeps its
    handler: ``surrogateescape`` under the C locale), and only a `io.TextIOWrapper`, which
    can be reconfigured. An ASCII stream's codec is renamed `PLAIN_ASCII`, so that
    ``click.echo`` writes through it as through any other.
    """
    for stream in _streams():
        if isinstance(stream, io.TextIOWrapper) and not _encodes_everything(stream):
            if _encoding(stream) == "ascii":
                stream.reconfigure(encoding=PLAIN_ASCII, errors=ESCAPE)
            else:
                stream.reconfigure(errors=ESCAPE)


def mark(symbol: str) -> str:
    """``symbol``, one of treadle's marks, or its ASCII stand-in where output cannot encode it.

    ``→`` (``->``), ``…`` (``...``), ``·`` (``-``), ``✗`` (``x``); checked against standard
    output and error as they are now.

    Raises:
        KeyError: ``symbol`` is no mark of this module's.
    """
    plain = _ASCII_MARKS[symbol]
    for stream in _streams():
        try:
            symbol.encode(_encoding(stream))
        except UnicodeEncodeError:
            return plain
    return symbol


def escaped_for_output(text: str) -> str:
    r"""``text`` with each character standard output or error cannot encode escaped (``\u4e2d``).

    The same escapes as `ESCAPE` writes; done before a table measures the text, a row keeps
    its width. Text the streams encode (all of it on a UTF-8 terminal) is returned as is.
    """
    for stream in _streams():
        if not _encodes_everything(stream):
            encoding = _encoding(stream)
            text = text.encode(encoding, errors=ESCAPE).decode(encoding)
    return text


def interrupted(consequence: str | None = None) -> NoReturn:
    """Say on standard error that Ctrl-C stopped the command, and exit with status 130.

    Args:
        consequence: what the interruption left, after ``interrupted: ``; ``None`` prints
            ``interrupted`` alone.

    Raises:
        SystemExit: always, with `INTERRUPTED_STATUS`.
    """
    click.echo(f"interrupted: {consequence}" if consequence else "interrupted", err=True)
    raise SystemExit(INTERRUPTED_STATUS) from None


def is_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is Ctrl-C: a `KeyboardInterrupt`, alone or inside exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return error.subgroup(KeyboardInterrupt) is not None
    return isinstance(error, KeyboardInterrupt)


@contextmanager
def on_interrupt(consequence: str | Callable[[], str | None] | None = None) -> Iterator[None]:
    """Turn Ctrl-C inside the block into `interrupted` (a line on stderr, exit status 130).

    Args:
        consequence: what the interruption leaves, or a function called once it came that
            says it (and may print first: `treadle simulate` prints the seeds it ran).

    Raises:
        SystemExit: Ctrl-C came, as `interrupted` raises it; any other error passes as is.
    """
    try:
        yield
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not is_interrupt(exc):
            raise
        interrupted(consequence() if callable(consequence) else consequence)
