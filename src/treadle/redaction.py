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

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Final

import attrs

from treadle._secret_text import (
    REDACTED,
    Found,
    forms_of,
    found_in,
    key_pattern,
    readings_of,
    replaced,
    value_spans,
)
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
    or a ``repr`` writes it (as `Redaction.text` replaces values; one shorter than 8
    characters only as a whole word or number), so a message that quotes the whole argument
    object hides it too (docs/events.md, "Secret arguments"). The text is read as
    `Redaction.text` reads it (`readings_of`), so an escaped spelling of a value is found too.
    """
    values = [value for name, value in arguments.items() if name in secrets]
    spans = value_spans(readings_of(text), forms_of(values)) if values and text else []
    return replaced(text, spans) if spans else text


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
    _last_read: list[tuple[str, Found]] = attrs.field(
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
        return key_pattern(tuple(sorted(names, key=len, reverse=True))) if names else None

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
        parsers decode its strings (`readings_of`: every JSON or Python string escape read, up
        to 3 times, for JSON inside a JSON string); in every reading
        (docs/events.md, "Secret arguments"):

        * by key: the value after a secret argument's name as a key (any quotes, a comment
          before or after the colon; a string, a number, a list, an object or a parenthesised
          value whole) or inside its ``<parameter=name>`` block is replaced; the value is read
          in the reading it was written in (a string where its opening quote was, any other
          value where its key's quote was), so a string ending in a backslash ends at its own
          closing quote in every reading;
        * by value: each string and number the ``known`` values (the reply's own parsed
          calls') hold, and then those the values after keys hold, is replaced wherever it
          stands; the first 64 distinct ones (`treadle._secret_text.MAX_SEARCHED_VALUES`).

        A string becomes ``[redacted]`` inside its quotes and any other value after a key
        ``"[redacted]"`` (its quotes written as its key's), so the JSON stays valid; a value
        found only by value becomes ``[redacted]`` bare. Other prose is left as it is.

        The work is linear in the text's length, whatever values the text holds: no decoder
        is handed more than a value after a key, and at most 64 values are looked for. No
        text makes it raise. The text's reading is kept for the next call: the same reply
        text comes again in the step's history.
        """
        if not text or self._pattern is None:
            return text
        found = self._read(text, self._pattern)
        spans = [*found.spans, *value_spans(found.readings, [*forms_of(known), *found.forms])]
        return replaced(text, spans) if spans else text

    def _read(self, text: str, keys: re.Pattern[str]) -> Found:
        """`found_in` ``text``, kept for the next call with the same text.

        A reply's text is redacted in its model result and again in its step's history
        message and output text: it is read once.
        """
        for last, found in self._last_read[:1]:
            if last == text:
                return found
        found = found_in(text, keys)
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


NO_REDACTION: Final = Redaction()
"""Nothing is secret."""
