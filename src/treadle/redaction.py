"""Secret tool arguments: kept in the log, redacted on every path out of it.

A tool marks arguments as secret with ``@tool(secret_arguments=("card_number",))``. Their values
stay in the run's log exactly as the model sent them, because a resumed run must execute the
call it decided on, and an approval stays bound to the digest of the real arguments
(`treadle.approvals.arguments_digest`). Everything that shows a log to someone replaces them
with `REDACTED` (docs/events.md, "Secret arguments"):

* events, for subscribers (`treadle.RunHandle.events`) and sinks alike;
* `treadle.RunHandle.pending_approval`;
* ``treadle show``, ``treadle tail`` (both with and without ``--json``) and ``treadle approve``.

What is secret is read from the run's parameter snapshot (key ``secret_arguments``, written
only when some tool has secrets), so a process that has only the store (the command line) redacts
the same values as the driving process. `Redaction.of_log` takes every snapshot of a log (the
run-started one and any accepted definition change) and keeps the union.

`treadle.ports.RunStore.read_log` is not a path out: it returns the log itself.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Final

import attrs

from treadle.types import (
    ActionIntent,
    ApprovalDecided,
    ApprovalRequested,
    DefinitionAccepted,
    Event,
    InvalidToolCall,
    JSONValue,
    Message,
    ModelResult,
    Record,
    RunLog,
    RunStarted,
    StepRecord,
    ToolCall,
)

__all__ = ["REDACTED", "SNAPSHOT_KEY", "Redaction", "secrets_of_tools"]

REDACTED: Final = "[redacted]"
"""What a secret argument's value is replaced with on the way out of the log."""

SNAPSHOT_KEY: Final = "secret_arguments"
"""The parameter-snapshot key: ``{tool name: [argument names, sorted]}``."""


def secrets_of_tools(
    secret_arguments: Iterable[tuple[str, Collection[str]]],
) -> dict[str, JSONValue]:
    """The snapshot value of ``(tool, secret argument names)`` pairs; tools without any left out."""
    return {tool: sorted(names) for tool, names in secret_arguments if names}


@attrs.frozen
class Redaction:
    """Which arguments of which tools are secret, and the redacting of records and events.

    Attributes:
        secrets: tool name -> the names of its secret arguments.
    """

    secrets: Mapping[str, frozenset[str]] = attrs.field(factory=dict)
    _pattern: re.Pattern[str] | None = attrs.field(init=False, eq=False, repr=False)

    @_pattern.default
    def _text_pattern(self) -> re.Pattern[str] | None:
        """The pattern `text` uses, built once: every secret name of every tool."""
        names = frozenset().union(*self.secrets.values())
        return _value_pattern(tuple(sorted(names, key=len, reverse=True))) if names else None

    @classmethod
    def of_snapshot(cls, snapshot: Mapping[str, JSONValue]) -> Redaction:
        """The redaction a parameter snapshot declares (none when it has no secrets key)."""
        declared = snapshot.get(SNAPSHOT_KEY)
        if not isinstance(declared, Mapping):
            return NO_REDACTION
        secrets = {
            tool: frozenset(str(name) for name in names)
            for tool, names in declared.items()
            if isinstance(names, list) and names
        }
        return cls(secrets) if secrets else NO_REDACTION

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
        if not other.secrets:
            return self
        if not self.secrets:
            return other
        tools = set(self.secrets) | set(other.secrets)
        return Redaction(
            {t: self.secrets.get(t, frozenset()) | other.secrets.get(t, frozenset()) for t in tools}
        )

    def __bool__(self) -> bool:
        """Whether anything is secret."""
        return bool(self.secrets)

    def arguments(self, tool: str, arguments: Mapping[str, JSONValue]) -> Mapping[str, JSONValue]:
        """``arguments`` of a call of ``tool`` with the secret values replaced.

        A tool name of ``""`` (a record that does not say) counts every tool's secrets.
        """
        names = self._names(tool)
        if not names or not names.intersection(arguments):
            return arguments
        return {k: REDACTED if k in names else v for k, v in arguments.items()}

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
        if isinstance(record, ModelResult) and record.reply is not None:
            reply = record.reply
            return attrs.evolve(
                record,
                reply=attrs.evolve(
                    reply,
                    text=self.text(reply.text),
                    tool_calls=self._calls(reply.tool_calls),
                    invalid_tool_calls=tuple(self._invalid(c) for c in reply.invalid_tool_calls),
                ),
            )
        if isinstance(record, StepRecord):
            message = record.history_message
            return attrs.evolve(
                record,
                history_message=self._message(message) if message is not None else None,
                model_output_text=self.text(record.model_output_text),
            )
        return record

    def text(self, text: str | None) -> str | None:
        """``text`` with the values of secret arguments written into it as a call replaced.

        A model that writes its calls as text (a JSON object, ``<tool_call>`` markup, a
        ``<parameter=name>`` block) puts the arguments into its visible text, and a parser
        may run them as a call: there, a value after a secret argument's name as a JSON key
        (``"card": "..."``, single quotes too) or inside its ``<parameter=card>`` block is
        replaced. Prose is left as it is (docs/events.md, "Secret arguments").
        """
        if not text or self._pattern is None:
            return text
        return self._pattern.sub(_redact_match, text)

    def request(self, request: ApprovalRequested) -> ApprovalRequested:
        """An approval request as it may leave the log (its secret arguments replaced)."""
        if not self.secrets or request.arguments is None:
            return request
        return attrs.evolve(request, arguments=self.arguments(request.tool, request.arguments))

    def event(self, event: Event) -> Event:
        """``event`` with its record redacted (events without a record unchanged)."""
        if not self.secrets or event.record is None:
            return event
        redacted = self.record(event.record)
        return event if redacted is event.record else attrs.evolve(event, record=redacted)

    def _names(self, tool: str) -> frozenset[str]:
        if tool:
            return self.secrets.get(tool, frozenset())
        return frozenset().union(*self.secrets.values())

    def _calls(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        return tuple(attrs.evolve(c, arguments=self.arguments(c.name, c.arguments)) for c in calls)

    def _invalid(self, call: InvalidToolCall) -> InvalidToolCall:
        # Text that did not parse cannot be redacted value by value: all of it goes, for a
        # tool with secrets or a call without a name.
        if not call.name or call.name in self.secrets:
            return attrs.evolve(call, raw_arguments=REDACTED)
        return call

    def _message(self, message: Message) -> Message:
        return attrs.evolve(
            message,
            content=self.text(message.content),
            tool_calls=self._calls(message.tool_calls),
        )


@functools.cache
def _value_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(name) for name in names)
    return re.compile(
        rf"""(?P<key>(?P<q>["'])(?:{alternatives})(?P=q)\s*:\s*)"""
        r"""(?P<value>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^,}\]\s]+)"""
        rf"""|(?P<tag><parameter=(?:{alternatives})>)(?P<inner>.*?)(?P<end></parameter>|\Z)""",
        re.DOTALL,
    )


def _redact_match(match: re.Match[str]) -> str:
    if match.group("key") is not None:
        return f'{match.group("key")}"{REDACTED}"'
    return f"{match.group('tag')}{REDACTED}{match.group('end')}"


NO_REDACTION: Final = Redaction()
"""Nothing is secret."""
