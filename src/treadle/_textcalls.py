"""Finding tool calls written as JSON in a model's text (private; used by `treadle.parsers`).

A call is ``{"name": ..., "arguments": {...}}`` (``parameters`` is accepted for
``arguments``); a JSON list of calls, or several call objects one after another, are several
calls. Everything here is pure and never raises.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

import attrs

from treadle import _repair

_ANY_FENCE: Final = re.compile(
    r"```[ \t]*(?P<lang>[\w+-]*)[ \t]*\r?\n(?P<body>.*?)(?:\r?\n[ \t]*```|\Z)", re.DOTALL
)
_JSON_FENCE_LANGS: Final = frozenset({"", "json", "json5", "jsonc", "tool_call", "tool_calls"})
_BARE_START: Final = re.compile(r"^[ \t]*[{\[]", re.MULTILINE)


@attrs.frozen(kw_only=True)
class FoundCall:
    """One call read from JSON: the tool name, its argument object and its id if given."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@attrs.frozen(kw_only=True)
class Span:
    """A piece of the text that may hold calls: ``text[start:end]``, and its JSON body."""

    start: int
    end: int
    body: str


@attrs.frozen(kw_only=True)
class SpanCalls:
    """What one span holds.

    Attributes:
        calls: the calls found, in order.
        errors: why call-like JSON could not be used (parse errors, broken calls).
        repairs: repairs applied (``python_literal``).
        is_calls: true when the span held tool calls (or tried to); false for other text.
    """

    calls: tuple[FoundCall, ...] = ()
    errors: tuple[str, ...] = ()
    repairs: tuple[str, ...] = ()
    is_calls: bool = False


def _object_arguments(value: Any) -> Any:
    """``value``, or the object a JSON-string ``value`` holds (the OpenAI wire form)."""
    if not isinstance(value, str):
        return value
    found = _repair.json_values(value.strip())
    if found.error is None and len(found.values) == 1 and isinstance(found.values[0], dict):
        return found.values[0]
    return value


def _given_id(obj: dict[str, Any]) -> str | None:
    call_id = obj.get("id")
    return call_id if isinstance(call_id, str) and call_id else None


def call_of(obj: Any, names: frozenset[str], *, strict: bool) -> FoundCall | str | None:
    """Read ``obj`` as a ``{"name": ..., "arguments" | "parameters": {...}}`` tool call.

    Args:
        obj: one decoded JSON value.
        names: the declared tool names.
        strict: only a declared name with an object of arguments counts (native replies,
            whose JSON text may well be an answer); otherwise any name counts, arguments
            may be left out for a declared name, and a broken call is reported.

    Returns:
        The call; an error text for a broken call (only when not ``strict``); ``None`` when
        ``obj`` is not a tool call.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    name: str = obj["name"]
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None:
        if strict or name not in names:
            return None
        return FoundCall(name=name, arguments={}, id=_given_id(obj))
    arguments = _object_arguments(obj[key])
    if isinstance(arguments, dict):
        if strict and name not in names:
            return None
        return FoundCall(name=name, arguments=arguments, id=_given_id(obj))
    return None if strict else f'the "{key}" of the call to {name} must be a JSON object'


def candidates(text: str) -> list[Span]:
    """The pieces of ``text`` that may hold JSON tool calls, in order.

    The whole text when it starts with ``{`` or ``[``; else every fenced block marked as
    JSON or unmarked (an unclosed fence runs to the end); else everything from the first
    line that starts with ``{`` or ``[``.
    """
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        return [Span(start=0, end=len(text), body=stripped)]
    fenced = [
        Span(start=m.start(), end=m.end(), body=m.group("body").strip())
        for m in _ANY_FENCE.finditer(text)
        if m.group("lang").lower() in _JSON_FENCE_LANGS
    ]
    if fenced:
        return fenced
    bare = _BARE_START.search(text)
    if bare is None:
        return []
    return [Span(start=bare.start(), end=len(text), body=text[bare.start() :].strip())]


def looks_like_call(body: str, names: frozenset[str]) -> bool:
    """True when JSON-ish ``body`` clearly tries to be a tool call (for error reporting)."""
    if body[:1] not in ("{", "["):
        return False
    if any(f'"{name}"' in body or f"'{name}'" in body for name in names if name):
        return True
    return '"name"' in body and ('"arguments"' in body or '"parameters"' in body)


def _decode(body: str) -> tuple[tuple[Any, ...] | None, tuple[str, ...], str | None]:
    """Values of ``body`` (strict JSON, else one Python literal), repairs, parse error."""
    found = _repair.json_values(body)
    if found.error is None:
        return found.values, (), None
    literal = _repair.python_literal(body)
    if literal is not None:
        return (literal,), (_repair.PYTHON_LITERAL,), None
    return None, (), found.error


def _flatten(values: Sequence[Any]) -> list[Any]:
    items: list[Any] = []
    for value in values:
        items.extend(value if isinstance(value, list) else [value])
    return items


def calls_in(span: Span, names: frozenset[str]) -> SpanCalls:
    """Read the tool calls of one span.

    A span whose JSON holds no call-like object is not calls (``is_calls`` false): it is
    ordinary text, e.g. JSON data in an answer. A span that mixes calls with other values,
    or holds a broken call, reports errors.
    """
    values, repairs, error = _decode(span.body)
    if values is None:
        if looks_like_call(span.body, names):
            return SpanCalls(errors=(f"it is not valid JSON ({error})",), is_calls=True)
        return SpanCalls()
    read = [call_of(item, names, strict=False) for item in _flatten(values)]
    if all(item is None for item in read):
        return SpanCalls()
    errors = [item for item in read if isinstance(item, str)]
    if any(item is None for item in read):
        errors.append("it mixes tool calls with other JSON values")
    calls = tuple(item for item in read if isinstance(item, FoundCall))
    return SpanCalls(calls=calls, errors=tuple(errors), repairs=repairs, is_calls=True)
