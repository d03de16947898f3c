"""Finding secret values in free text: its readings, the values after secret keys, the spans.

The text pass of `treadle.redaction.Redaction.text` and `treadle.redaction.without_secret_values`
(docs/events.md, "Secret arguments"): a text is read as it is written and as the parsers decode
its strings (`readings_of`), the values after a secret argument's key are found in every reading
(`found_in`), each read in the reading it was written in (`_where_value_written`), the
places of given values too (`value_spans`), and each place is traced back to the text as
written and replaced there (`replaced`). The work is linear in the text's length for a given
set of secret values, and at most `MAX_SEARCHED_VALUES` values are looked for. No text makes
any of it raise: a reply's text is the model's to write.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import json
import re
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from typing import Final

import attrs

from treadle import _repair

REDACTED: Final = "[redacted]"
"""What a secret argument's value is replaced with on the way out of the log."""

MAX_DECODED_DEPTH: Final = 3
"""How many times `Redaction.text` reads the escapes of its text (JSON inside a JSON string)."""
WHOLE_WORD_CHARS: Final = 8
"""A secret value shorter than this is replaced in text only as a whole word or number."""
MAX_SEARCHED_VALUES: Final = 64
"""How many distinct secret values `value_spans` looks for in one text, the first ones given."""

Span = tuple[int, int, str]
"""``(start, end, replacement)``: ``text[start:end]`` is to read ``replacement``."""

_ESCAPE: Final = re.compile(
    r"\\(?:u(?P<high>[dD][89abAB][0-9a-fA-F]{2})\\u(?P<low>[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|u(?P<u>[0-9a-fA-F]{4})|U(?P<wide>[0-9a-fA-F]{8})|x(?P<x>[0-9a-fA-F]{2})"
    r"|(?P<octal>[0-7]{1,3})|N\{(?P<name>[^{}\n]{1,100})\}|(?P<char>\r\n|.))",
    re.DOTALL,
)
"""One escape of a JSON or a Python string literal (a JSON surrogate pair as one)."""
_ESCAPED: Final = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "b": "\b",
    "f": "\f",
    "a": "\a",
    "v": "\v",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "/": "/",
    "\n": "",
    "\r\n": "",
}
"""What a backslash and one character read as (before a line end: nothing, Python's rule)."""
_CONTINUED: Final = r"(?:\\\r?\n)*"
"""Python's line continuation, which may stand between any two characters of a string."""
_SPACE: Final = re.compile(r"\s*+")
_OPENING_QUOTE: Final = re.compile(r"""[rRuUbB]{0,2}('''|\"\"\"|["'])""")
_BODY: Final = {
    quote: re.compile(
        rf"(?:[^{quote[0]}\\]++|\\.|{quote[0]}(?!{quote[0]}{quote[0]}))*+"
        if len(quote) == 3
        else rf"(?:[^{quote}\\]++|\\.)*+",
        re.DOTALL,
    )
    for quote in ('"', "'", '"""', "'''")
}
"""The body of a string literal opened by each quote: up to its closing quote."""
_COMPOUND_MARK: Final = re.compile(r"""'''|\"\"\"|["'#()\[\]{}]""")
_BARE: Final = re.compile(r"[^\s,}\])]+")
_CONSTANTS: Final = frozenset({"true", "false", "null", "True", "False", "None"})
"""Bare values that are no secret's value (booleans and nulls are not secrets)."""


@attrs.frozen
class _Reading:
    """A text with its escapes read once, and where each escape stood in the text read.

    Attributes:
        text: the text as read.
        at: per escape, in order, where what it reads as begins in ``text``.
        sizes: per escape, how many characters it reads as (0 for a line continuation).
        origins: per escape, where it began in the text read.
        ends: per escape, where it ended in the text read.
    """

    text: str
    at: tuple[int, ...]
    sizes: tuple[int, ...]
    origins: tuple[int, ...]
    ends: tuple[int, ...]

    def back(self, start: int, end: int) -> tuple[int, int]:
        """Where ``text[start:end]`` (not empty) stood in the text read: ``(start, end)``."""
        return self._origin(start, after=False), self._origin(end - 1, after=True)

    def origin(self, pos: int) -> int:
        """Where the character at ``pos`` (at the text's end: that end) began in the text read."""
        return self._origin(pos, after=False)

    def source(self, pos: int) -> int | None:
        """Where the character at ``pos`` stood in the text read; ``None`` if an escape wrote it.

        ``pos`` may be the text's end: the text read's end.
        """
        escape = bisect.bisect_right(self.at, pos) - 1
        if escape >= 0 and pos < self.at[escape] + self.sizes[escape]:
            return None
        return self.origin(pos)

    def _origin(self, pos: int, *, after: bool) -> int:
        """Where the character at ``pos`` began (or, ``after``, ended) in the text read."""
        escape = bisect.bisect_right(self.at, pos) - 1
        if escape < 0:
            return pos + (1 if after else 0)
        read_end = self.at[escape] + self.sizes[escape]
        if pos < read_end:
            return self.ends[escape] if after else self.origins[escape]
        return self.ends[escape] + pos - read_end + (1 if after else 0)


Readings = list[tuple[str, tuple[_Reading, ...]]]
"""A text and its readings, each with the chain of readings that leads back to the text."""


@attrs.frozen
class _Value:
    """A value after a secret argument's key in one reading of a text.

    Attributes:
        start: where it starts (inside the quotes of a string).
        end: where it ends (before the closing quote of a string).
        quoted: it is a string (or a parameter block's text).
        forms: the strings and numbers it holds, as they are written (`forms_of`).
    """

    start: int
    end: int
    quoted: bool
    forms: tuple[str, ...]


@attrs.frozen
class Found:
    """What `Redaction.text` reads in one text, whatever values it is then asked to hide.

    Attributes:
        readings: the text and its readings (`readings_of`).
        spans: the values after secret arguments' keys, to be replaced, in the text's offsets.
        forms: the strings and numbers those values hold.
    """

    readings: Readings
    spans: tuple[Span, ...]
    forms: tuple[str, ...]


@functools.cache
def key_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    """A secret argument's name in quotes (a key, if a colon follows) or its parameter tag.

    Any quotes: ``"name"``, ``'name'``, and triple ones, each character of the name written
    as itself or escaped (`_spelled`), so that the key is found in the same reading as its
    value; the tag is ``<parameter=name>``.
    """
    spelled = "|".join(_CONTINUED.join(map(_spelled, name)) for name in names)
    plain = "|".join(re.escape(name) for name in names)
    return re.compile(
        rf"""(?P<quote>'''|\"\"\"|["'])(?:{spelled})(?P=quote)|<parameter=(?:{plain})>"""
    )


def _spelled(char: str) -> str:
    r"""A pattern of ``char`` as a string literal may write it: itself, or any escape of it.

    The escapes are those `readings_of` reads (`_ESCAPE`): ``\u`` with four hex digits (or a
    surrogate pair), ``\U``, ``\x``, octal, ``\N{name}``, and a backslash and a letter.
    """
    code = ord(char)
    ways = [re.escape(char), rf"\\U(?i:{code:08x})"]
    if code <= 0xFFFF:
        ways.append(rf"\\u(?i:{code:04x})")
    else:
        high, low = divmod(code - 0x10000, 0x400)
        ways.append(rf"\\u(?i:{0xD800 + high:04x})\\u(?i:{0xDC00 + low:04x})")
    if code < 0x100:
        ways.append(rf"\\x(?i:{code:02x})")
    if code < 0o1000:
        ways.append(rf"\\0{{0,{3 - len(f'{code:o}')}}}{code:o}")
    ways += [rf"\\{re.escape(written)}" for written, read in _ESCAPED.items() if read == char]
    name = unicodedata.name(char, "")
    if name:
        ways.append(rf"\\N\{{(?i:{re.escape(name)})\}}")
    return f"(?:{'|'.join(ways)})"


def found_in(text: str, keys: re.Pattern[str]) -> Found:
    """The values after secret arguments' keys in every reading of ``text`` (`readings_of`).

    A string's body is to read ``[redacted]``; any other value (a number, a list or an object
    whole) ``"[redacted]"``, its quotes written as its key's are, so that JSON, and JSON
    inside a JSON string, stays valid. Each value is read in the reading it was written in
    (`_where_value_written`), once however many readings hold its key.
    """
    readings = readings_of(text)
    spans: list[Span] = []
    forms: list[str] = []
    read: dict[tuple[int, int], _Value | None] = {}
    for depth, (_, chain) in enumerate(readings):
        for key, value, written in _values_after_keys(readings, depth, keys, read):
            forms.extend(value.forms)
            if value.end == value.start:
                continue
            replacement = REDACTED
            if not value.quoted:
                start, end = _written(chain, key.start(), key.start() + len(key.group("quote")))
                replacement = f"{text[start:end]}{REDACTED}{text[start:end]}"
            spans.append((*_written(written, value.start, value.end), replacement))
    return Found(readings=readings, spans=tuple(spans), forms=tuple(forms))


def readings_of(text: str) -> Readings:
    r"""``text``, and what reading its escapes gives, once, twice ... `MAX_DECODED_DEPTH` times.

    Reading decodes every escape that a JSON or a Python string literal decodes (``\u00e9``
    in either case, ``\/``, ``\x5f``, ``\U...``, ``\N{...}``, octal, a backslash before a
    line end), wherever it stands: a string in the text reads as the parsers decode it, JSON
    in a JSON string reads as JSON the second time. It stops when a reading has no escape.
    """
    found: Readings = [(text, ())]
    for _ in range(MAX_DECODED_DEPTH):
        reading, chain = found[-1]
        read = _read_once(reading)
        if read is None:
            break
        found.append((read.text, (*chain, read)))
    return found


def _read_once(text: str) -> _Reading | None:
    """``text`` with its escapes read (`readings_of`); ``None`` when it has none."""
    pieces: list[str] = []
    at: list[int] = []
    sizes: list[int] = []
    origins: list[int] = []
    ends: list[int] = []
    done = size = 0
    for match in _ESCAPE.finditer(text):
        char = _escaped(match)
        if char is None:
            continue
        start = match.start()
        pieces += [text[done:start], char]
        size += start - done
        at.append(size)
        sizes.append(len(char))
        origins.append(start)
        done = match.end()
        ends.append(done)
        size += len(char)
    if not at:
        return None
    pieces.append(text[done:])
    return _Reading(
        text="".join(pieces),
        at=tuple(at),
        sizes=tuple(sizes),
        origins=tuple(origins),
        ends=tuple(ends),
    )


def _escaped(match: re.Match[str]) -> str | None:
    """What one escape (`_ESCAPE`) reads as; ``None`` when no string literal reads it."""
    kind = match.lastgroup
    written = match[kind] if kind is not None else ""
    if kind == "char":
        return _ESCAPED.get(written)
    if kind == "low":
        return chr(0x10000 + ((int(match["high"], 16) - 0xD800) << 10) + int(written, 16) - 0xDC00)
    if kind == "name":
        try:
            return unicodedata.lookup(written)
        except (KeyError, ValueError):  # no such name; a name with a lone surrogate in it
            return None
    code = int(written, 8 if kind == "octal" else 16)
    return chr(code) if code <= sys.maxunicode else None


def _written(chain: tuple[_Reading, ...], start: int, end: int) -> tuple[int, int]:
    """Where ``[start, end)`` of the last reading of ``chain`` stands in the text read first."""
    for reading in reversed(chain):
        start, end = reading.back(start, end)
    return start, end


def _written_at(chain: tuple[_Reading, ...], pos: int) -> int:
    """Where the character at ``pos`` of the last reading of ``chain`` began in the text.

    ``pos`` may be the reading's end: the text's end.
    """
    for reading in reversed(chain):
        pos = reading.origin(pos)
    return pos


def _where_written(chain: tuple[_Reading, ...], pos: int, lowest: int = 0) -> tuple[int, int]:
    r"""The reading the character at ``pos`` of ``chain``'s last reading was written in.

    A character an escape reads as was written in the reading the escape was read into (the
    quotes of JSON inside a JSON string, ``\"``, in reading 1); any other in the text itself,
    reading 0. Not before reading ``lowest``: there, the character's position.

    Returns:
        ``(its index in readings_of, the character's position there)``.
    """
    depth = len(chain)
    while depth > lowest:
        source = chain[depth - 1].source(pos)
        if source is None:
            break
        depth, pos = depth - 1, source
    return depth, pos


def _values_after_keys(
    readings: Readings,
    depth: int,
    keys: re.Pattern[str],
    read: dict[tuple[int, int], _Value | None],
) -> Iterator[tuple[re.Match[str], _Value, tuple[_Reading, ...]]]:
    """Each secret argument's key in reading ``depth`` and the value after it, in order.

    With the value, the chain of the reading it was read in (`_where_value_written`: its
    offsets are that reading's). A value ``read`` already (by that reading's index and its
    place there), after a key of an earlier reading, is not read nor given again; each value
    read is added. White space and Python comments may stand before and after the colon. A
    key inside the value of an earlier one (in the text's offsets) is not read again: each
    character is looked at a bounded number of times.
    """
    text, chain = readings[depth]
    gaps = _Gaps(text)
    covered = 0
    for key in keys.finditer(text):
        if _written_at(chain, key.start()) < covered:
            continue
        if key.group("quote") is None:
            where = depth, key.end()
        else:
            colon = gaps.end(key.end())
            if not text.startswith(":", colon):
                continue
            where = _where_value_written(readings, depth, key.start(), gaps.end(colon + 1))
        fresh = where not in read
        if fresh:
            read[where] = _value_of(readings, where, parameter=key.group("quote") is None)
        value, written = read[where], readings[where[0]][1]
        if value is not None:
            covered = _written_at(written, value.end)
            if fresh:
                yield key, value, written


def _where_value_written(readings: Readings, depth: int, key: int, start: int) -> tuple[int, int]:
    r"""Where the value at ``start`` of reading ``depth`` was written: ``(reading, place)``.

    A string is read where its opening quote was written (`_where_written`), any other value
    where its key's quote (at ``key``) was, or its own first character if that is later. A
    later reading decodes the escapes of the value's own layer too: ``"C:\\keys\\", "a"``
    reads ``"C:\keys\", "a"`` there, and the string would run on to the next quote, an
    object holding it to the text's end.

    Returns:
        The index of that reading in ``readings`` and the place the value starts there (its
        opening quote, for a string).
    """
    text, chain = readings[depth]
    quote = _OPENING_QUOTE.match(text, start)
    if quote is not None:
        return _where_written(chain, quote.start(1))
    return _where_written(chain, start, lowest=_where_written(chain, key)[0])


def _value_of(readings: Readings, where: tuple[int, int], *, parameter: bool) -> _Value | None:
    """The value at ``where``, ``(reading, place)``; ``None`` if none.

    A value after a key (`_value_at`), or the text of a parameter block whose tag ends there
    (`_parameter_at`).
    """
    text = readings[where[0]][0]
    return _parameter_at(text, where[1]) if parameter else _value_at(text, where[1])


class _Gaps:
    """Where the white space and Python comments that follow a position in a text end.

    A comment is skipped to its line's end, found by bisection, and where the gap that
    follows a line's end ends is kept: however many keys stand in comments, each line is
    looked at once.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.after_line: dict[int, int] = {}

    @functools.cached_property
    def line_ends(self) -> list[int]:
        """Where each line of the text ends (its newline), in order."""
        return [match.start() for match in re.finditer("\n", self.text)]

    def end(self, pos: int) -> int:
        """Where the gap that starts at ``pos`` ends (``pos`` when there is none)."""
        passed: list[int] = []
        while True:
            pos = _SPACE.match(self.text, pos).end()  # type: ignore[union-attr]
            if not self.text.startswith("#", pos):
                break
            line = bisect.bisect_left(self.line_ends, pos)
            pos = self.line_ends[line] if line < len(self.line_ends) else len(self.text)
            if pos in self.after_line:
                pos = self.after_line[pos]
                break
            passed.append(pos)
        self.after_line.update(dict.fromkeys(passed, pos))
        return pos


def _parameter_at(text: str, pos: int) -> _Value:
    """The text of the ``<parameter=name>`` block whose tag ends at ``pos``.

    It runs to ``</parameter>``, or to the text's end when the block is not closed.
    """
    end = text.find("</parameter>", pos)
    end = len(text) if end < 0 else end
    inner = text[pos:end].strip()
    return _Value(start=pos, end=end, quoted=True, forms=(inner,) if inner else ())


def _value_at(text: str, start: int) -> _Value | None:
    """The value that starts at ``start``; ``None`` if none.

    A string literal (any quotes, a Python prefix), a bracketed value (a list, an object, a
    parenthesised Python value), or a bare word or number.
    """
    quote = _OPENING_QUOTE.match(text, start)
    if quote is not None:
        end = _string_end(text, quote.end(), quote[1])
        body = text[quote.end() : end]
        forms = tuple(reading for reading, _ in readings_of(body))  # as written, and decoded
        return _Value(start=quote.end(), end=end, quoted=True, forms=forms)
    if text.startswith(("(", "[", "{"), start):
        end = _compound_end(text, start)
        forms = tuple(forms_of(_decoded(text[start:end])))
        return _Value(start=start, end=end, quoted=False, forms=forms)
    bare = _BARE.match(text, start)
    if bare is None:
        return None
    forms = () if bare[0] in _CONSTANTS else (bare[0],)
    return _Value(start=start, end=bare.end(), quoted=False, forms=forms)


def _string_end(text: str, pos: int, quote: str) -> int:
    """Where the body of the string literal opened by ``quote`` just before ``pos`` ends.

    At its closing quote, or at the text's end when it is not closed.
    """
    end = _BODY[quote].match(text, pos).end()  # type: ignore[union-attr]
    return end if text.startswith(quote, end) else len(text)


def _compound_end(text: str, start: int) -> int:
    """The end of the bracketed value at ``start``, or the text's end when it is not closed.

    Strings and Python comments in it are skipped; any bracket counts.
    """
    depth, pos = 0, start
    while (mark := _COMPOUND_MARK.search(text, pos)) is not None:
        token, pos = mark[0], mark.end()
        if token in ("(", "[", "{"):
            depth += 1
        elif token in (")", "]", "}"):
            depth -= 1
            if depth == 0:
                return pos
        elif token == "#":
            line_end = text.find("\n", pos)
            pos = len(text) if line_end < 0 else line_end
        else:
            pos = _string_end(text, pos, token) + len(token)
    return len(text)


def _decoded(written: str) -> list[object]:
    """A bracketed value as the parsers decode it (JSON, else a Python literal).

    ``[]`` when they cannot.
    """
    found = _repair.json_values(written)
    if found.error is None:
        return list(found.values)
    literal = _repair.python_literal(written)
    return [] if literal is None else [literal]


def _leaves(value: object) -> Iterator[str | int | float]:
    """The strings and numbers within ``value``, in order (booleans and nulls are not secrets).

    The walk is iterative: a value nested as deep as a decoder allows is walked too.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(reversed(item.values()))
        elif isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, str | int | float) and not isinstance(item, bool):
            yield item


def forms_of(values: Iterable[object]) -> Iterator[str]:
    """The strings and numbers within ``values`` as text: a number as JSON writes it.

    An integer too long for Python to write in decimal (over 4300 digits: only a Python
    literal such as ``0xfff...`` reads as one) has no such form and is left out; after a
    key, its place is replaced all the same.
    """
    for leaf in _leaves(list(values)):
        if isinstance(leaf, str):
            yield leaf
            continue
        try:
            yield json.dumps(leaf)
        except ValueError:  # int.__str__'s digit limit (sys.get_int_max_str_digits)
            continue


def value_spans(readings: Readings, forms: Iterable[str]) -> list[Span]:
    """Where each of ``forms`` stands in any reading of the text, in the text's offsets.

    A short form (under `WHOLE_WORD_CHARS` characters) that starts or ends with a letter,
    digit or ``_`` counts only where it is not part of a longer word or number (a PIN
    ``1234`` leaves ``12345`` and ``3.1234`` alone, not ``PIN 1234.``); a longer one counts
    wherever it stands. The first `MAX_SEARCHED_VALUES` distinct forms are looked for, each
    once in each reading, longest first, and a place wholly inside one found before is not
    kept (`_places`): the work is the text's length times the number of forms looked for,
    whatever values the text holds (docs/events.md, "Secret arguments").
    """
    searched = sorted(distinct_forms(forms), key=len, reverse=True)
    return [
        (*_written(chain, start, end), REDACTED)
        for reading, chain in readings
        for start, end in _places(reading, searched)
    ]


def distinct_forms(forms: Iterable[str]) -> list[str]:
    """The distinct ``forms`` `value_spans` looks for: the first `MAX_SEARCHED_VALUES`."""
    distinct: dict[str, None] = {}
    for form in forms:
        if form and form != REDACTED:
            distinct[form] = None
            if len(distinct) == MAX_SEARCHED_VALUES:
                break
    return list(distinct)


def _places(text: str, forms: list[str]) -> list[tuple[int, int]]:
    """Where ``forms`` (longest first) stand in ``text``: ``(start, end)`` each.

    The places of one form do not overlap, and one wholly inside the places found before
    (a longer form's) is skipped: the search goes on from where it could leave them. So a
    text of secret values nested in one another (``aaaaaaaa``, ``aaaaaaaaa`` ...) gives
    a place per value, not one per value and place of another.
    """
    found = _Found()
    for form in forms:
        found.add(list(_places_of(text, form, found)))
    return found.places


def _places_of(text: str, form: str, found: _Found) -> Iterator[tuple[int, int]]:
    """Where ``form`` stands in ``text`` outside what is already ``found`` (`_places`).

    A long form is found by `str.find`; a short one by a pattern that says which neighbours
    it may not have (`_whole_word`), so that a place it may not take costs no Python step.
    """
    size = len(form)
    if size < WHOLE_WORD_CHARS:
        for match in _whole_word(form).finditer(text):
            if found.holding(match.start(), match.end()) is None:
                yield match.span()
        return
    start = text.find(form)
    while start >= 0:
        holding = found.holding(start, start + size)
        if holding is None:
            yield start, start + size
            start = text.find(form, start + size)
        else:
            start = text.find(form, holding - size + 1)


class _Found:
    """The places found in one text so far, those that overlap or touch merged, in order."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    @property
    def places(self) -> list[tuple[int, int]]:
        """The merged places: ``(start, end)`` each, in order."""
        return list(zip(self.starts, self.ends, strict=True))

    def holding(self, start: int, end: int) -> int | None:
        """The end of the found place that holds ``[start, end)`` whole; ``None`` if none."""
        index = bisect.bisect_right(self.starts, start) - 1
        return self.ends[index] if index >= 0 and end <= self.ends[index] else None

    def add(self, places: list[tuple[int, int]]) -> None:
        """Add ``places`` (in order, not overlapping one another)."""
        if not places:
            return
        merged: list[tuple[int, int]] = []
        for start, end in heapq.merge(self.places, places):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self.starts = [start for start, _ in merged]
        self.ends = [end for _, end in merged]


def _whole_word(form: str) -> re.Pattern[str]:
    r"""``form`` where it is not part of a longer word or number.

    Before it, when it starts with a letter, digit or ``_``, may not stand another (``\w``),
    nor, when it starts with a digit, a digit and ``.`` (``3.1234``); after it, likewise, no
    ``\w`` and, when it ends with a digit, no ``.`` and a digit (``1234.5``). A ``.`` with
    no digit beyond it ends a sentence, not a number. The assertions follow the literal, so
    the search runs on the literal's prefix.
    """
    written = re.escape(form)
    head, tail = form[0], form[-1]
    checks = []
    if _wordy(head):
        checks.append(rf"(?<!\w{written})")
        if head.isdecimal():
            checks.append(rf"(?<!\d\.{written})")
    if _wordy(tail):
        checks.append(r"(?!\w)")
        if tail.isdecimal():
            checks.append(r"(?!\.\d)")
    return re.compile(written + "".join(checks))


def _wordy(char: str) -> bool:
    r"""Whether ``char`` is part of a word or a number: a letter, a digit or ``_`` (``\w``)."""
    return char.isalnum() or char == "_"


def replaced(text: str, spans: Iterable[Span]) -> str:
    """``text`` with each span replaced.

    Spans that overlap are replaced together, by the first one's replacement.
    """
    merged: list[Span] = []
    for span in sorted(spans, key=lambda span: (span[0], -span[1])):
        if merged and span[0] < merged[-1][1]:
            start, end, replacement = merged[-1]
            merged[-1] = (start, max(end, span[1]), replacement)
        else:
            merged.append(span)
    pieces: list[str] = []
    done = 0
    for start, end, replacement in merged:
        pieces += [text[done:start], replacement]
        done = end
    return "".join([*pieces, text[done:]])
