"""Stale-write protection: resources, their revisions, and what a run observed of them.

See docs/concepts.md, "Stale writes", and docs/decisions/0045-stale-write-protection.md.

A tool declares the resource it reads or writes with a key template over its arguments
(``@tool(reads="reservation:{reservation_id}")``). A reading tool reports the revision of what
it returned by returning `Observed`; the revision is logged with the action's result (in
``ActionResult.outcome.revisions``), and the run's table of observed revisions is folded from
the log (`fold_revisions`), so a resumed run has the same table. Before a writing tool runs,
the executor checks that the run observed the resource and hands the tool the revision the
model saw (``ToolContext.seen_revision``); the tool compares it with the current one inside
its own transaction and raises `StaleWrite` when they differ.

Revisions are integers; 0 is a revision like any other.
"""

from __future__ import annotations

import decimal
import enum
import json
import string
from collections.abc import Collection, Mapping
from typing import Any, Final, Generic, TypeVar

import attrs

from treadle._exceptions import TreadleError, UsageError

__all__ = ["Observed", "ResourceTemplate", "StaleWrite", "check_write", "fold_revisions"]

T = TypeVar("T")

RevisionTable = dict[str, tuple[int, ...]]
"""Resource key -> the distinct revisions a run observed of it, the latest observed last."""

_FORMATTER: Final = string.Formatter()


@attrs.frozen
class Observed(Generic[T]):
    """A tool's return value together with the revision of the resource it shows.

    Return it from a tool declared with ``reads=`` (or ``writes=``, to report the revision a
    write produced): the observation is made from ``value`` as if it had been returned
    alone, and ``revision`` is logged as observed for the tool's resource key.

    Attributes:
        value: what the tool returns (a ``str`` or anything JSON can hold, as for any tool).
        revision: the revision of the resource ``value`` shows (an ``int``; 0 is valid).
        resource: the resource key, when it is not the tool's own (``None``: the key of its
            ``writes=`` template, else of its ``reads=`` template: ``ToolContext.resource``).
    """

    value: T
    revision: int = attrs.field(kw_only=True)
    resource: str | None = attrs.field(default=None, kw_only=True)


class StaleWrite(TreadleError):
    """Raised by a writing tool that found its resource changed since the model read it.

    Raise it inside the tool's transaction, before changing anything: the action becomes
    NOT_EXECUTED, and the model is told, in the definition's ``SyntheticObservations.stale``
    text, that the resource changed since it read it and must be read again
    (docs/concepts.md, "Stale writes").

    Args:
        current: the resource's current revision, when known (shown to the model).
        message: more detail for the model, optional.

    Attributes:
        current: the current revision, or ``None``.
    """

    def __init__(self, current: int | None = None, message: str = "") -> None:
        super().__init__(message or "the resource changed since it was read")
        self.current = current
        self.message = message


@attrs.frozen
class ResourceTemplate:
    """A resource key template over a tool's arguments, e.g. ``reservation:{reservation_id}``.

    Attributes:
        text: the template; each ``{name}`` is replaced by the argument's value
            (`key`).
        fields: the argument names it uses, in order; two of them always have text between
            them (`parse` refuses ``{a}{b}``).
        escaped: characters percent-encoded in a value (``%``, ``"`` and those of the text
            between two fields), so that two calls share a key only when their values are the
            same: under ``file:{owner}/{path}``, owner ``a/b`` and path ``c`` give
            ``file:a%2Fb/c``, never the key of owner ``a`` and path ``b/c``.
    """

    text: str
    fields: tuple[str, ...]
    escaped: frozenset[str] = frozenset('%"')

    @classmethod
    def parse(
        cls,
        text: str,
        *,
        tool: str,
        option: str,
        arguments: Collection[str],
        secret: Collection[str],
    ) -> ResourceTemplate:
        """Check ``text`` against the tool's arguments.

        Raises:
            UsageError: not a string, malformed, a field with a format spec, conversion,
                index or attribute, a field that names no argument, one that names a
                secret argument (the key is logged in the clear), or two fields with no
                text between them (``{a}{b}``: nothing would keep their values apart,
                docs/concepts.md, "Stale writes").
        """
        if not isinstance(text, str) or not text:
            raise UsageError(f"tool {tool!r}: {option} must be a non-empty key template")
        try:
            parts = list(_FORMATTER.parse(text))
        except ValueError as exc:
            raise UsageError(f"tool {tool!r}: {option}={text!r} is malformed: {exc}") from exc
        fields: list[str] = []
        escaped = {"%", '"'}
        between = ""  # the literal text since the last field
        for literal, name, spec, conversion in parts:
            if fields:  # text between two fields separates their values: kept out of them
                escaped.update(literal)
            between += literal
            if name is None:
                continue
            if spec or conversion or not name.isidentifier():
                raise UsageError(
                    f"tool {tool!r}: {option}={text!r}: a field is a bare argument name, "
                    f"as in {{reservation_id}}"
                )
            if name not in arguments:
                raise UsageError(f"tool {tool!r}: {option}={text!r} names no argument {name!r}")
            if name in secret:
                raise UsageError(
                    f"tool {tool!r}: {option}={text!r} uses the secret argument {name!r}; "
                    "resource keys are logged in the clear"
                )
            if fields and not between:
                raise UsageError(
                    f"tool {tool!r}: {option}={text!r}: fields {{{fields[-1]}}} and "
                    f"{{{name}}} have no text between them, so different values would share "
                    f"a key; separate them, as in {{{fields[-1]}}}:{{{name}}}"
                )
            between = ""
            fields.append(name)
        return cls(text=text, fields=tuple(fields), escaped=frozenset(escaped))

    def key(self, arguments: Mapping[str, Any]) -> str:
        """The resource key of a call, from its validated arguments.

        Each value is written as `_written` writes it, its characters in `escaped`
        percent-encoded (their UTF-8 bytes); a string that would read as a value of another
        type is in double quotes (``acct:"7"``, not the key of the number ``7``), so values of
        different JSON types never share a key (docs/concepts.md, "Stale writes").
        """
        return self.text.format_map({name: self._value(arguments[name]) for name in self.fields})

    def _value(self, value: Any) -> str:
        """One value as it stands in a key (`key`)."""
        text, quoted = _written(value)
        escaped = self._escape(text)
        return f'"{escaped}"' if quoted else escaped

    def _escape(self, value: str) -> str:
        if not any(ch in self.escaped for ch in value):
            return value
        return "".join(
            "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
            if ch in self.escaped
            else ch
            for ch in value
        )


def _written(value: Any) -> tuple[str, bool]:
    """An argument's value as text for a key, and whether it is a string to be quoted.

    ``None`` is ``null``, a boolean ``true`` or ``false``, a number (a ``Decimal`` too) its
    digits (``str``), a list or a dict its JSON text, an enum member its value written so. A
    string, and a value of any other type (a date, a UUID: a string in the call) as ``str``
    writes it, is written as it is, unless a number or JSON would read it
    (`_reads_as_another_type`): then it is to be quoted. So the text of a value that is no
    string never reads the same as a string.
    """
    if isinstance(value, enum.Enum):
        return _written(value.value)
    if value is None:
        return "null", False
    if isinstance(value, bool):
        return ("true" if value else "false"), False
    if isinstance(value, int | float | decimal.Decimal):
        return str(value), False
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, ensure_ascii=False, default=str), False
    text = str(value)
    return text, _reads_as_another_type(text)


def _reads_as_another_type(text: str) -> bool:
    """Whether ``text``, unquoted, reads as a number (``float``) or as JSON (``null``, ``[1]``).

    Every value that is no string is written as such a text (`_written`).
    """
    try:
        float(text)
    except ValueError:
        pass
    else:
        return True
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # not JSON; nested past what the decoder follows
        return False
    return True


def is_revision(value: object) -> bool:
    """True for an ``int`` revision (a ``bool`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def fold_revisions(table: RevisionTable, revisions: Mapping[str, int]) -> None:
    """Record, in place, the revisions one applied action result observed.

    A revision seen again moves to the end: the last one of a key is the latest observed.
    """
    for key, revision in revisions.items():
        seen = table.get(key, ())
        table[key] = (*(r for r in seen if r != revision), revision)


def check_write(key: str, observed: Mapping[str, tuple[int, ...]], base: int | None) -> int | str:
    """The revision the model saw of ``key``, or why the write is refused.

    Only the run's own reads count, not those of the history it continues (a thread's
    earlier runs, a fork's prefix): the refusal says so, since the model may see such a read
    in its history (docs/concepts.md, "Stale writes";
    docs/decisions/0140-a-run-writes-from-its-own-reads.md).

    Args:
        key: the resource key of the write.
        observed: the run's observed revisions before the step (`RevisionTable`).
        base: the base revision the model passed, ``None`` when it passed none.

    Returns:
        ``base`` when the run observed it, else the latest revision observed; a ``str``
        (the refusal's detail, for the model) when the run never observed the resource or
        never observed ``base``.
    """
    seen = observed.get(key, ())
    if not seen:
        return (
            f"{key} was not read in this run (a read from before it, earlier in the "
            "conversation, does not count); read it now, then change it from what you read"
        )
    if base is None:
        return seen[-1]
    if base not in seen:
        listed = ", ".join(str(r) for r in sorted(seen))
        return (
            f"revision {base} of {key} was never read in this run (read: {listed}); "
            "read it again and pass the revision you read"
        )
    return base
