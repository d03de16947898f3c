"""Secret tool arguments: kept in the log, redacted on every path out of it.

A tool marks arguments as secret with ``@tool(secret_arguments=("card_number",))``. Their values
stay in the run's log exactly as the model sent them, because a resumed run must execute the
call it decided on, and an approval stays bound to the digest of the real arguments (a keyed
one: `treadle.approvals.request_digest`). Everything that shows a log to someone replaces them
with `REDACTED` (docs/events.md, "Secret arguments"):

* events, for subscribers (`treadle.RunHandle.events`) and sinks alike (a run with secrets
  streams no text deltas: `Redaction.streams`);
* `treadle.RunHandle.pending_approval`;
* ``treadle show``, ``treadle tail`` (both with and without ``--json``) and ``treadle approve``.

Free text on those paths (the model's text, a model error's message, the final answer, a failed
run's error) goes through `Redaction.text`. Text that treadle writes itself about a call (why it
was not executed, why an approval's edit was refused) never holds a secret value to begin with:
its writers pass it through `without_secret_values`, the same by-value replacement.

What is secret is read from the run's parameter snapshot (key ``secret_arguments``, written
only when some tool has secrets), so a process that has only the store (the command line) redacts
the same values as the driving process. `Redaction.of_log` takes every snapshot of a log (the
run-started one and any accepted definition change) and keeps the union.

`treadle.ports.RunStore.read_log` is not a path out: it returns the log itself.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import sys
import unicodedata
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Final

import attrs

from treadle import _repair
from treadle.types import (
    ActionIntent,
    ApprovalDecided,
    ApprovalRequested,
    DefinitionAccepted,
    Event,
    InvalidToolCall,
    JSONValue,
    Message,
    ModelErrorInfo,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
    ToolCall,
)

__all__ = ["REDACTED", "SNAPSHOT_KEY", "Redaction", "secrets_of_tools", "without_secret_values"]

REDACTED: Final = "[redacted]"
"""What a secret argument's value is replaced with on the way out of the log."""

SNAPSHOT_KEY: Final = "secret_arguments"
"""The parameter-snapshot key: ``{tool name: [argument names, sorted]}``."""


def secrets_of_tools(
    secret_arguments: Iterable[tuple[str, Collection[str]]],
) -> dict[str, JSONValue]:
    """The snapshot value of ``(tool, secret argument names)`` pairs; tools without any left out."""
    return {tool: sorted(names) for tool, names in secret_arguments if names}


def without_secret_values(
    text: str, arguments: Mapping[str, JSONValue], secrets: Collection[str]
) -> str:
    """``text`` with the values ``arguments`` gives the names in ``secrets`` replaced.

    For text written about one call whose arguments are at hand: why it was not executed
    (an argument check quoting what it got), why an edit of it was refused. Each string or
    number within each secret value becomes `REDACTED` wherever it stands, in each form JSON
    or a ``repr`` writes it (as `Redaction.text` replaces values; one shorter than
    `WHOLE_WORD_CHARS` only as a whole word or number), so a message that quotes the whole
    argument object hides it too (docs/events.md, "Secret arguments"). The text is read as
    `Redaction.text` reads it (`_readings`), so an escaped spelling of a value is found too.
    """
    values = [value for name, value in arguments.items() if name in secrets]
    spans = _value_spans(_readings(text), _forms_of(values)) if values and text else []
    return _replaced(text, spans) if spans else text


def _tool_names(specs: JSONValue) -> Iterable[str]:
    """The names of the tool specs of a snapshot's ``tools`` list."""
    for spec in specs if isinstance(specs, list) else ():
        if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            yield str(spec["name"])


@attrs.frozen
class Redaction:
    """Which arguments of which tools are secret, and the redacting of records and events.

    Attributes:
        secrets: tool name -> the names of its secret arguments.
        tools: the names of the tools the run's definitions declare. A call of any other
            tool (a name the model got wrong: ``Charge``, ``functions.charge``) is redacted
            by every secret name of every tool.
    """

    secrets: Mapping[str, frozenset[str]] = attrs.field(factory=dict)
    tools: frozenset[str] = frozenset()
    _names: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    _pattern: re.Pattern[str] | None = attrs.field(init=False, eq=False, repr=False)
    _last_read: list[tuple[str, _Found]] = attrs.field(
        init=False, factory=list, eq=False, repr=False
    )

    @_names.default
    def _every_name(self) -> frozenset[str]:
        """Every secret name of every tool."""
        return frozenset().union(*self.secrets.values())

    @_pattern.default
    def _text_pattern(self) -> re.Pattern[str] | None:
        """The keys `text` looks for, built once: every secret name of every tool."""
        names = self._names
        return _key_pattern(tuple(sorted(names, key=len, reverse=True))) if names else None

    @classmethod
    def of_snapshot(cls, snapshot: Mapping[str, JSONValue]) -> Redaction:
        """The redaction a parameter snapshot declares, and the tools it declares (key ``tools``).

        Nothing is secret when it has no secrets key.
        """
        declared = snapshot.get(SNAPSHOT_KEY)
        secrets = {
            tool: frozenset(str(name) for name in names)
            for tool, names in (declared.items() if isinstance(declared, Mapping) else ())
            if isinstance(names, list) and names
        }
        tools = frozenset(_tool_names(snapshot.get("tools")))
        return cls(secrets, tools) if secrets or tools else NO_REDACTION

    @classmethod
    def of_log(cls, log: RunLog) -> Redaction:
        """The union of the redactions of every snapshot in ``log``."""
        found = NO_REDACTION
        for record in log.records:
            if isinstance(record, RunStarted | DefinitionAccepted):
                found = found | cls.of_snapshot(record.snapshot)
        return found

    def __or__(self, other: Redaction) -> Redaction:
        """Both redactions at once: an argument secret in either is secret."""
        if other.tools <= self.tools and not other.secrets:
            return self
        if self.tools <= other.tools and not self.secrets:
            return other
        none: frozenset[str] = frozenset()
        secret = set(self.secrets) | set(other.secrets)
        return Redaction(
            {t: self.secrets.get(t, none) | other.secrets.get(t, none) for t in secret},
            self.tools | other.tools,
        )

    def __bool__(self) -> bool:
        """Whether anything is secret."""
        return bool(self.secrets)

    def arguments(self, tool: str, arguments: Mapping[str, JSONValue]) -> Mapping[str, JSONValue]:
        """``arguments`` of a call of ``tool`` with the secret values replaced.

        A tool name of ``""`` (a record that does not say), or one of no declared tool
        (`tools`), counts every tool's secrets.
        """
        names = self._names_of(tool)
        if not names or not names.intersection(arguments):
            return arguments
        return {k: REDACTED if k in names else v for k, v in arguments.items()}

    def hides(self, tool: str, arguments: Mapping[str, JSONValue]) -> bool:
        """Whether a call of ``tool`` with ``arguments`` has a secret argument."""
        return bool(self._names_of(tool).intersection(arguments))

    def streams(self, channel: str) -> bool:
        """Whether live deltas of ``channel`` (``text`` or ``reasoning``) may leave the run.

        Text deltas of a run whose tools declare secret arguments do not: a call the model
        writes into its text carries its secret values before any parser has read them, so
        no delta can be redacted as it arrives. The model's whole text still comes, redacted,
        in the model-call-finished event (docs/events.md, "Secret arguments").
        """
        return channel != "text" or not self.secrets

    def record(self, record: Record) -> Record:
        """``record`` as it may leave the log: secret argument values replaced."""
        if not self.secrets:
            return record
        if isinstance(record, ActionIntent):
            return attrs.evolve(record, arguments=self.arguments(record.tool, record.arguments))
        if isinstance(record, ApprovalRequested):
            return self.request(record)
        if isinstance(record, ApprovalDecided) and record.edited_arguments is not None:
            edited = self.arguments(record.tool, record.edited_arguments)
            return attrs.evolve(record, edited_arguments=edited)
        if isinstance(record, ModelResult):
            return self._model_result(record)
        if isinstance(record, RunFinished):
            return attrs.evolve(
                record,
                final_answer=self.text(record.final_answer),
                error=self.text(record.error),
                model_error=self._model_error(record.model_error),
            )
        if isinstance(record, StepRecord):
            message = record.history_message
            known = self._values_of(message.tool_calls) if message is not None else ()
            return attrs.evolve(
                record,
                history_message=self._message(message) if message is not None else None,
                model_output_text=self.text(record.model_output_text, known=known),
            )
        return record

    def text(self, text: str | None, *, known: Iterable[JSONValue] = ()) -> str | None:
        """``text`` with the values of secret arguments written into it as a call replaced.

        A model that writes its calls as text (a JSON object, ``<tool_call>`` markup, a
        Python dict, a ``<parameter=name>`` block) puts the arguments into its visible text,
        and a parser may run them as a call. The text is read as it is written and as the
        parsers decode its strings (`_readings`: every JSON or Python string escape read, up
        to `MAX_DECODED_DEPTH` times for JSON inside a JSON string); in every reading
        (docs/events.md, "Secret arguments"):

        * by key: the value after a secret argument's name as a key (any quotes, a comment
          before or after the colon; a string, a number, a list, an object or a parenthesised
          value whole) or inside its ``<parameter=name>`` block is replaced;
        * by value: each string and number those values hold, with the ``known`` values (the
          reply's own parsed calls'), is replaced wherever it stands.

        A string becomes ``[redacted]`` inside its quotes and any other value after a key
        ``"[redacted]"`` (its quotes written as its key's), so the JSON stays valid; a value
        found only by value becomes ``[redacted]`` bare. Other prose is left as it is.

        The work is linear in the text's length for a given set of secret values: no decoder
        is handed more than a value after a key. The text's reading is kept for the next
        call: the same reply text comes again in the step's history.
        """
        if not text or self._pattern is None:
            return text
        found = self._read(text, self._pattern)
        spans = [*found.spans, *_value_spans(found.readings, [*found.forms, *_forms_of(known)])]
        return _replaced(text, spans) if spans else text

    def _read(self, text: str, keys: re.Pattern[str]) -> _Found:
        """`_found_in` ``text``, kept for the next call with the same text.

        A reply's text is redacted in its model result and again in its step's history
        message and output text: it is read once.
        """
        for last, found in self._last_read[:1]:
            if last == text:
                return found
        found = _found_in(text, keys)
        self._last_read[:] = [(text, found)]
        return found

    def request(self, request: ApprovalRequested) -> ApprovalRequested:
        """An approval request as it may leave the log (its secret arguments replaced)."""
        if not self.secrets or request.arguments is None:
            return request
        return attrs.evolve(request, arguments=self.arguments(request.tool, request.arguments))

    def event(self, event: Event) -> Event:
        """``event`` with its record redacted (events without a record unchanged).

        A text delta of a run with secrets is never made into an event at all (`streams`).
        """
        if not self.secrets or event.record is None:
            return event
        redacted = self.record(event.record)
        return event if redacted is event.record else attrs.evolve(event, record=redacted)

    def _names_of(self, tool: str) -> frozenset[str]:
        """The secret names of ``tool``'s calls: every tool's for ``""`` or an undeclared tool."""
        if tool in self.secrets:
            return self.secrets[tool]
        return frozenset() if tool in self.tools else self._names

    def _model_result(self, record: ModelResult) -> ModelResult:
        """The reply's text and calls redacted, and the error's message (it may quote them)."""
        reply = record.reply
        if reply is not None:
            reply = attrs.evolve(
                reply,
                text=self.text(reply.text, known=self._values_of(reply.tool_calls)),
                tool_calls=self._calls(reply.tool_calls),
                invalid_tool_calls=tuple(self._invalid(c) for c in reply.invalid_tool_calls),
            )
        return attrs.evolve(record, reply=reply, error=self._model_error(record.error))

    def _model_error(self, error: ModelErrorInfo | None) -> ModelErrorInfo | None:
        """``error`` with its message redacted as text (a server may quote the arguments)."""
        if error is None or not error.message:
            return error
        return attrs.evolve(error, message=self.text(error.message) or "")

    def _values_of(self, calls: Iterable[ToolCall]) -> list[JSONValue]:
        """The values of the secret arguments of ``calls``."""
        return [
            value
            for call in calls
            for name, value in call.arguments.items()
            if name in self._names_of(call.name)
        ]

    def _calls(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        return tuple(attrs.evolve(c, arguments=self.arguments(c.name, c.arguments)) for c in calls)

    def _invalid(self, call: InvalidToolCall) -> InvalidToolCall:
        # Text that did not parse cannot be redacted value by value: all of it goes, for a
        # tool with secrets, a call without a name or one of an undeclared tool.
        if self._names_of(call.name or ""):
            return attrs.evolve(call, raw_arguments=REDACTED)
        return call

    def _message(self, message: Message) -> Message:
        return attrs.evolve(
            message,
            content=self.text(message.content, known=self._values_of(message.tool_calls)),
            tool_calls=self._calls(message.tool_calls),
        )


MAX_DECODED_DEPTH: Final = 3
"""How many times `Redaction.text` reads the escapes of its text (JSON inside a JSON string)."""
WHOLE_WORD_CHARS: Final = 8
"""A secret value shorter than this is replaced in text only as a whole word or number."""

_Span = tuple[int, int, str]
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

    def _origin(self, pos: int, *, after: bool) -> int:
        """Where the character at ``pos`` began (or, ``after``, ended) in the text read."""
        escape = bisect.bisect_right(self.at, pos) - 1
        if escape < 0:
            return pos + (1 if after else 0)
        read_end = self.at[escape] + self.sizes[escape]
        if pos < read_end:
            return self.ends[escape] if after else self.origins[escape]
        return self.ends[escape] + pos - read_end + (1 if after else 0)


_Readings = list[tuple[str, tuple[_Reading, ...]]]
"""A text and its readings, each with the chain of readings that leads back to the text."""


@attrs.frozen
class _Value:
    """A value after a secret argument's key in one reading of a text.

    Attributes:
        start: where it starts (inside the quotes of a string).
        end: where it ends (before the closing quote of a string).
        quoted: it is a string (or a parameter block's text).
        forms: the strings and numbers it holds, as they are written (`_forms_of`).
    """

    start: int
    end: int
    quoted: bool
    forms: tuple[str, ...]


@attrs.frozen
class _Found:
    """What `Redaction.text` reads in one text, whatever values it is then asked to hide.

    Attributes:
        readings: the text and its readings (`_readings`).
        spans: the values after secret arguments' keys, to be replaced, in the text's offsets.
        forms: the strings and numbers those values hold.
    """

    readings: _Readings
    spans: tuple[_Span, ...]
    forms: tuple[str, ...]


@functools.cache
def _key_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
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

    The escapes are those `_readings` reads (`_ESCAPE`): ``\u`` with four hex digits (or a
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


def _found_in(text: str, keys: re.Pattern[str]) -> _Found:
    """The values after secret arguments' keys in every reading of ``text`` (`_readings`).

    A string's body is to read ``[redacted]``; any other value (a number, a list or an object
    whole) ``"[redacted]"``, its quotes written as its key's are, so that JSON, and JSON
    inside a JSON string, stays valid.
    """
    readings = _readings(text)
    spans: list[_Span] = []
    forms: list[str] = []
    for reading, chain in readings:
        for key, value in _values_after_keys(reading, keys):
            forms.extend(value.forms)
            if value.end == value.start:
                continue
            replacement = REDACTED
            if not value.quoted:
                start, end = _written(chain, key.start(), key.start() + len(key.group("quote")))
                replacement = f"{text[start:end]}{REDACTED}{text[start:end]}"
            spans.append((*_written(chain, value.start, value.end), replacement))
    return _Found(readings=readings, spans=tuple(spans), forms=tuple(forms))


def _readings(text: str) -> _Readings:
    r"""``text``, and what reading its escapes gives, once, twice ... `MAX_DECODED_DEPTH` times.

    Reading decodes every escape that a JSON or a Python string literal decodes (``\u00e9``
    in either case, ``\/``, ``\x5f``, ``\U...``, ``\N{...}``, octal, a backslash before a
    line end), wherever it stands: a string in the text reads as the parsers decode it, JSON
    in a JSON string reads as JSON the second time. It stops when a reading has no escape.
    """
    found: _Readings = [(text, ())]
    for _ in range(MAX_DECODED_DEPTH):
        reading, chain = found[-1]
        read = _read_once(reading)
        if read is None:
            break
        found.append((read.text, (*chain, read)))
    return found


def _read_once(text: str) -> _Reading | None:
    """``text`` with its escapes read (`_readings`); ``None`` when it has none."""
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
        except KeyError:
            return None
    code = int(written, 8 if kind == "octal" else 16)
    return chr(code) if code <= sys.maxunicode else None


def _written(chain: tuple[_Reading, ...], start: int, end: int) -> tuple[int, int]:
    """Where ``[start, end)`` of the last reading of ``chain`` stands in the text read first."""
    for reading in reversed(chain):
        start, end = reading.back(start, end)
    return start, end


def _values_after_keys(text: str, keys: re.Pattern[str]) -> Iterator[tuple[re.Match[str], _Value]]:
    """Each secret argument's key in ``text`` and the value after it, in order.

    White space and Python comments may stand before and after the colon. A key inside the
    value of an earlier one is not read again: each character is looked at a bounded number
    of times.
    """
    gaps = _Gaps(text)
    covered = 0
    for key in keys.finditer(text):
        if key.start() < covered:
            continue
        if key.group("quote") is None:
            value: _Value | None = _parameter_at(text, key.end())
        else:
            colon = gaps.end(key.end())
            if not text.startswith(":", colon):
                continue
            value = _value_at(text, gaps.end(colon + 1))
        if value is not None:
            covered = value.end
            yield key, value


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
        forms = tuple(reading for reading, _ in _readings(body))  # as written, and decoded
        return _Value(start=quote.end(), end=end, quoted=True, forms=forms)
    if text.startswith(("(", "[", "{"), start):
        end = _compound_end(text, start)
        forms = tuple(_forms_of(_decoded(text[start:end])))
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
    """The strings and numbers within ``value`` (booleans and nulls are not secrets)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        yield value


def _forms_of(values: Iterable[object]) -> Iterator[str]:
    """The strings and numbers within ``values`` as text: a number as JSON writes it."""
    for leaf in _leaves(list(values)):
        yield leaf if isinstance(leaf, str) else json.dumps(leaf)


def _value_spans(readings: _Readings, forms: Iterable[str]) -> list[_Span]:
    """Where each of ``forms`` stands in any reading of the text, in the text's offsets.

    A short form (under `WHOLE_WORD_CHARS` characters) that starts or ends with a letter,
    digit or ``_`` counts only where it is not part of a longer word or number (a PIN
    ``1234`` leaves ``12345`` alone); a longer one counts wherever it stands. Each form is
    looked for once in each reading: the work is the text's length times the number of
    distinct forms.
    """
    distinct = {form for form in forms if form and form != REDACTED}
    return [
        (*_written(chain, start, start + len(form)), REDACTED)
        for form in distinct
        for reading, chain in readings
        for start in _places(reading, form)
    ]


def _places(text: str, form: str) -> Iterator[int]:
    """Where ``form`` stands in ``text`` (`_value_spans`), overlapping places too."""
    short = len(form) < WHOLE_WORD_CHARS
    head = short and (form[0].isalnum() or form[0] == "_")
    tail = short and (form[-1].isalnum() or form[-1] == "_")
    start = text.find(form)
    while start >= 0:
        end = start + len(form)
        if not (head and start and _wordy(text[start - 1])) and not (
            tail and end < len(text) and _wordy(text[end])
        ):
            yield start
        start = text.find(form, start + 1)


def _wordy(char: str) -> bool:
    """Whether ``char`` continues a word or a number (a letter, a digit, ``_`` or ``.``)."""
    return char.isalnum() or char in "_."


def _replaced(text: str, spans: Iterable[_Span]) -> str:
    """``text`` with each span replaced.

    Spans that overlap are replaced together, by the first one's replacement.
    """
    merged: list[_Span] = []
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


NO_REDACTION: Final = Redaction()
"""Nothing is secret."""
