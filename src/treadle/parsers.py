"""Decision parsers: turn a model reply into actions, a final answer or an invalid decision.

Both parsers implement `treadle.ports.DecisionParser` and **never raise** for any reply
(docs/seams.md, "Decision parser"). They are pure: parsing the same stored reply again (on resume)
gives the
same decision, synthesised call ids included.

* `NativeToolCallParser`: for models with native tool calling. The model client puts
  complete calls into ``ModelReply.tool_calls`` (arguments decoded) and calls whose argument
  text is not a JSON object into ``ModelReply.invalid_tool_calls`` (reason ``unparseable``
  with the raw text, or ``truncated`` when cut by the output limit). Safe repairs are
  applied to the unparseable ones; anything else becomes an invalid decision.
* `JsonToolCallParser`: for models without native tool calling, which write calls as JSON
  in their text: ``{"name": ..., "arguments": {...}}`` or a list of such objects, bare or
  in a fenced block.

How the history is to be replayed (for the context hydrator):

* ``ParsedReply.history_message`` is the assistant message exactly as it must be replayed:
  content ``None`` for a tool-only turn (never ``""`` or ``"None"``), and sanitised calls: a
  call whose arguments could not be used is kept with arguments ``{}`` so that every call id
  can still be answered by a tool message (for an invalid decision, with the feedback).
* An action whose ``call_id`` is not among ``history_message.tool_calls`` (the empty id of a
  text-reply tool, or a call written as JSON text) is not a native tool call: its
  observation goes back as a user message.

Tool arguments are strict JSON: a number JSON cannot represent (``NaN``, ``Infinity``, or a
literal like ``1e999`` that overflows to infinity) makes the reply an invalid decision
(reason ``non_finite_number``) with feedback, whichever parser produced the calls
(`refuse_non_finite`; the run coordinator applies it to every parser's decision), so what
is validated, stored and run is the same data (docs/models.md, "Tool arguments"). Arguments
nested deeper than `MAX_ARGUMENT_DEPTH` are refused the same way (reason
``nested_too_deep``): no store, validator or encoder has to follow them down.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from treadle import _repair, _textcalls
from treadle.types import (
    DecisionKind,
    InvalidToolCall,
    Message,
    ModelReply,
    ParsedReply,
    ToolCall,
    ToolSpec,
)

__all__ = [
    "EMPTY_REPLY",
    "INVALID_MARKUP",
    "MAX_ARGUMENT_DEPTH",
    "NESTED_TOO_DEEP",
    "NON_FINITE_NUMBER",
    "REFUSAL",
    "SYNTHESISED_CALL_ID",
    "TOOL_CALL_FROM_CONTENT",
    "TOOL_CALL_MARKUP",
    "TRUNCATED",
    "JsonToolCallParser",
    "NativeToolCallParser",
    "argument_problem",
    "refuse_non_finite",
    "strict_arguments",
    "synthesise_call_id",
]

TOOL_CALL_FROM_CONTENT: Final = "tool_call_from_content"
"""Repair: a native-tools reply wrote its one tool call as JSON in the content."""
SYNTHESISED_CALL_ID: Final = "synthesised_call_id"
"""Repair: a native call had an empty or repeated id; a deterministic one was made up."""
TOOL_CALL_MARKUP: Final = "tool_call_markup_in_text"
"""Repair: the reply wrote its calls as chat-template markup (``<tool_call>`` ...) in its text."""
INVALID_MARKUP: Final = "invalid_tool_call_markup"
"""Invalid-decision reason: tool-call markup in the text that cannot be read as calls."""

EMPTY_REPLY: Final = "empty_reply"
"""Invalid-decision reason: neither visible text nor a tool call."""
REFUSAL: Final = "refusal"
"""Final-answer reason: the model refused (``ModelReply.refusal``), or the provider stopped
its reply (finish reason ``content_filter``: Anthropic ``refusal``, ``SAFETY`` ...)."""
TRUNCATED: Final = "truncated"
"""Invalid-decision reason: the output token limit cut a call (or the whole reply) short."""
NON_FINITE_NUMBER: Final = "non_finite_number"
"""Invalid-decision reason: a call's arguments hold NaN or an infinity (not strict JSON)."""
NESTED_TOO_DEEP: Final = "nested_too_deep"
"""Invalid-decision reason: a call's arguments are nested deeper than `MAX_ARGUMENT_DEPTH`."""
MAX_ARGUMENT_DEPTH: Final = 64
"""The deepest nesting of objects and arrays a call's arguments may have (the arguments
object itself is level 1). Deeper data is refused before anything walks it recursively:
Python's JSON encoder and decoder, orjson (255 levels) and schema validation each have a
depth limit of their own, and a run must not fail on one at every resume."""

_MAX_NAMES_LISTED: Final = 20


def synthesise_call_id(*parts: str) -> str:
    """A deterministic call id (``call_`` + 24 hex digits) derived from ``parts``."""
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()
    return f"call_{digest[:24]}"


def _visible(text: str | None) -> str | None:
    """``text`` when it holds anything but whitespace, else ``None``."""
    return text if text is not None and text.strip() else None


def _declared(tools: Sequence[ToolSpec]) -> frozenset[str]:
    return frozenset(spec.name for spec in tools)


def _history(reply: ModelReply, content: str | None, calls: Sequence[ToolCall] = ()) -> Message:
    return Message(
        role="assistant",
        content=content,
        tool_calls=tuple(calls),
        reasoning=reply.reasoning,
        reasoning_signature=reply.reasoning_signature,
    )


def _dedup(items: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _label(call_id: str, name: str) -> str:
    return f"Tool call {call_id} ({name or 'no tool name'})"


def _tool_list(names: frozenset[str]) -> str:
    ordered = sorted(names)
    listed = ", ".join(ordered[:_MAX_NAMES_LISTED])
    return listed + (", ..." if len(ordered) > _MAX_NAMES_LISTED else "")


def _empty_reply(reply: ModelReply, names: frozenset[str]) -> ParsedReply:
    """The invalid decision for a reply with neither visible text nor a tool call."""
    if reply.finish_reason == "length":
        reason, why = TRUNCATED, "reached the output token limit before writing anything visible"
    else:
        reason, why = EMPTY_REPLY, "was empty: it had neither text nor a tool call"
    feedback = f"Your reply {why}. Answer with text"
    feedback += f", or call one of the tools: {_tool_list(names)}." if names else "."
    return ParsedReply(
        kind=DecisionKind.INVALID,
        feedback=feedback,
        reason=reason,
        history_message=_history(reply, None),
    )


def _text_answer(reply: ModelReply) -> ParsedReply:
    """The decision taking the reply's visible text as the final answer (rule 5 of the parsers)."""
    text = _visible(reply.text)
    return ParsedReply(
        kind=DecisionKind.FINAL_ANSWER, text=text, history_message=_history(reply, text)
    )


def _read_from_text(parsed: ParsedReply) -> bool:
    """Whether `NativeToolCallParser` made ``parsed``'s call out of a text reply.

    That is a call written as JSON in the content (repair `TOOL_CALL_FROM_CONTENT`, also when
    `refuse_non_finite` refused it since), or the text-reply tool's call (its empty call id).
    The text may be a structured answer instead (docs/structured-output.md, "Native or a
    final-answer tool"); calls `JsonToolCallParser` reads are not guesses: that is how its
    model calls.
    """
    return TOOL_CALL_FROM_CONTENT in parsed.repairs or any(call.id == "" for call in parsed.actions)


def _refused(reply: ModelReply) -> bool:
    """A refusal without any tool call (a call beside a refusal is parsed as a call).

    A refusal is a refusal text, or a reply the provider stopped: finish reason
    ``content_filter`` (docs/models.md, "Replies, finish reasons, reasoning").
    """
    return (
        (_visible(reply.refusal) is not None or reply.finish_reason == "content_filter")
        and not reply.tool_calls
        and not reply.invalid_tool_calls
    )


def _refusal(reply: ModelReply) -> ParsedReply:
    """The decision on a refusal: the final answer, marked ``reason="refusal"``.

    The answer is the visible text when there is any, else the refusal's text. Of a reply
    the provider stopped (``content_filter``), the text is what came before the stop, no
    answer: the answer is then the refusal's text, or else a note naming the provider's
    finish reason. History keeps the answer as the assistant's content, so the model sees
    what it said, and never the text the provider stopped.
    """
    text: str | None
    if reply.finish_reason == "content_filter":
        reason = reply.provider_finish_reason or reply.finish_reason
        text = _visible(reply.refusal) or f"No answer: the provider stopped the reply ({reason})."
    else:
        text = _visible(reply.text) or reply.refusal
    return ParsedReply(
        kind=DecisionKind.FINAL_ANSWER,
        text=text,
        reason=REFUSAL,
        history_message=_history(reply, text),
    )


# --------------------------------------------------------------------------- native calls


@attrs.frozen(kw_only=True)
class _Problem:
    """A call that cannot be executed: its sanitised form, a reason and a message."""

    call: ToolCall
    reason: str
    message: str


@attrs.frozen(kw_only=True)
class _Collected:
    """The calls of one reply in history order (sanitised), problems and repairs."""

    calls: tuple[ToolCall, ...] = ()
    problems: tuple[_Problem, ...] = ()
    repairs: tuple[str, ...] = ()


class _Collector:
    """Gathers the native calls of one reply, making every call id present and unique."""

    def __init__(self, reply: ModelReply, no_arguments: frozenset[str] = frozenset()) -> None:
        self._reply = reply
        self._no_arguments = no_arguments
        self._seen: set[str] = set()
        self.calls: list[ToolCall] = []
        self.problems: list[_Problem] = []
        self.repairs: list[str] = []

    def call_id(self, given: str, index: int, name: str) -> str:
        call_id = given
        if not call_id or call_id in self._seen:
            parts = (self._reply.response_id or "", "native", str(index), name, given)
            call_id = synthesise_call_id(*parts)
            self.repairs.append(SYNTHESISED_CALL_ID)
        self._seen.add(call_id)
        return call_id

    def problem(self, call_id: str, name: str, reason: str, message: str) -> None:
        call = ToolCall(id=call_id, name=name, arguments={})
        self.calls.append(call)
        self.problems.append(_Problem(call=call, reason=reason, message=message))

    def add_valid(self, index: int, call: ToolCall) -> None:
        call_id = self.call_id(call.id, index, call.name)
        if isinstance(call.arguments, Mapping):
            # the model's own call when its id stands: a step keeps it in the run's history
            self.calls.append(call if call_id == call.id else attrs.evolve(call, id=call_id))
            return
        message = (
            f"{_label(call_id, call.name)} was not executed: its arguments are not a JSON "
            "object. Send the arguments as one JSON object."
        )
        self.problem(call_id, call.name, _repair.NOT_AN_OBJECT, message)

    def add_invalid(self, index: int, bad: InvalidToolCall) -> None:
        call_id = self.call_id(bad.id, index, bad.name)
        # Under finish_reason "length" an unfinished call is never repaired: its text may be a
        # cut-off prefix that happens to parse (e.g. "" -> {}).
        cut = self._reply.finish_reason == "length"
        if bad.reason == "unparseable" and not cut:
            self._add_decoded(call_id, bad)
        elif bad.reason in (NON_FINITE_NUMBER, NESTED_TOO_DEEP):
            message = _refusal_feedback(call_id, bad.name, bad.reason)
            self.problem(call_id, bad.name, bad.reason, message)
        elif bad.reason == TRUNCATED or cut:
            message = (
                f"{_label(call_id, bad.name)} was cut off by the output token limit before "
                "its arguments were complete, so it was not executed. Send shorter arguments, "
                "or split the work into smaller calls."
            )
            self.problem(call_id, bad.name, TRUNCATED, message)
        else:
            message = f"{_label(call_id, bad.name)} could not be read ({bad.reason}); it was not "
            self.problem(call_id, bad.name, bad.reason or "invalid", message + "executed.")

    def _add_decoded(self, call_id: str, bad: InvalidToolCall) -> None:
        null_ok = bad.name in self._no_arguments
        decoded = _repair.decode_arguments(bad.raw_arguments, null_ok=null_ok)
        self.repairs.extend(decoded.repairs)
        if decoded.arguments is not None:
            self.calls.append(ToolCall(id=call_id, name=bad.name, arguments=decoded.arguments))
            return
        label = _label(call_id, bad.name)
        if decoded.reason == _repair.MULTIPLE_VALUES:
            count = _repair.number_word(decoded.count)
            message = (
                f"{label} had {count} argument objects in one call. "
                "Issue one tool call per argument object."
            )
        else:
            message = f"{label} was not executed: {decoded.error}. Send one JSON object."
        self.problem(call_id, bad.name, decoded.reason or _repair.UNPARSEABLE, message)

    def result(self) -> _Collected:
        return _Collected(
            calls=tuple(self.calls),
            problems=tuple(self.problems),
            repairs=_dedup(self.repairs),
        )


def _needs_no_arguments(spec: ToolSpec) -> bool:
    """True when the tool's schema requires no argument (``null`` then means ``{}``)."""
    required = spec.parameters.get("required")
    return not required


def _collect_native_calls(reply: ModelReply, tools: Sequence[ToolSpec] = ()) -> _Collected:
    """Collect the reply's calls: complete ones first, then the repaired invalid ones.

    ``ModelReply`` keeps the two kinds apart, so complete calls come before repaired ones.
    """
    no_arguments = frozenset(spec.name for spec in tools if _needs_no_arguments(spec))
    collector = _Collector(reply, no_arguments)
    for index, call in enumerate(reply.tool_calls):
        collector.add_valid(index, call)
    for offset, bad in enumerate(reply.invalid_tool_calls):
        collector.add_invalid(len(reply.tool_calls) + offset, bad)
    return collector.result()


def _invalid_calls(reply: ModelReply, collected: _Collected) -> ParsedReply:
    """The invalid decision for a reply with at least one unusable call (none is executed)."""
    lines = [problem.message for problem in collected.problems]
    if len(collected.calls) > 1:
        lines.append(
            f"None of the {len(collected.calls)} tool calls of this reply was executed; "
            "send the ones you still need again."
        )
    text = _visible(reply.text)
    return ParsedReply(
        kind=DecisionKind.INVALID,
        text=text,
        feedback=" ".join(lines),
        reason=collected.problems[0].reason,
        repairs=collected.repairs,
        history_message=_history(reply, text, collected.calls),
    )


def _call_from_content(reply: ModelReply, names: frozenset[str]) -> ToolCall | None:
    """The one declared tool call a native-tools reply wrote as its whole content, if any."""
    body = (reply.text or "").strip()
    inner = _repair.strip_code_fence(body)
    body = body if inner is None else inner.strip()
    if not body.startswith("{"):
        return None
    found = _repair.json_values(body)
    if found.error is not None or len(found.values) != 1:
        return None
    call = _textcalls.call_of(found.values[0], names, strict=True)
    if not isinstance(call, _textcalls.FoundCall):
        return None
    call_id = synthesise_call_id(reply.response_id or "", "content", reply.text or "")
    return ToolCall(id=call_id, name=call.name, arguments=call.arguments)


def _markup_decision(
    reply: ModelReply, markup: _textcalls.MarkupCalls, *, native: bool
) -> ParsedReply:
    """The decision for a reply whose text holds tool-call markup (never a final answer).

    Readable markup of declared tools becomes the actions, the text outside it the reply's
    text. Anything else (an unclosed block, bad JSON, an unknown tool, a stray marker) is an
    invalid decision: no call of the reply runs.
    """
    text = reply.text or ""
    outside = _visible(_outside(text, markup.spans))
    if markup.errors:
        truncated = reply.finish_reason == "length" and markup.unclosed
        prefix = "Your reply was cut off by the output token limit. " if truncated else ""
        how = (
            "Call the tools through the tool-calling interface"
            if native
            else 'Write each tool call as <tool_call>{"name": "<tool name>", "arguments": {...}}'
            "</tool_call>"
        )
        feedback = (
            f"{prefix}Your tool call markup could not be read: {'; '.join(markup.errors)}. "
            f"No tool was called. {how}."
        )
        return ParsedReply(
            kind=DecisionKind.INVALID,
            text=outside,
            feedback=feedback,
            reason=TRUNCATED if truncated else INVALID_MARKUP,
            repairs=markup.repairs,
            history_message=_history(reply, _visible(text)),
        )
    calls = _found_actions(reply, markup.calls, "markup")
    repairs = _dedup([TOOL_CALL_MARKUP, *markup.repairs])
    history = _history(reply, outside, calls) if native else _history(reply, _visible(text))
    return ParsedReply(
        kind=DecisionKind.ACTIONS,
        actions=calls,
        text=outside,
        repairs=repairs,
        history_message=history,
    )


class NativeToolCallParser:
    """Parser for models with native tool calling (OpenAI, Anthropic, most local servers).

    Decisions, in order:

    1. any call unusable (``truncated``, two JSON objects in one call, unparseable after
       repairs, not an object) -> INVALID, and no call of the reply is executed;
    2. calls -> ACTIONS (unknown tool names included: the executor reports them);
    3. no calls, and the text holds chat-template tool-call markup (``<tool_call>``,
       ``<|tool_call|>``, ``<function=name>``, Mistral ``[TOOL_CALLS]``, ``<|python_tag|>``)
       -> ACTIONS with the calls of declared tools, the text outside the markup as ``text``,
       repair ``tool_call_markup_in_text``; markup that cannot be read (unclosed, bad JSON,
       an unknown tool, a stray marker) -> INVALID ``invalid_tool_call_markup``
       (``truncated`` when the output limit cut a block), never a final answer;
    4. no calls, and the whole content (optionally in one `````json`` fence) is one object
       whose ``name`` is a declared tool and whose ``arguments`` (or ``parameters``) is an
       object -> ACTIONS with one call, repair ``tool_call_from_content``;
    5. text -> FINAL_ANSWER, or, with ``text_reply_tool``, an action calling that tool with
       ``{"content": text}`` and call id ``""``; a refusal (``ModelReply.refusal``, or a
       reply the provider stopped with ``content_filter``; no call) -> FINAL_ANSWER with
       reason ``refusal``, checked first;
    6. nothing (no calls, empty or whitespace text) -> INVALID ``empty_reply`` (``truncated``
       when the output limit ended the reply).

    Under an agent's output type the run coordinator takes the text of rules 4 and 5 as the
    final answer when it is one (docs/structured-output.md, "Native or a final-answer
    tool"): the text of a native-output reply always, a JSON object fitting the output in
    tool mode.

    Args:
        text_reply_tool: the tool a text reply calls (e.g. "respond to the customer");
            ``None`` (the default) makes a text reply the final answer. An `treadle.Agent`
            refuses one whose call its executor refuses, an unknown tool or one that takes
            no ``content``
            (docs/decisions/0125-a-text-reply-tool-is-checked-when-the-agent-is-built.md).
    """

    def __init__(self, *, text_reply_tool: str | None = None) -> None:
        self._text_reply_tool = text_reply_tool

    @property
    def text_reply_tool(self) -> str | None:
        """The tool a text reply calls, or ``None`` (a text reply is the final answer).

        An agent with native structured output refuses a parser with one: the reply's text
        is the answer there (docs/structured-output.md, "Native or a final-answer tool").
        """
        return self._text_reply_tool

    def parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> ParsedReply:
        """Decide what ``reply`` asks for; pure, and never raises.

        Args:
            reply: the assembled model reply.
            tools: the declared tools, used to recognise a tool call written in the content.

        Returns:
            The decision with the assistant message as it must be replayed.
        """
        return refuse_non_finite(self._parse(reply, tools))

    def _parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> ParsedReply:
        if _refused(reply):
            return _refusal(reply)
        names = _declared(tools)
        collected = _collect_native_calls(reply, tools)
        if collected.problems:
            return _invalid_calls(reply, collected)
        text = _visible(reply.text)
        if collected.calls:
            return ParsedReply(
                kind=DecisionKind.ACTIONS,
                actions=collected.calls,
                text=text,
                repairs=collected.repairs,
                history_message=_history(reply, text, collected.calls),
            )
        return self._without_calls(reply, text, names)

    def _without_calls(
        self, reply: ModelReply, text: str | None, names: frozenset[str]
    ) -> ParsedReply:
        if text is not None:
            markup = _textcalls.markup_calls(text, names)
            if markup.found:
                return _markup_decision(reply, markup, native=True)
        content_call = _call_from_content(reply, names) if text is not None else None
        if content_call is not None:
            return ParsedReply(
                kind=DecisionKind.ACTIONS,
                actions=(content_call,),
                repairs=(TOOL_CALL_FROM_CONTENT,),
                history_message=_history(reply, None, (content_call,)),
            )
        if text is None:
            return _empty_reply(reply, names)
        if self._text_reply_tool is None:
            return _text_answer(reply)
        action = ToolCall(id="", name=self._text_reply_tool, arguments={"content": text})
        return ParsedReply(
            kind=DecisionKind.ACTIONS,
            actions=(action,),
            text=text,
            history_message=_history(reply, text),
        )


# --------------------------------------------------------------------------- JSON in text

_CALL_FORMAT: Final = (
    'Write each tool call as one JSON object {"name": "<tool name>", "arguments": {...}}, '
    "or a JSON list of such objects, alone in a ```json block."
)


def _outside(text: str, spans: Sequence[_textcalls.Span]) -> str:
    """``text`` without the spans (which are in order and do not overlap), stripped."""
    pieces: list[str] = []
    pos = 0
    for span in spans:
        pieces.append(text[pos : span.start])
        pos = span.end
    pieces.append(text[pos:])
    return "\n".join(piece.strip() for piece in pieces if piece.strip())


def _found_actions(
    reply: ModelReply, found: Sequence[_textcalls.FoundCall], source: str
) -> tuple[ToolCall, ...]:
    """Calls read from the text, with their given ids or deterministic synthesised ones."""
    seen: set[str] = set()
    actions: list[ToolCall] = []
    for index, call in enumerate(found):
        call_id = call.id
        if call_id is None or call_id in seen:
            call_id = synthesise_call_id(
                reply.response_id or "", source, str(index), reply.text or ""
            )
        seen.add(call_id)
        actions.append(ToolCall(id=call_id, name=call.name, arguments=call.arguments))
    return tuple(actions)


def _json_invalid(reply: ModelReply, errors: Sequence[str], repairs: Sequence[str]) -> ParsedReply:
    truncated = reply.finish_reason == "length"
    prefix = "Your reply was cut off by the output token limit. " if truncated else ""
    feedback = (
        f"{prefix}Your tool call could not be read: {'; '.join(errors)}. No tool was called. "
        f"{_CALL_FORMAT}"
    )
    return ParsedReply(
        kind=DecisionKind.INVALID,
        text=_visible(reply.text),
        feedback=feedback,
        reason=TRUNCATED if truncated else _repair.UNPARSEABLE,
        repairs=tuple(repairs),
        history_message=_history(reply, _visible(reply.text)),
    )


class JsonToolCallParser:
    """Parser for models without native tool calling, which write calls as JSON in text.

    A call is ``{"name": ..., "arguments": {...}}`` (``parameters`` is accepted too; for a
    declared tool the arguments may be left out), or a JSON list of such objects, written as
    the whole reply, in fenced blocks (``````json`` or bare ``````), or as JSON from the
    first line that starts with ``{`` or ``[`` on. Several calls are several actions, in
    order; call ids are taken from an ``"id"`` key or synthesised deterministically.

    Chat-template markup (``<tool_call>`` ..., as `NativeToolCallParser` reads it) is read
    first; its calls are not native either (the history message is the text as written).

    Decisions: calls -> ACTIONS (visible text around them goes to ``ParsedReply.text``;
    unknown tool names included, the executor reports them); JSON that clearly tries to be a
    call but cannot be read (bad JSON mentioning a declared tool, a non-object
    ``arguments``) -> INVALID with the parse error, or, for a bare call followed by text
    (a closing remark after it, outside any fence), with feedback saying so; other text ->
    FINAL_ANSWER (an answer
    may be JSON data); empty text -> INVALID ``empty_reply``. The history message is the
    reply's text as written, without native tool calls. A reply that has native tool calls
    after all, or is a refusal (a refusal text, or finish reason ``content_filter``), is
    parsed as `NativeToolCallParser` would.
    """

    def __init__(self) -> None:
        self._native = NativeToolCallParser()

    def parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> ParsedReply:
        """Decide what ``reply`` asks for; pure, and never raises.

        Args:
            reply: the assembled model reply.
            tools: the declared tools, used to recognise a broken call.

        Returns:
            The decision with the assistant message as it must be replayed.
        """
        if reply.tool_calls or reply.invalid_tool_calls or _refused(reply):
            return self._native.parse(reply, tools)
        return refuse_non_finite(self._parse(reply, tools))

    def _parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> ParsedReply:
        names = _declared(tools)
        text = _visible(reply.text)
        if text is None:
            return _empty_reply(reply, names)
        markup = _textcalls.markup_calls(text, names)
        if markup.found:
            return _markup_decision(reply, markup, native=False)
        spans = [(span, _textcalls.calls_in(span, names)) for span in _textcalls.candidates(text)]
        used = [(span, found) for span, found in spans if found.is_calls]
        if not used:
            return _text_answer(reply)
        errors = [error for _, found in used for error in found.errors]
        repairs = _dedup([repair for _, found in used for repair in found.repairs])
        if errors:
            return _json_invalid(reply, errors, repairs)
        calls = [call for _, found in used for call in found.calls]
        return ParsedReply(
            kind=DecisionKind.ACTIONS,
            actions=_found_actions(reply, calls, "json"),
            text=_visible(_outside(text, [span for span, _ in used])),
            repairs=repairs,
            history_message=_history(reply, text),
        )


def argument_problem(value: object) -> str | None:
    """Why ``value`` (a call's decoded arguments) cannot be stored as they are, or ``None``.

    Returns:
        `NESTED_TOO_DEEP` when objects and arrays nest deeper than `MAX_ARGUMENT_DEPTH`
        (a value that holds itself always does), `NON_FINITE_NUMBER` when a float is NaN or
        infinite, else ``None``. Walked level by level, without recursion.
    """
    level: list[object] = [value]
    depth = 1  # of the containers in ``level``
    while level:
        below: list[object] = []
        for item in level:
            if isinstance(item, float):
                if not math.isfinite(item):
                    return NON_FINITE_NUMBER
            elif isinstance(item, Mapping | list | tuple):
                if depth > MAX_ARGUMENT_DEPTH:
                    return NESTED_TOO_DEEP
                below.extend(item.values() if isinstance(item, Mapping) else item)
        level = below
        depth += 1
    return None


def refuse_non_finite(parsed: ParsedReply) -> ParsedReply:
    """``parsed``, or an invalid decision when a call's arguments cannot be stored as they are.

    That is, when they hold NaN or an infinity, or nest deeper than `MAX_ARGUMENT_DEPTH`
    (`argument_problem`). JSON has no form for those numbers: stored, they would read back
    as something else than what was validated and run. No call of such a reply is executed;
    the feedback names each refused call, and the history message keeps every call id with
    the refused calls' arguments as ``{}`` (so each is answered by the feedback). Any other
    decision is returned as is.
    """
    if parsed.kind is not DecisionKind.ACTIONS:
        return parsed
    problems = {call.id: argument_problem(call.arguments) for call in parsed.actions}
    refused = {call.id: call for call in parsed.actions if problems[call.id] is not None}
    if not refused:
        return parsed
    lines = [_refusal_feedback(call.id, call.name, problems[call.id]) for call in refused.values()]
    if len(parsed.actions) > 1:
        lines.append(
            f"None of the {len(parsed.actions)} tool calls of this reply was executed; "
            "send the ones you still need again."
        )
    history = parsed.history_message
    calls = tuple(
        attrs.evolve(call, arguments={}) if call.id in refused else call
        for call in history.tool_calls
    )
    first = next(problem for problem in problems.values() if problem is not None)
    return ParsedReply(
        kind=DecisionKind.INVALID,
        text=parsed.text,
        feedback=" ".join(lines),
        reason=first,
        repairs=parsed.repairs,
        history_message=attrs.evolve(history, tool_calls=calls),
    )


def _refusal_feedback(call_id: str, name: str, problem: str | None) -> str:
    """The feedback sentence for a call refused for ``problem`` (`argument_problem`'s)."""
    if problem == NESTED_TOO_DEEP:
        return (
            f"{_label(call_id, name)} was not executed: its arguments nest objects and arrays "
            f"deeper than {MAX_ARGUMENT_DEPTH} levels. Send flatter arguments."
        )
    return (
        f"{_label(call_id, name)} was not executed: its arguments hold a number JSON "
        "cannot represent (NaN or infinity). Send finite numbers."
    )


def strict_arguments(reply: ModelReply) -> ModelReply:
    """``reply`` with each tool call whose arguments cannot be stored as they are made invalid.

    That is, arguments holding NaN or an infinity (JSON has no form for those numbers, so a
    stored call would read back with other arguments than the ones validated), or nested
    deeper than `MAX_ARGUMENT_DEPTH`. Such a call moves to ``invalid_tool_calls`` with
    reason ``non_finite_number`` or ``nested_too_deep`` and its arguments as text (``NaN``,
    ``Infinity``; empty when too deep to write), which the parsers turn into an invalid
    decision with feedback (docs/models.md, "Tool arguments").
    """
    kept: list[ToolCall] = []
    refused: list[InvalidToolCall] = []
    for call in reply.tool_calls:
        problem = argument_problem(call.arguments)
        if problem is None:
            kept.append(call)
        else:
            raw = _as_text(call.arguments)
            refused.append(
                InvalidToolCall(id=call.id, name=call.name, raw_arguments=raw, reason=problem)
            )
    if not refused:
        return reply
    return attrs.evolve(
        reply,
        tool_calls=tuple(kept),
        invalid_tool_calls=(*refused, *reply.invalid_tool_calls),
    )


def _as_text(arguments: object) -> str:
    """Refused arguments as JSON text (NaN as ``NaN``); ``""`` when they are too deep for it."""
    try:
        return json.dumps(arguments, ensure_ascii=False)
    except (RecursionError, ValueError, TypeError):
        return ""
