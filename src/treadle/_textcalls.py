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


def _unreadable(body: str, names: frozenset[str], error: str | None) -> str:
    """Why call-like ``body`` could not be read: text after its calls, or its JSON error.

    Complete calls followed by text that opens no JSON object or list (a closing remark)
    are said to be so: the decoder's error at that text ("Expecting value: line 2 column
    1") told the model of a mistake in JSON it had written right.
    """
    found = _repair.json_values(body)
    rest = body[found.failed_at :] if found.failed_at is not None else ""
    read = [call_of(item, names, strict=False) for item in _flatten(found.values)]
    if rest[:1] not in ("", "{", "[") and any(isinstance(item, FoundCall) for item in read):
        return "its JSON is followed by text that is not JSON"
    return f"it is not valid JSON ({error})"


def calls_in(span: Span, names: frozenset[str]) -> SpanCalls:
    """Read the tool calls of one span.

    A span whose JSON holds no call-like object is not calls (``is_calls`` false): it is
    ordinary text, e.g. JSON data in an answer. A span that mixes calls with other values,
    or holds a broken call, reports errors.
    """
    values, repairs, error = _decode(span.body)
    if values is None:
        if looks_like_call(span.body, names):
            return SpanCalls(errors=(_unreadable(span.body, names, error),), is_calls=True)
        return SpanCalls()
    read = [call_of(item, names, strict=False) for item in _flatten(values)]
    if all(item is None for item in read):
        return SpanCalls()
    errors = [item for item in read if isinstance(item, str)]
    if any(item is None for item in read):
        errors.append("it mixes tool calls with other JSON values")
    calls = tuple(item for item in read if isinstance(item, FoundCall))
    return SpanCalls(calls=calls, errors=tuple(errors), repairs=repairs, is_calls=True)


# --------------------------------------------------------------------------- chat-template markup

_BLOCKS: Final = (
    ("<tool_call>", ("</tool_call>",)),
    ("<|tool_call|>", ("<|/tool_call|>", "<|tool_call_end|>", "</tool_call>")),
    ("<|tool_call_start|>", ("<|tool_call_end|>",)),
    ("<tool_calls>", ("</tool_calls>",)),
)
"""Open-weight chat templates' call blocks: opener and the closers accepted for it."""
_TAGGED: Final = ("[TOOL_CALLS]", "<|python_tag|>")
"""Markers followed by JSON (or, for Mistral, ``name[ARGS]{...}``) that ends the call."""
_FUNCTION: Final = re.compile(r"<function=(?P<name>[^>\s]*)>")
_MISTRAL_NAMED: Final = re.compile(
    r"\s*(?P<name>[A-Za-z_][\w.-]*)(?:\[CALL_ID\](?P<id>[^\[]*))?\[ARGS\]"
)
MARKERS: Final = (
    "<tool_call>",
    "</tool_call>",
    "<|tool_call|>",
    "<|/tool_call|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<tool_calls>",
    "</tool_calls>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<function=",
    "</function>",
)
"""Every marker of the formats above; one left outside a read call is an error."""


@attrs.frozen(kw_only=True)
class MarkupCalls:
    """The tool calls a reply wrote as chat-template markup in its text.

    Attributes:
        found: the text holds markup (a block, a marker) at all.
        calls: the calls read, in order (only meaningful when ``errors`` is empty).
        spans: the pieces of the text the markup took, in order.
        errors: why the markup cannot be used (unclosed block, bad JSON, unknown tool ...).
        unclosed: some block had no closing marker (the reply may have been cut off).
        repairs: repairs applied while reading (``python_literal``).
    """

    found: bool = False
    calls: tuple[FoundCall, ...] = ()
    spans: tuple[Span, ...] = ()
    errors: tuple[str, ...] = ()
    unclosed: bool = False
    repairs: tuple[str, ...] = ()


class _MarkupReader:
    def __init__(self, text: str, names: frozenset[str]) -> None:
        self.text = text
        self.names = names
        self.calls: list[FoundCall] = []
        self.spans: list[Span] = []
        self.errors: list[str] = []
        self.repairs: list[str] = []
        self.unclosed = False

    def read(self) -> MarkupCalls:
        pos = 0
        while True:
            start, kind = self._next_opener(pos)
            if start is None:
                break
            end = self._read_at(start, kind)
            self.spans.append(Span(start=start, end=end, body=self.text[start:end]))
            pos = end
        outside = "".join(
            self.text[a:b]
            for a, b in zip(
                [0, *(s.end for s in self.spans)],
                [*(s.start for s in self.spans), len(self.text)],
                strict=True,
            )
        )
        stray = [marker for marker in MARKERS if marker in outside]
        if stray:
            self.errors.append(f"{stray[0]} stands outside a complete tool call")
        return MarkupCalls(
            found=bool(self.spans or stray),
            calls=tuple(self.calls),
            spans=tuple(self.spans),
            errors=tuple(self.errors),
            unclosed=self.unclosed,
            repairs=tuple(dict.fromkeys(self.repairs)),
        )

    def _next_opener(self, pos: int) -> tuple[int | None, str]:
        best: tuple[int | None, str] = (None, "")
        openers = [opener for opener, _ in _BLOCKS] + list(_TAGGED)
        for opener in openers:
            at = self.text.find(opener, pos)
            if at >= 0 and (best[0] is None or at < best[0]):
                best = (at, opener)
        function = _FUNCTION.search(self.text, pos)
        if function is not None and (best[0] is None or function.start() < best[0]):
            best = (function.start(), "<function=")
        return best

    def _read_at(self, start: int, kind: str) -> int:
        """Read the markup that starts at ``start``; return where it ends."""
        if kind == "<function=":
            return self._read_function(start, None)
        if kind in _TAGGED:
            return self._read_tagged(start + len(kind), kind)
        closers = dict(_BLOCKS)[kind]
        body_start = start + len(kind)
        found = [(self.text.find(c, body_start), c) for c in closers]
        found = [(at, c) for at, c in found if at >= 0]
        if not found:
            self.unclosed = True
            self.errors.append(f"the {kind} block is not closed")
            return len(self.text)
        at, closer = min(found)
        self._read_body(self.text[body_start:at], kind)
        return at + len(closer)

    def _read_body(self, body: str, kind: str) -> None:
        body = body.strip()
        inner = _repair.strip_code_fence(body)
        body = body if inner is None else inner.strip()
        function = _FUNCTION.match(body)
        if function is not None:
            closed = body.endswith("</function>")
            arguments = body[function.end() : len(body) - len("</function>") if closed else None]
            if not closed:
                self.errors.append(f"the <function={function.group('name')}> block is not closed")
                return
            self._add_named(function.group("name"), arguments, kind)
            return
        if not body:
            self.errors.append(f"the {kind} block is empty")
            return
        values, repairs, error = _decode(body)
        if values is None:
            self.errors.append(f"the {kind} block is not valid JSON ({error})")
            return
        self.repairs.extend(repairs)
        self._add_values(values, kind)

    def _add_values(self, values: Sequence[Any], kind: str) -> None:
        items = _flatten(values)
        if not items:
            self.errors.append(f"the {kind} block holds no tool call")
        for item in items:
            call = call_of(item, self.names, strict=False)
            if not isinstance(call, FoundCall):
                problem = call if isinstance(call, str) else "it is not a tool call object"
                self.errors.append(f"the {kind} block cannot be read: {problem}")
            elif call.name not in self.names:
                self.errors.append(f"{call.name or 'a call without a name'} is not a known tool")
            else:
                self.calls.append(call)

    def _add_named(self, name: str, arguments: str, kind: str) -> None:
        decoded = _repair.decode_arguments(arguments)
        if decoded.arguments is None:
            self.errors.append(f"the arguments of {name or 'a call'} in {kind}: {decoded.error}")
            return
        self.repairs.extend(decoded.repairs)
        if name not in self.names:
            self.errors.append(f"{name or 'a call without a name'} is not a known tool")
            return
        self.calls.append(FoundCall(name=name, arguments=decoded.arguments))

    def _read_function(self, start: int, kind: str | None) -> int:
        match = _FUNCTION.match(self.text, start)
        assert match is not None
        close = self.text.find("</function>", match.end())
        if close < 0:
            self.unclosed = True
            self.errors.append(f"the <function={match.group('name')}> block is not closed")
            return len(self.text)
        self._add_named(match.group("name"), self.text[match.end() : close], kind or "<function>")
        return close + len("</function>")

    def _read_tagged(self, pos: int, kind: str) -> int:
        """JSON after ``[TOOL_CALLS]`` / ``<|python_tag|>``, or Mistral's ``name[ARGS]{...}``."""
        named = _MISTRAL_NAMED.match(self.text, pos) if kind == "[TOOL_CALLS]" else None
        start = named.end() if named is not None else pos
        start = _skip_space(self.text, start)
        try:
            value, end = _repair.raw_decode(self.text, start)
        except ValueError as exc:
            cut = not self.text[start:].strip() or _repair.json_prefix(self.text[start:])
            self.unclosed = self.unclosed or cut
            self.errors.append(f"the call after {kind} is not valid JSON ({exc})")
            return len(self.text)
        if named is not None:
            name = named.group("name")
            if not isinstance(value, dict):
                self.errors.append(f"the arguments of {name} after [ARGS] are not a JSON object")
            elif name not in self.names:
                self.errors.append(f"{name} is not a known tool")
            else:
                call_id = (named.group("id") or "").strip() or None
                self.calls.append(FoundCall(name=name, arguments=value, id=call_id))
        else:
            self._add_values((value,), kind)
        for eom in ("<|eom_id|>", "<|eot_id|>", "</s>"):
            if self.text.startswith(eom, _skip_space(self.text, end)):
                return _skip_space(self.text, end) + len(eom)
        return end


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def markup_calls(text: str, names: frozenset[str]) -> MarkupCalls:
    """Read the tool calls written as chat-template markup in ``text``; pure, never raises.

    Recognised: ``<tool_call>...</tool_call>`` (Hermes, Qwen), ``<|tool_call|>...<|/tool_call|>``
    (and ``<|tool_call_start|>`` / ``<|tool_call_end|>``), ``<tool_calls>...</tool_calls>``,
    each holding a ``{"name": ..., "arguments": {...}}`` object, a list of them, or
    ``<function=name>{...}</function>``; a bare ``<function=name>{...}</function>``
    (Llama); ``[TOOL_CALLS]`` followed by a JSON list of calls or by ``name[ARGS]{...}``
    (Mistral); ``<|python_tag|>`` followed by one call object (Llama).

    Args:
        text: the reply's visible text.
        names: the declared tool names; a call of any other name is an error.

    Returns:
        What was found; ``found`` is false when the text holds no markup at all.
    """
    return _MarkupReader(text, names).read()
