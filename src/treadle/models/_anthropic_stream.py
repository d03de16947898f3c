"""Assembling a streamed Anthropic Messages response, and classifying Anthropic failures.

`MessageAccumulator` folds the server-sent events of one ``POST /v1/messages`` stream
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``, ``ping``, ``error``) into a `treadle.types.ModelReply`. Text, thinking and
``tool_use`` blocks are kept apart: text is the visible text, thinking is the reasoning, and
``input_json_delta`` fragments become a tool call's arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeGuard

import attrs

from treadle._exceptions import ModelCallError
from treadle._text import loads_json
from treadle.models._accumulate import (
    classify_failure,
    error_fields,
    loads_event,
    response_failure,
    standard_finish_reason,
    usage_count,
)
from treadle.ports import DeltaCallback
from treadle.types import InvalidToolCall, ModelErrorInfo, ModelReply, ToolCall, Usage

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}
"""Anthropic ``stop_reason`` → the standard finish reason (the OpenAI names); others are mapped
by `treadle.models._accumulate.standard_finish_reason`. The server's value is kept in
``ModelReply.provider_finish_reason``."""

ERROR_TYPES: Mapping[str, tuple[str, bool]] = {
    "invalid_request_error": ("bad_request", False),
    "authentication_error": ("auth", False),
    "permission_error": ("auth", False),
    "billing_error": ("auth", False),
    "not_found_error": ("not_found", False),
    "request_too_large": ("bad_request", False),
    "rate_limit_error": ("rate_limited", True),
    "api_error": ("server_error", True),
    "overloaded_error": ("server_error", True),
    "timeout_error": ("timeout", True),
}
"""Anthropic error ``type`` → ``(kind, retryable)`` for errors reported inside a stream."""


def classify_anthropic(*, status: int | None, type_: str, message: str) -> tuple[str, bool]:
    """Map an Anthropic failure to ``(kind, retryable)``.

    Args:
        status: the HTTP status, or ``None`` for an ``error`` event inside a 200 stream.
        type_: the error object's ``type`` (``overloaded_error`` ...), ``""`` when absent.
        message: the provider's message ("prompt is too long: ..." is a context error).

    Returns:
        One of the kinds listed on `treadle.types.ModelErrorInfo` and whether the same request
        may be sent again. HTTP statuses decide first (529 overloaded is a retryable
        ``server_error``); an unknown in-stream type is a retryable ``upstream_error``.
    """
    if status is not None or type_ not in ERROR_TYPES:
        return classify_failure(status=status, code=None, type_=type_, message=message)
    kind, retryable = classify_failure(status=400, code=None, type_=type_, message=message)
    if kind == "context_length_exceeded":
        return kind, retryable
    return ERROR_TYPES[type_]


def usage_from(payload: Any, previous: Usage) -> Usage:
    """Fold an Anthropic ``usage`` object into the counts known so far.

    ``input_tokens`` becomes the whole prompt: uncached plus cache-write plus cache-read
    tokens (Anthropic reports them apart). Counts absent from ``payload`` keep their previous
    value, in that sum too (a ``message_delta`` may repeat ``input_tokens`` alone); a count
    never reported stays ``None`` (docs/models.md, "Usage").
    """
    if not isinstance(payload, Mapping):
        return previous
    uncached = usage_count(payload.get("input_tokens"))
    written = usage_count(payload.get("cache_creation_input_tokens"))
    if written is None:  # a later report leaving a cache count out keeps the earlier one
        written = previous.cache_creation_input_tokens
    read = usage_count(payload.get("cache_read_input_tokens"))
    if read is None:
        read = previous.cached_input_tokens
    input_tokens = previous.input_tokens
    if uncached is not None:
        input_tokens = uncached + (written or 0) + (read or 0)
    output = usage_count(payload.get("output_tokens"))
    output_tokens = output if output is not None else previous.output_tokens
    total = None
    if input_tokens is not None and output_tokens is not None:
        total = input_tokens + output_tokens
    return Usage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tokens=total,
        cached_input_tokens=read,
        cache_creation_input_tokens=written,
    )


_DELTA_BLOCKS: Final = {
    "text_delta": ("text",),
    "thinking_delta": ("thinking",),
    "signature_delta": ("thinking",),
    "input_json_delta": ("tool_use", "server_tool_use", "mcp_tool_use"),
}
"""The block types each delta type belongs to (Anthropic's streaming reference, "Content block
delta types"): a delta of another block breaks the protocol."""


def _is_index(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a block index: an integer (JSON ``true`` is none)."""
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.define(eq=False)
class _Block:
    index: int
    type: str
    id: str = ""
    name: str = ""
    start_input: Any = None
    parts: list[str] = attrs.Factory(list)
    signature: str = ""


@attrs.define(eq=False)
class MessageAccumulator:
    """Folds the events of one streamed Messages response into a reply.

    Attributes:
        on_delta: receives ``("text" | "reasoning", fragment)`` as fragments arrive.
        redact: applied to every error message built here (removes credentials).
        done: true once ``message_stop`` was seen; later events are ignored.
        events: events of the reply seen (a ``ping`` keep-alive is none).
        stop_reason: Anthropic's ``stop_reason``, once ``message_delta`` gave it.
        refusal: the ``explanation`` of a ``stop_details`` of type ``refusal`` (given beside
            ``stop_reason: "refusal"``), the reply's refusal text; ``None`` when none came.
        usage: the usage reported so far; replaced (never mutated) on every report.
    """

    on_delta: DeltaCallback | None = None
    redact: Callable[[str], str] | None = None
    done: bool = False
    events: int = 0
    message_id: str | None = None
    stop_reason: str | None = None
    refusal: str | None = None
    usage: Usage = Usage()
    _blocks: dict[int, _Block] = attrs.Factory(dict)

    @property
    def text(self) -> str | None:
        """Visible text so far; ``None`` when the reply has none (no text block, or empty ones).

        Never ``""`` standing for nothing (docs/seams.md, "Model client").
        """
        parts = [p for b in self._ordered() if b.type == "text" for p in b.parts]
        return "".join(parts) or None

    def add(self, data: str, *, event: str = "message") -> None:
        """Fold one SSE event.

        Args:
            data: the event's data, a JSON object.
            event: the SSE event name; the object's own ``type`` wins when present.

        A ``ping`` is a keep-alive, not an event of the reply: it is not counted in
        ``events``, so a stream of nothing but pings stays under the first-byte deadline
        (docs/models.md, "Deadlines inside every attempt").

        Raises:
            treadle.ModelCallError: ``invalid_response`` for data that is not a JSON object or
                a delta for a block never started; the classified kind of an ``error`` event.
        """
        if self.done:
            return
        try:
            payload = loads_event(data)
        except ValueError as exc:
            if event == "error":
                raise self._inband_error({"error": data}) from exc
            raise self.failure("invalid_response", f"data event is not JSON: {exc}") from exc
        if not isinstance(payload, Mapping):
            raise self.failure("invalid_response", "data event is not a JSON object")
        kind = payload.get("type")
        name = kind if isinstance(kind, str) else event
        if name == KEEP_ALIVE:
            return
        self.events += 1
        handler = _HANDLERS.get(name)
        if handler is not None:
            handler(self, payload)

    def add_message(self, body: bytes) -> ModelReply:
        """Fold a whole non-streamed ``message`` object and return the reply.

        For servers that ignore ``stream: true`` and answer with one JSON object.

        Raises:
            treadle.ModelCallError: ``invalid_response`` when the body is not a JSON object,
                or the classified kind of its ``error`` object.
        """
        try:
            payload = loads_json(body)
        except ValueError as exc:
            raise self.failure("invalid_response", f"body is not JSON: {exc}") from exc
        if not isinstance(payload, Mapping):
            raise self.failure("invalid_response", "body is not a JSON object")
        if payload.get("type") == "error":
            raise self._inband_error(payload)
        self._message_start({"message": {**payload, "content": []}})
        for index, block in enumerate(payload.get("content") or ()):
            if isinstance(block, Mapping):
                self._block_start({"index": index, "content_block": block})
                if block.get("type") == "tool_use":  # a whole input, as one fragment
                    self._blocks[index].parts.append(json.dumps(block.get("input")))
        stop = {key: payload.get(key) for key in ("stop_reason", "stop_details")}
        self._message_delta({"delta": stop})
        self.done = True
        return self.reply()

    def failure(
        self, kind: str, message: str, *, retryable: bool = False, status: int | None = None
    ) -> ModelCallError:
        """Build the error for this response, carrying its usage and partial text.

        ``status`` is the response's HTTP status, when the failure is one of its status.
        """
        info = ModelErrorInfo(kind=kind, message=message, retryable=retryable, status=status)
        return response_failure(info, self.usage, self.text, self.redact)

    def reply(self) -> ModelReply:
        """The assembled reply.

        ``stop_reason: "refusal"`` is finish reason ``content_filter``, which the parsers
        decide as a refusal, with the ``stop_details`` explanation as ``refusal`` when one
        came (docs/models.md, "Replies, finish reasons, reasoning").

        A ``tool_use`` block whose input is not a JSON object goes to ``invalid_tool_calls``
        with its raw text: reason ``truncated`` when the reply was cut by ``max_tokens``, else
        ``unparseable``. It never appears in ``tool_calls``. Cut by ``max_tokens``, a
        ``tool_use`` block that is the reply's last block goes there (``truncated``) whatever
        its input (docs/models.md, "Output cap").

        Raises:
            treadle.ModelCallError: ``incomplete_stream`` (retryable) when the response held
                no content block and no stop reason: that is no reply.
        """
        if self.stop_reason is None and not self._blocks:
            raise self.failure(
                "incomplete_stream",
                f"the response carried no reply after {self.events} events: no content block "
                "and no stop reason",
                retryable=True,
            )
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        reasoning: list[str] | None = None
        finish = _finish_reason(self.stop_reason)
        blocks = self._ordered()
        for block in blocks:
            if block.type in ("thinking", "redacted_thinking"):
                reasoning = (reasoning or []) + block.parts
            elif block.type == "tool_use":
                call_id = block.id or f"toolu_{block.index}"
                # The last block is where max_tokens cut the reply, also when what arrived of
                # its input parses (docs/models.md, "Output cap").
                cut = finish == "length" and block is blocks[-1]
                raw, arguments = _arguments(block, cut=finish == "length")
                if arguments is None or not block.name or cut:
                    reason = "truncated" if finish == "length" else "unparseable"
                    invalid.append(
                        InvalidToolCall(
                            id=call_id, name=block.name, raw_arguments=raw, reason=reason
                        )
                    )
                else:
                    calls.append(ToolCall(id=call_id, name=block.name, arguments=arguments))
        thinking = [b for b in self._ordered() if b.type == "thinking"]
        # One signed thinking block can be sent back as it came; several are joined into one
        # reasoning text, which no single signature covers.
        signature = thinking[0].signature or None if len(thinking) == 1 else None
        return ModelReply(
            text=self.text,
            reasoning=None if reasoning is None else "".join(reasoning),
            reasoning_signature=signature,
            tool_calls=tuple(calls),
            invalid_tool_calls=tuple(invalid),
            finish_reason=finish,
            usage=self.usage,
            response_id=self.message_id,
            refusal=self.refusal,
            provider_finish_reason=(
                self.stop_reason
                if self.stop_reason is not None and self.stop_reason != finish
                else None
            ),
        )

    def _ordered(self) -> list[_Block]:
        return [self._blocks[i] for i in sorted(self._blocks)]

    def _message_start(self, payload: Mapping[str, Any]) -> None:
        message = payload.get("message")
        if not isinstance(message, Mapping):
            raise self.failure("invalid_response", "message_start without a message object")
        if isinstance(message.get("id"), str):
            self.message_id = message["id"]
        self.usage = usage_from(message.get("usage"), self.usage)

    def _block_start(self, payload: Mapping[str, Any]) -> None:
        index = payload.get("index")
        block = payload.get("content_block")
        if not _is_index(index) or not isinstance(block, Mapping):
            raise self.failure("invalid_response", "content_block_start without index or block")
        if index in self._blocks:  # a second block at one index would replace the first
            raise self.failure("invalid_response", f"content_block_start for block {index} twice")
        held = _Block(
            index=index,
            type=_str(block.get("type")),
            id=_str(block.get("id")),
            name=_str(block.get("name")),
            start_input=block.get("input"),
        )
        self._blocks[index] = held
        if held.type == "text":
            self._append(held, _str(block.get("text")), "text")
        elif held.type == "thinking":
            self._append(held, _str(block.get("thinking")), "reasoning")
            held.signature = _str(block.get("signature"))

    def _block_delta(self, payload: Mapping[str, Any]) -> None:
        index = payload.get("index")
        held = self._blocks.get(index) if _is_index(index) else None
        delta = payload.get("delta")
        if held is None or not isinstance(delta, Mapping):
            raise self.failure("invalid_response", "content_block_delta for an unknown block")
        kind = delta.get("type")
        expected = _DELTA_BLOCKS.get(kind) if isinstance(kind, str) else None
        if expected is not None and held.type not in expected:
            raise self.failure(
                "invalid_response", f"a {kind} for block {index}, a {held.type or 'typeless'} block"
            )
        if kind == "text_delta":
            self._append(held, _str(delta.get("text")), "text")
        elif kind == "thinking_delta":
            self._append(held, _str(delta.get("thinking")), "reasoning")
        elif kind == "input_json_delta":
            held.parts.append(_str(delta.get("partial_json")))
        elif kind == "signature_delta":
            held.signature += _str(delta.get("signature"))
        # citations_delta and unknown delta types carry nothing we keep

    def _message_delta(self, payload: Mapping[str, Any]) -> None:
        delta = payload.get("delta")
        if isinstance(delta, Mapping) and isinstance(delta.get("stop_reason"), str):
            self.stop_reason = delta["stop_reason"]
        details = delta.get("stop_details") if isinstance(delta, Mapping) else None
        if isinstance(details, Mapping) and details.get("type") == "refusal":
            explanation = details.get("explanation")
            self.refusal = explanation if isinstance(explanation, str) and explanation else None
        if payload.get("usage") is not None:
            self.usage = usage_from(payload["usage"], self.usage)

    def _message_stop(self, payload: Mapping[str, Any]) -> None:
        self.done = True

    def _error(self, payload: Mapping[str, Any]) -> None:
        raise self._inband_error(payload)

    def _inband_error(self, payload: Mapping[str, Any]) -> ModelCallError:
        message, _, type_ = error_fields(payload)
        kind, retryable = classify_anthropic(status=None, type_=type_, message=message)
        return self.failure(kind, message or "error event in stream", retryable=retryable)

    def _append(self, block: _Block, fragment: str, channel: str) -> None:
        if fragment:
            block.parts.append(fragment)
            if self.on_delta is not None:
                self.on_delta(channel, fragment)


def _ignore(acc: MessageAccumulator, payload: Mapping[str, Any]) -> None:
    """``content_block_stop`` changes nothing in the reply."""


KEEP_ALIVE: Final = "ping"
"""The event type a server sends to keep an idle stream open; it is no part of the reply."""

_HANDLERS: dict[str, Callable[[MessageAccumulator, Mapping[str, Any]], None]] = {
    "message_start": MessageAccumulator._message_start,
    "content_block_start": MessageAccumulator._block_start,
    "content_block_delta": MessageAccumulator._block_delta,
    "content_block_stop": _ignore,
    "message_delta": MessageAccumulator._message_delta,
    "message_stop": MessageAccumulator._message_stop,
    "error": MessageAccumulator._error,
}
"""Event type → handler; unknown event types are ignored (Anthropic may add new ones)."""


def _finish_reason(stop_reason: str | None) -> str | None:
    if stop_reason is None:
        return None
    return STOP_REASONS.get(stop_reason) or standard_finish_reason(stop_reason)[0]


def _arguments(block: _Block, *, cut: bool) -> tuple[str, dict[str, Any] | None]:
    """``(raw text, decoded object or None)`` of a tool_use block's input.

    Without ``input_json_delta`` fragments the block's start ``input`` is used; no or empty
    fragments mean no arguments, unless the reply was ``cut`` by the output limit (then the
    input is unknown).
    """
    if not block.parts:
        start = block.start_input if block.start_input is not None else {}
        usable = isinstance(start, Mapping) and not cut
        return json.dumps(start), dict(start) if usable else None
    raw = "".join(block.parts)
    if not raw.strip():
        return raw, None if cut else {}
    try:
        value = loads_json(raw)
    except ValueError:
        return raw, None
    return raw, value if isinstance(value, dict) else None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""
