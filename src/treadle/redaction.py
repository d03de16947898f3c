"""Secret tool arguments: kept in the log, redacted on every path out of it.

A tool marks arguments as secret with ``@tool(secret_arguments=("card_number",))``. Their values
stay in the run's log exactly as the model sent them, because a resumed run must execute the
call it decided on, and an approval stays bound to the digest of the real arguments (a keyed
one: `treadle.approvals.request_digest`). Everything that shows a log to someone replaces them
with `REDACTED` (docs/events.md, "Secret arguments"):

* events, for subscribers (`treadle.RunHandle.events`) and sinks alike (a run with secrets
  streams no text deltas: `Redaction.streams`);
* `treadle.RunHandle.pending_approval`;
* `treadle.history` (every run of the chain, each by its own snapshots);
* ``treadle show``, ``treadle tail`` (both with and without ``--json``) and ``treadle approve``.

Free text on those paths (the model's text, a model error's message, the final answer, a failed
run's error) goes through `Redaction.text`. A secret value is hidden wherever it stands in what a
reply holds, not only under its own key: under the secret argument's name one level down or more
(arguments the model wrapped in another object), and by value in every other string and number
of the reply's calls, the other calls of the same reply included, and of the records of the step
that show them (`Redaction.arguments`, `Redaction.learn`). Text that treadle writes itself about
a call (why it was not executed, why an approval's edit was refused) never holds a secret value to
begin with: its writers pass it through `without_secret_values`, the same by-value replacement.

What is secret is read from the run's parameter snapshot (key ``secret_arguments``, written
only when some tool has secrets), so a process that has only the store (the command line) redacts
the same values as the driving process. `Redaction.of_log` takes every snapshot of a log (the
run-started one and any accepted definition change) and keeps the union.

`treadle.ports.RunStore.read_log` is not a path out: it returns the log itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Final

import attrs

from treadle._secret_text import (
    REDACTED,
    Found,
    distinct_forms,
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
    ModelErrorInfo,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
    ToolCall,
)

__all__ = [
    "REDACTED",
    "SNAPSHOT_KEY",
    "Redaction",
    "secret_values",
    "secrets_of_tools",
    "without_secret_values",
]


SNAPSHOT_KEY: Final = "secret_arguments"
"""The parameter-snapshot key: ``{tool name: [argument names, sorted]}``."""


def secrets_of_tools(
    secret_arguments: Iterable[tuple[str, Collection[str]]],
) -> dict[str, JSONValue]:
    """The snapshot value of ``(tool, secret argument names)`` pairs; tools without any left out."""
    return {tool: sorted(names) for tool, names in secret_arguments if names}


def secret_values(arguments: JSONValue, secrets: Collection[str]) -> list[JSONValue]:
    """The values ``arguments`` gives the names in ``secrets``, at any depth, in order.

    A model that wraps its arguments in another object (``{"arguments": {"card_number":
    ...}}``) or a list puts a secret argument one level down or more: its value is found
    there too. The walk is iterative, so a value nested as deep as a decoder allows is walked.
    """
    found: list[JSONValue] = []
    stack = [arguments]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            for key, value in item.items():
                if key in secrets:
                    found.append(value)
            stack.extend(v for k, v in reversed(list(item.items())) if k not in secrets)
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
    return found


def without_secret_values(
    text: str,
    arguments: Mapping[str, JSONValue],
    secrets: Collection[str],
    *,
    known: Iterable[JSONValue] = (),
) -> str:
    """``text`` with the values ``arguments`` gives the names in ``secrets`` replaced.

    For text written about one call whose arguments are at hand: why it was not executed
    (an argument check quoting what it got), why an edit of it was refused. Each string or
    number within each secret value (at any depth of ``arguments``: `secret_values`), and
    within each of ``known`` (the secret values of the other calls of the same step),
    becomes `REDACTED` wherever it stands, in each form JSON or a ``repr`` writes it (as
    `Redaction.text` replaces values; one shorter than 8 characters only as a whole word or
    number), so a message that quotes the whole argument object hides it too
    (docs/events.md, "Secret arguments"). The text is read as `Redaction.text` reads it
    (`readings_of`), so an escaped spelling of a value is found too.
    """
    values = [*secret_values(arguments, secrets), *known]
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

    It also keeps, per step, the secret values the step's replies hold (`learn`): the
    records of a step that show one call's arguments (an action intent, an approval request,
    an edit's decision) hide the other calls' secret values too. That memory is the one part
    that changes: a run's actors share one redaction, and the coordinator has it learn each
    reply before it acts on it.
    """

    secrets: Mapping[str, frozenset[str]] = attrs.field(factory=dict)
    tools: frozenset[str] = frozenset()
    _names: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    _pattern: re.Pattern[str] | None = attrs.field(init=False, eq=False, repr=False)
    _last_read: list[tuple[str, Found]] = attrs.field(
        init=False, factory=list, eq=False, repr=False
    )
    _learnt: dict[int, tuple[str, ...]] = attrs.field(
        init=False, factory=dict, eq=False, repr=False
    )
    """Step -> the strings and numbers (as text: `forms_of`) its replies' secret values hold."""

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
        """The union of the redactions of every snapshot in ``log``, every reply learnt.

        A new instance whenever something is secret: what it learns is its own.
        """
        found = NO_REDACTION
        for record in log.records:
            if isinstance(record, RunStarted | DefinitionAccepted):
                found = found | cls.of_snapshot(record.snapshot)
        for record in log.records if found else ():
            found.learn(record)
        return found

    def __or__(self, other: Redaction) -> Redaction:
        """Both redactions at once: an argument secret in either is secret.

        What either learnt (`learn`) is known to the result.
        """
        if other.tools <= self.tools and not other.secrets:
            return self
        if self.tools <= other.tools and not self.secrets:
            return other
        none: frozenset[str] = frozenset()
        secret = set(self.secrets) | set(other.secrets)
        both = Redaction(
            {t: self.secrets.get(t, none) | other.secrets.get(t, none) for t in secret},
            self.tools | other.tools,
        )
        for learnt in (self._learnt, other._learnt):
            for step, forms in learnt.items():
                both._remember(step, forms)
        return both

    def __bool__(self) -> bool:
        """Whether anything is secret."""
        return bool(self.secrets)

    def learn(self, record: Record) -> None:
        """Remember the secret values a model result's reply holds, for the rest of its step.

        The records of the step that show a call's arguments without the reply (an action
        intent, an approval request, an edit's decision) then hide them too, wherever they
        stand (`record`; docs/events.md, "Secret arguments"). A reply's secret values: those
        under a secret argument's name in its calls, at any depth (`secret_values`), and those
        after a secret key in its text, in its calls' strings and in its invalid calls' raw
        text. Other records, and any record when nothing is secret, teach nothing. Learning a
        reply again changes nothing.
        """
        if not self.secrets or not isinstance(record, ModelResult) or record.reply is None:
            return
        reply = record.reply
        forms = self._forms_of(
            self._read_calls(reply.tool_calls), reply.text, reply.invalid_tool_calls
        )
        if forms:
            self._remember(record.step, forms)

    def _remember(self, step: int, forms: Iterable[str]) -> None:
        """Add ``forms`` to what is known of ``step``, each once, in the order first met."""
        self._learnt[step] = tuple(dict.fromkeys((*self._learnt.get(step, ()), *forms)))

    def _known(self, step: int | None) -> tuple[str, ...]:
        """The secret values learnt of ``step`` (none for ``None``)."""
        return () if step is None else self._learnt.get(step, ())

    def arguments(
        self, tool: str, arguments: Mapping[str, JSONValue], *, known: Iterable[JSONValue] = ()
    ) -> Mapping[str, JSONValue]:
        """``arguments`` of a call of ``tool`` as they may leave the log.

        * By key: the value of each of ``tool``'s secret arguments is `REDACTED`, at any depth
          (arguments the model wrapped in another object, or listed). A tool name of ``""``
          (a record that does not say), or one of no declared tool (`tools`), counts every
          tool's secrets.
        * By value: every other string, a key too, is redacted as `text` redacts text, and a
          number becomes `REDACTED` when it is one of the values looked for: the secret values
          of this call (`secret_values`, and those `text` finds after a key inside its
          strings), then ``known`` (the other calls' of the same reply).

        The same object when nothing is hidden. No argument object makes it raise.
        """
        if self._pattern is None:
            return arguments
        return self._shown(self._read_call(tool, arguments), forms_of(known))

    def hides(
        self, tool: str, arguments: Mapping[str, JSONValue], *, step: int | None = None
    ) -> bool:
        """Whether ``arguments`` of a call of ``tool`` in ``step`` are shown other than they are.

        True for a call with a secret argument, and for one whose other arguments hold a
        secret value of its step's reply (`arguments`, with what `learn` learnt of ``step``).
        """
        return self.arguments(tool, arguments, known=self._known(step)) is not arguments

    def streams(self, channel: str) -> bool:
        """Whether live deltas of ``channel`` (``text`` or ``reasoning``) may leave the run.

        Text deltas of a run whose tools declare secret arguments do not: a call the model
        writes into its text carries its secret values before any parser has read them, so
        no delta can be redacted as it arrives. The model's whole text still comes, redacted,
        in the model-call-finished event (docs/events.md, "Secret arguments").
        """
        return channel != "text" or not self.secrets

    def record(self, record: Record) -> Record:
        """``record`` as it may leave the log: secret argument values replaced.

        A model result and a step record hide the secret values their own reply holds
        wherever they stand; an action intent, an approval request and an edit's decision
        those of their step's replies that `learn` learnt, and their own.
        """
        if not self.secrets:
            return record
        if isinstance(record, ActionIntent):
            known = self._known(record.step)
            return attrs.evolve(
                record, arguments=self.arguments(record.tool, record.arguments, known=known)
            )
        if isinstance(record, ApprovalRequested):
            return self.request(record)
        if isinstance(record, ApprovalDecided) and record.edited_arguments is not None:
            known = self._known(record.step)
            edited = self.arguments(record.tool, record.edited_arguments, known=known)
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
            return self._step(record)
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
        return _hidden(text, self._read(text, self._pattern), distinct_forms(forms_of(known)))

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
        """An approval request as it may leave the log (`record`: its arguments redacted)."""
        if not self.secrets or request.arguments is None:
            return request
        known = self._known(request.step)
        arguments = self.arguments(request.tool, request.arguments, known=known)
        return attrs.evolve(request, arguments=arguments)

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
            read = self._read_calls(reply.tool_calls)
            known = self._forms_of(read, reply.text, reply.invalid_tool_calls)
            reply = attrs.evolve(
                reply,
                text=self.text(reply.text, known=known),
                tool_calls=self._calls(reply.tool_calls, read, known),
                invalid_tool_calls=tuple(self._invalid(c, known) for c in reply.invalid_tool_calls),
            )
        return attrs.evolve(record, reply=reply, error=self._model_error(record.error))

    def _step(self, record: StepRecord) -> StepRecord:
        """The step's history message and output text redacted.

        With the secret values its message holds, and those learnt of its step's replies.
        """
        message = record.history_message
        if message is None:
            known = [*self._known(record.step)]
            return attrs.evolve(
                record, model_output_text=self.text(record.model_output_text, known=known)
            )
        read = self._read_calls(message.tool_calls)
        known = [*self._known(record.step), *self._forms_of(read, message.content, ())]
        shown = attrs.evolve(
            message,
            content=self.text(message.content, known=known),
            tool_calls=self._calls(message.tool_calls, read, known),
        )
        return attrs.evolve(
            record,
            history_message=shown,
            model_output_text=self.text(record.model_output_text, known=known),
        )

    def _model_error(self, error: ModelErrorInfo | None) -> ModelErrorInfo | None:
        """``error`` with its message redacted as text (a server may quote the arguments)."""
        if error is None or not error.message:
            return error
        return attrs.evolve(error, message=self.text(error.message) or "")

    def _read_calls(self, calls: Iterable[ToolCall]) -> list[_CallRead]:
        """Each of ``calls`` read for redaction (`_read_call`)."""
        return [self._read_call(call.name, call.arguments) for call in calls]

    def _read_call(self, tool: str, arguments: Mapping[str, JSONValue]) -> _CallRead:
        """The arguments of a call of ``tool`` read for redaction, each string once."""
        names = self._names_of(tool)
        found: dict[str, Found] = {}
        for string in _strings(arguments):
            if string not in found:
                found[string] = self._found(string)
        forms = [*forms_of(secret_values(arguments, names))]
        forms += [form for read in found.values() for form in read.forms]
        return _CallRead(names=names, arguments=arguments, found=found, forms=tuple(forms))

    def _forms_of(
        self, calls: Iterable[_CallRead], text: str | None, invalid: Iterable[InvalidToolCall]
    ) -> list[str]:
        """The secret values a reply (its calls, its text, its invalid calls) holds, as text.

        Each call's (`_CallRead.forms`), then those after a secret key in ``text`` (`text`'s
        reading of it, kept for its redaction) and in the raw text of the ``invalid`` calls.
        """
        forms = [form for call in calls for form in call.forms]
        if text and self._pattern is not None:
            forms += self._read(text, self._pattern).forms
        for call in invalid:
            forms += self._found(call.raw_arguments).forms
        return forms

    def _found(self, text: str) -> Found:
        """`found_in` ``text``, not kept (the reply's text keeps its place in `_read`)."""
        if self._pattern is None or not text:
            return Found(readings=[(text, ())], spans=(), forms=())
        return found_in(text, self._pattern)

    def _shown(self, call: _CallRead, known: Iterable[str]) -> Mapping[str, JSONValue]:
        """A call's arguments as they may leave the log (`arguments`).

        The values looked for are the call's own secret values, then ``known``: the first
        `MAX_SEARCHED_VALUES` distinct ones.
        """
        forms = distinct_forms([*call.forms, *known])

        def leaf(value: JSONValue) -> JSONValue:
            if isinstance(value, str):
                return _hidden(value, call.found[value], forms) if value else value
            return _number(value, forms)

        shown: Mapping[str, JSONValue] = _shown(call.arguments, call.names, leaf)
        return shown

    def _calls(
        self, calls: Iterable[ToolCall], read: Iterable[_CallRead], known: Iterable[str]
    ) -> tuple[ToolCall, ...]:
        """``calls`` (``read`` as `_read_call` reads them) with their arguments redacted."""
        known = tuple(known)
        return tuple(
            attrs.evolve(call, arguments=self._shown(found, known))
            for call, found in zip(calls, read, strict=True)
        )

    def _invalid(self, call: InvalidToolCall, known: Iterable[str]) -> InvalidToolCall:
        """``call`` with its raw text redacted.

        Text that did not parse cannot be redacted value by value: all of it goes, for a
        tool with secrets, a call without a name or one of an undeclared tool. Another
        tool's is redacted as `text` redacts text, with the reply's secret values ``known``.
        """
        if self._names_of(call.name or ""):
            return attrs.evolve(call, raw_arguments=REDACTED)
        raw = call.raw_arguments
        hidden = _hidden(raw, self._found(raw), distinct_forms(known)) if raw else raw
        return call if hidden == raw else attrs.evolve(call, raw_arguments=hidden)


def _hidden(text: str, found: Found, forms: list[str]) -> str:
    """``text`` (read as ``found``) with the values after keys and the ``forms`` replaced.

    The values looked for are ``forms``, then those after keys (`Redaction.text`).
    """
    spans = [*found.spans, *value_spans(found.readings, [*forms, *found.forms])]
    return replaced(text, spans) if spans else text


def _number(value: JSONValue, forms: list[str]) -> JSONValue:
    """`REDACTED` for a number that is one of ``forms`` (a short one as a whole number).

    Anything else as it is: a boolean or null is no secret, and an integer too long for
    Python to write (over 4300 digits) has no form to compare.
    """
    if not isinstance(value, int | float) or isinstance(value, bool) or not forms:
        return value
    try:
        written = json.dumps(value)
    except ValueError:  # int.__str__'s digit limit
        return value
    return REDACTED if value_spans(readings_of(written), forms) else value


@attrs.frozen
class _CallRead:
    """A call's arguments as `Redaction` reads them before it redacts them.

    Attributes:
        names: the names of the call's secret arguments (`Redaction._names_of`).
        arguments: the arguments.
        found: for each string they hold (keys too), what `found_in` reads in it.
        forms: the secret values they hold, as text (`forms_of`): under ``names`` at any
            depth (`secret_values`), then after a secret key inside their strings.
    """

    names: frozenset[str]
    arguments: Mapping[str, JSONValue]
    found: Mapping[str, Found]
    forms: tuple[str, ...]


def _strings(value: JSONValue) -> Iterator[str]:
    """The strings within ``value``, keys too, in no particular order (an iterative walk)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, Mapping):
            yield from (key for key in item if isinstance(key, str))
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


@attrs.define
class _Rebuilding:
    """An object or a list `_shown` is rebuilding.

    Attributes:
        source: the object or list as it was.
        entries: its entries not yet looked at: ``(key, value)``; a list's keys are its
            indexes.
        keys: the keys of the entries looked at, as shown.
        values: their values, as shown.
        changed: whether any key or value shown differs from the source's.
        key: the key (as shown) of the entry whose value is being rebuilt below this one.
    """

    source: JSONValue
    entries: Iterator[tuple[JSONValue, JSONValue]]
    keys: list[JSONValue] = attrs.Factory(list)
    values: list[JSONValue] = attrs.Factory(list)
    changed: bool = False
    key: JSONValue = None

    @classmethod
    def of(cls, source: JSONValue) -> _Rebuilding:
        """The rebuilding of an object or a list, nothing looked at yet."""
        entries = iter(source.items()) if isinstance(source, Mapping) else enumerate(source)
        return cls(source=source, entries=entries)

    def add(self, key: JSONValue, value: JSONValue, *, changed: bool) -> None:
        """One entry as shown; ``changed``: it differs from the source's."""
        self.keys.append(key)
        self.values.append(value)
        self.changed = self.changed or changed

    def result(self) -> JSONValue:
        """The object or list as shown: the source itself when nothing changed."""
        if not self.changed:
            return self.source
        if isinstance(self.source, Mapping):
            return dict(zip(self.keys, self.values, strict=True))
        return self.values


def _shown(
    value: JSONValue, names: frozenset[str], leaf: Callable[[JSONValue], JSONValue]
) -> JSONValue:
    """``value`` with the value of each key in ``names`` `REDACTED` at any depth.

    Every other string or number (a key too) is shown as ``leaf`` gives it. An object or list
    in which nothing changed is the same object. The walk is iterative, so a value nested as
    deep as a decoder allows is walked too.
    """
    if not isinstance(value, Mapping | list | tuple):
        return leaf(value)
    stack = [_Rebuilding.of(value)]
    while True:
        top = stack[-1]
        entry = next(top.entries, None)
        if entry is None:
            stack.pop()
            done = top.result()
            if not stack:
                return done
            stack[-1].add(stack[-1].key, done, changed=done is not top.source)
            continue
        key, item = entry
        shown_key = key
        if isinstance(top.source, Mapping):
            shown_key = leaf(key) if isinstance(key, str) else key
            if key in names:
                top.add(shown_key, REDACTED, changed=True)
                continue
        if isinstance(item, Mapping | list | tuple):
            top.key = shown_key
            top.changed = top.changed or shown_key is not key
            stack.append(_Rebuilding.of(item))
            continue
        shown = leaf(item)
        top.add(shown_key, shown, changed=shown is not item or shown_key is not key)


NO_REDACTION: Final = Redaction()
"""Nothing is secret."""
