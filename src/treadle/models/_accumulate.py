"""Assembling a streamed chat-completions response, and classifying provider failures.

`StreamAccumulator` folds the ``data`` payloads of one response (``chat.completion.chunk``
objects) into a `treadle.types.ModelReply`. `classify_failure` maps an HTTP status or an
in-band error object to the error kinds of `treadle.types.ModelErrorInfo`, and
`parse_retry_after` reads the server-directed wait.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

import attrs
import orjson

from treadle._exceptions import ModelCallError
from treadle._text import loads_json
from treadle.ports import DeltaCallback
from treadle.types import InvalidToolCall, ModelErrorInfo, ModelReply, ToolCall, Usage

_CONTEXT_HINTS = re.compile(
    r"context[ _-]length|maximum context|context window|prompt is too long|too many tokens",
    re.IGNORECASE,
)
_RATE_HINTS = ("rate_limit", "too_many_requests", "rate limit", "quota")
_SERVER_HINTS = ("server_error", "internal", "overloaded", "unavailable", "api_error")
MAX_MESSAGE_CHARS = 500
"""Provider error messages are cut to this many characters."""

FINISH_REASONS: Final = {
    **dict.fromkeys(
        ("stop", "eos", "eos_token", "end_turn", "stop_sequence", "end", "complete",
         "completed", "finished", "pause_turn"),
        "stop",
    ),
    **dict.fromkeys(
        ("length", "max_tokens", "max_output_tokens", "model_length", "token_limit",
         "max_length"),
        "length",
    ),
    **dict.fromkeys(
        ("tool_calls", "tool_call", "tool_use", "function_call", "function_calls"), "tool_calls"
    ),
    **dict.fromkeys(
        ("content_filter", "safety", "recitation", "blocklist", "prohibited_content", "spii",
         "refusal", "image_safety", "language"),
        "content_filter",
    ),
}  # fmt: skip
"""A provider's finish reason, lower-cased -> the standard value (docs/models.md, "Replies,
finish reasons, reasoning"); a reason not listed here is ``stop``, the server's own value kept."""

FAILED_FINISH_REASONS: Final = frozenset({"error", "abort", "aborted", "cancelled", "canceled"})
"""Finish reasons that say the generation failed: the attempt is an ``incomplete_stream``."""


def standard_finish_reason(value: str) -> tuple[str, str | None]:
    """``(standard value, the server's own value or None)`` for a finish reason.

    The second item is ``None`` when the server's value is the standard one already.
    """
    standard = FINISH_REASONS.get(value.lower(), "stop")
    return standard, None if value == standard else value


def error_fields(payload: Any) -> tuple[str, Any, str]:
    """Pull ``(message, code, type)`` out of an error payload of any common shape.

    Accepts ``{"error": {...}}``, ``{"error": "text"}``, a bare error object, or
    ``{"detail": ...}``, alone or as the first item of a JSON list (Google's APIs answer
    ``[{"error": {...}}]``); anything else gives an empty message.
    """
    if isinstance(payload, list) and payload:
        payload = payload[0]
    error = payload.get("error", payload) if isinstance(payload, Mapping) else payload
    if isinstance(error, str):
        return error[:MAX_MESSAGE_CHARS], None, ""
    if not isinstance(error, Mapping):
        return "", None, ""
    message = error.get("message") or error.get("detail") or ""
    if not isinstance(message, str):
        message = json.dumps(message)
    kind = error.get("type")
    return message[:MAX_MESSAGE_CHARS], error.get("code"), kind if isinstance(kind, str) else ""


def response_failure(
    info: ModelErrorInfo, usage: Usage, text: str | None, redact: Callable[[str], str] | None
) -> ModelCallError:
    """The error of a response that failed after ``usage`` and ``text`` arrived.

    Its message goes through ``redact`` (the client's credentials hidden; docs/models.md,
    "Credentials"); the error carries the usage and the partial text.
    """
    if redact is not None:
        info = attrs.evolve(info, message=redact(info.message))
    return ModelCallError(info, usage=usage, partial_text=text or "")


def classify_failure(
    *, status: int | None, code: Any, type_: str, message: str
) -> tuple[str, bool]:
    """Map a failure to ``(kind, retryable)``.

    Args:
        status: the HTTP status, or ``None`` for an error reported inside a 200 stream.
        code: the error object's ``code`` (a string, an integer status, or ``None``).
        type_: the error object's ``type`` (``""`` when absent).
        message: the provider's message.

    Returns:
        One of the kinds listed on `treadle.types.ModelErrorInfo` and whether the same request
        may be sent again. An in-band error with no known code is ``upstream_error``
        (retryable); a context-length error is never retryable.
    """
    numeric = _as_status(code) if status is None else status
    words = f"{code} {type_}".lower()
    context = "context_length" in words or _CONTEXT_HINTS.search(message) is not None
    if context and (numeric is None or numeric in (400, 413, 422)):
        return "context_length_exceeded", False
    if numeric is not None:
        return _classify_status(numeric)
    if any(hint in words for hint in _RATE_HINTS):
        return "rate_limited", True
    if any(hint in words for hint in _SERVER_HINTS):
        return "server_error", True
    return "upstream_error", True


def _as_status(code: Any) -> int | None:
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        return code
    if isinstance(code, str) and code.isdigit() and len(code) == 3:
        return int(code)
    return None


def _classify_status(status: int) -> tuple[str, bool]:
    if status == 429:
        return "rate_limited", True
    if status == 408:
        return "timeout", True
    if status >= 500:
        return "server_error", True
    if status in (401, 403):
        return "auth", False
    if status == 404:
        return "not_found", False
    if 400 <= status < 500:
        return "bad_request", False
    return "invalid_response", False


def parse_retry_after(
    headers: Mapping[str, str], *, now_s: float, body: Any = None
) -> float | None:
    """Read the server-directed wait from ``retry-after-ms``, ``Retry-After`` or the body.

    ``Retry-After`` is delay-seconds or an HTTP-date (RFC 9110, section 10.2.3). A date is
    measured against the response's own ``Date`` header when it has a readable one, so a
    client clock that is off does not change the wait, else against ``now_s``. Without a
    header, a wait given in the error body counts: Google's ``RetryInfo.retryDelay``
    (``"37s"``, in ``error.details``, also inside a JSON list body).

    Args:
        headers: response headers (case-insensitive mapping, e.g. `httpx.Headers`).
        now_s: the current UTC wall-clock time in seconds since the epoch, for HTTP-dates.
        body: the decoded JSON error body, or ``None``.

    Returns:
        The wait in seconds (never negative), or ``None`` when absent or unreadable.
    """
    milliseconds = _number(headers.get("retry-after-ms"))
    if milliseconds is not None:
        return max(0.0, milliseconds / 1000)
    value = headers.get("retry-after")
    if value is None:
        return retry_delay_in(body)
    seconds = _number(value)
    if seconds is None:
        at = _http_date(value)
        if at is None:
            return retry_delay_in(body)
        sent = _http_date(headers.get("date"))
        seconds = at - (sent if sent is not None else now_s)
    return max(0.0, seconds)


def _http_date(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


_DELAY = re.compile(r"\A\s*(\d+(?:\.\d+)?)s\s*\Z")


def retry_delay_in(body: Any) -> float | None:
    """The wait a Google-style error body asks for (``RetryInfo.retryDelay``), in seconds.

    ``None`` when absent or unreadable; a delay too large for a float (it overflows to
    infinity) is unreadable, as it is in a header.
    """
    if isinstance(body, list) and body:
        body = body[0]
    error = body.get("error") if isinstance(body, Mapping) else None
    details = error.get("details") if isinstance(error, Mapping) else None
    for detail in details if isinstance(details, list) else ():
        if not isinstance(detail, Mapping):
            continue
        kind, delay = detail.get("@type"), detail.get("retryDelay")
        if (
            isinstance(kind, str)
            and kind.endswith("google.rpc.RetryInfo")
            and isinstance(delay, str)
        ):
            found = _DELAY.match(delay)
            if found is not None:
                return _number(found.group(1))
    return None


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def usage_from(payload: Any) -> Usage:
    """Map an OpenAI-style ``usage`` object to `Usage`; a count not given is ``None``.

    Cached prompt tokens come from ``prompt_tokens_details.cached_tokens`` (OpenAI), a
    top-level ``cached_tokens`` (Moonshot) or ``prompt_cache_hit_tokens`` (DeepSeek, whose
    ``prompt_cache_miss_tokens`` are the rest of the prompt: their sum is the prompt when
    ``prompt_tokens`` is missing). ``input_tokens`` is always the whole prompt.
    """
    if not isinstance(payload, Mapping):
        return Usage()
    details = payload.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, Mapping) else None
    prompt_details = payload.get("prompt_tokens_details")
    cached = (
        usage_count(prompt_details.get("cached_tokens"))
        if isinstance(prompt_details, Mapping)
        else None
    )
    hit, miss = (
        usage_count(payload.get("prompt_cache_hit_tokens")),
        usage_count(payload.get("prompt_cache_miss_tokens")),
    )
    if cached is None:
        cached = hit if hit is not None else usage_count(payload.get("cached_tokens"))
    prompt = usage_count(payload.get("prompt_tokens"))
    if prompt is None and hit is not None and miss is not None:
        prompt = hit + miss
    return Usage(
        input_tokens=prompt,
        output_tokens=usage_count(payload.get("completion_tokens")),
        reasoning_tokens=usage_count(reasoning),
        total_tokens=usage_count(payload.get("total_tokens")),
        cached_input_tokens=cached,
    )


def usage_count(value: Any) -> int | None:
    """A token count as a server wrote it, as an `int` (``None``: absent or not a count).

    A whole number written as a float counts as that number: ``5000.0``, and a count too
    large for a 64-bit integer that a JSON decoder turns into a float (``1e20``), so that
    such a report is not taken for no report at all.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 0:
        return value
    return None


def _merged(before: Usage, report: Usage) -> Usage:
    """``report``, with each count it leaves out (``None``) as ``before`` had it."""
    return Usage(
        **{
            field.name: getattr(before, field.name)
            if getattr(report, field.name) is None
            else getattr(report, field.name)
            for field in attrs.fields(Usage)
        }
    )


@attrs.define(eq=False)
class _CallBuffer:
    index: int
    id: str = ""
    name: str = ""
    arguments: list[str] = attrs.Factory(list)

    def merge(self, call_id: str, name: str, arguments: str) -> None:
        if call_id and not self.id:
            self.id = call_id
        if name and name != self.name:
            self.name += name
        if arguments:
            self.arguments.append(arguments)


@attrs.define(eq=False)
class StreamAccumulator:
    """Folds the data payloads of one streamed response into a reply.

    Tool-call fragments are routed by ``index``; at one index, a fragment whose non-empty id
    differs from the id held there starts a new call. A fragment without a (non-negative)
    index goes to the call holding its id; without an id either, it continues the last call
    when it is the first entry of its delta's list, and starts a new call when it follows
    another entry of that list. Each entry of one list is a call of its own: none goes to a
    call an earlier entry of its list went to, also when they share an id. A name is set
    when empty, an identical repeat is ignored, anything else is appended. Empty ids and
    names never overwrite. Every arguments fragment is appended, the first one included. The
    legacy ``function_call`` delta is one call without an id (one is synthesised), and
    ``finish_reason: "function_call"`` is reported as ``tool_calls``.

    Attributes:
        on_delta: receives ``("text" | "reasoning", fragment)`` as fragments arrive.
        redact: applied to every error message built here (removes credentials).
        done: true once ``[DONE]`` was seen; later payloads are ignored.
        events: data payloads seen (``[DONE]`` included).
    """

    on_delta: DeltaCallback | None = None
    redact: Callable[[str], str] | None = None
    done: bool = False
    events: int = 0
    response_id: str | None = None
    finish_reason: str | None = None
    usage: Usage = Usage()
    _text: list[str] | None = None
    _reasoning: list[str] | None = None
    _refusal: list[str] | None = None
    _calls: list[_CallBuffer] = attrs.Factory(list)
    _by_index: dict[int, _CallBuffer] = attrs.Factory(dict)

    @property
    def text(self) -> str | None:
        """Visible text so far; ``None`` when the server sent none (no content, or only ``""``).

        A tool-only turn's text is ``None``, never ``""`` standing for nothing
        (docs/seams.md, "Model client"), whether the server left ``content`` out, sent
        ``null``, or sent ``""`` (as many do in the first delta).
        """
        return "".join(self._text) if self._text else None

    def add(self, data: str, *, event: str = "message") -> None:
        """Fold one SSE event's ``data``.

        Args:
            data: the event's data (a JSON chunk, or ``[DONE]``).
            event: the SSE event name; an ``error`` event is an in-band error whatever its data.

        Raises:
            treadle.ModelCallError: kind ``invalid_response`` for data that is not a JSON
                object, or the classified kind of an in-band error.
        """
        if self.done:
            return
        self.events += 1
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = loads_event(data)
        except ValueError as exc:
            if event == "error":
                raise self._inband_error({"error": data}) from exc
            raise self.failure("invalid_response", f"data event is not JSON: {exc}") from exc
        if event == "error" and not (isinstance(chunk, Mapping) and "error" in chunk):
            chunk = {"error": chunk}
        if not isinstance(chunk, Mapping):
            raise self.failure("invalid_response", "data event is not a JSON object")
        self.add_chunk(chunk)

    def add_chunk(self, chunk: Mapping[str, Any]) -> None:
        """Fold one decoded ``chat.completion.chunk`` object (see `add`)."""
        if chunk.get("error") is not None:
            raise self._inband_error(chunk)
        if isinstance(chunk.get("id"), str) and chunk["id"] and self.response_id is None:
            self.response_id = chunk["id"]
        if chunk.get("usage") is not None:  # a count it leaves out keeps the one reported before
            self.usage = _merged(self.usage, usage_from(chunk["usage"]))
        for choice in chunk.get("choices") or ():
            if isinstance(choice, Mapping) and choice.get("index") in (0, None):
                self._add_choice(choice)

    def failure(
        self, kind: str, message: str, *, retryable: bool = False, status: int | None = None
    ) -> ModelCallError:
        """Build the error for this response, carrying its usage and partial text.

        ``status`` is the response's HTTP status, when the failure is one of its status.
        """
        info = ModelErrorInfo(kind=kind, message=message, retryable=retryable, status=status)
        return response_failure(info, self.usage, self.text, self.redact)

    def reply(self) -> ModelReply:
        """The assembled reply: calls ordered by index, unparseable ones set apart.

        A call whose arguments are not a JSON object goes to ``invalid_tool_calls`` with its
        raw text: reason ``truncated`` when ``finish_reason`` is ``length``, else
        ``unparseable``. It never appears in ``tool_calls``. With ``finish_reason`` ``length``
        the last call goes there (``truncated``) whatever its arguments: the output limit cut
        it (docs/models.md, "Output cap"). The finish reason is mapped onto
        the standard set (`standard_finish_reason`), the server's own value kept.

        Raises:
            treadle.ModelCallError: ``incomplete_stream`` (retryable) when the response
                carried nothing at all (no text, refusal, tool call or finish reason), or its
                finish reason says the generation failed (``error``, ``abort``): neither is a
                reply.
        """
        if self.finish_reason is not None and self.finish_reason.lower() in FAILED_FINISH_REASONS:
            raise self.failure(
                "incomplete_stream",
                f"the server ended the generation with finish_reason {self.finish_reason!r}",
                retryable=True,
            )
        if self.finish_reason is None and not (self._text or self._refusal or self._calls):
            raise self.failure(
                "incomplete_stream",
                f"the response carried no reply after {self.events} events: no text, no tool "
                "call and no finish reason",
                retryable=True,
            )
        finish, provider_finish = (
            standard_finish_reason(self.finish_reason) if self.finish_reason else (None, None)
        )
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        ordered = sorted(self._calls, key=lambda b: b.index)
        for ordinal, buf in enumerate(ordered):
            call_id = buf.id or self._synthetic_id(buf, ordinal)
            raw = "".join(buf.arguments)
            arguments = _object_or_none(raw)
            # The last call is where the output limit cut the reply, also when what arrived
            # of it parses (docs/models.md, "Output cap"); the ones before it are whole.
            cut = finish == "length" and ordinal == len(ordered) - 1
            if arguments is None or cut:
                reason = "truncated" if finish == "length" else "unparseable"
                invalid.append(
                    InvalidToolCall(id=call_id, name=buf.name, raw_arguments=raw, reason=reason)
                )
            else:
                calls.append(ToolCall(id=call_id, name=buf.name, arguments=arguments))
        return ModelReply(
            text=self.text,
            reasoning=None if self._reasoning is None else "".join(self._reasoning),
            tool_calls=tuple(calls),
            invalid_tool_calls=tuple(invalid),
            finish_reason=finish,
            usage=self.usage,
            response_id=self.response_id,
            refusal=None if self._refusal is None else "".join(self._refusal),
            provider_finish_reason=provider_finish,
        )

    def add_completion(self, body: bytes) -> ModelReply:
        """Fold a whole non-streamed ``chat.completion`` body and return the reply.

        For servers that ignore ``stream: true`` and answer with one JSON object.

        Raises:
            treadle.ModelCallError: kind ``invalid_response`` when the body is not a JSON
                object, or the classified kind of its ``error`` object.
        """
        try:
            payload = loads_json(body)
        except ValueError as exc:
            raise self.failure("invalid_response", f"body is not JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise self.failure("invalid_response", "body is not a JSON object")
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
                choice["delta"] = _indexed(choice["message"])
        self.add_chunk(payload)
        return self.reply()

    def _inband_error(self, chunk: Mapping[str, Any]) -> ModelCallError:
        message, code, type_ = error_fields(chunk)
        kind, retryable = classify_failure(status=None, code=code, type_=type_, message=message)
        return self.failure(kind, message or "error event in stream", retryable=retryable)

    def _add_choice(self, choice: Mapping[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, Mapping):
            self._add_delta(delta)
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self.finish_reason = "tool_calls" if finish == "function_call" else finish

    def _add_delta(self, delta: Mapping[str, Any]) -> None:
        reasoning = delta.get("reasoning_content")
        if not isinstance(reasoning, str) or not reasoning:
            reasoning = delta.get("reasoning", reasoning)
        if isinstance(reasoning, str):
            self._reasoning = self._append(self._reasoning, reasoning, "reasoning")
        text = _text_of(delta.get("content"))
        if text is not None:
            self._text = self._append(self._text, text, "text")
        refusal = delta.get("refusal")
        if isinstance(refusal, str):  # kept apart from the text, as the official SDK keeps it
            self._refusal = self._append(self._refusal, refusal, "text")
        taken: set[int] = set()  # the calls that earlier entries of this list went to
        for fragment in delta.get("tool_calls") or ():
            if isinstance(fragment, Mapping):
                taken.add(self._add_call_fragment(fragment, taken=taken))
        legacy = delta.get("function_call")
        if isinstance(legacy, Mapping):
            # The legacy single-call form: one call, no id, no index.
            self._add_call_fragment({"function": legacy}, legacy=True)

    def _append(self, parts: list[str] | None, fragment: str, channel: str) -> list[str]:
        parts = [] if parts is None else parts
        if fragment:
            parts.append(fragment)
            if self.on_delta is not None:
                self.on_delta(channel, fragment)
        return parts

    def _add_call_fragment(
        self,
        fragment: Mapping[str, Any],
        *,
        legacy: bool = False,
        taken: Collection[int] = frozenset(),
    ) -> int:
        """Fold one entry of a delta's ``tool_calls`` list (or the legacy ``function_call``).

        ``taken``: the indexes of the calls that earlier entries of the same list went to; an
        entry without index goes to none of them (`_index_without_index`).

        Returns:
            The index of the call the entry went to.
        """
        function = fragment.get("function")
        function = function if isinstance(function, Mapping) else {}
        call_id = _str(fragment.get("id"))
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        index = _LEGACY_INDEX if legacy else fragment.get("index")
        buf = self._buffer_for(index, call_id, legacy=legacy, taken=taken)
        buf.merge(call_id, _str(function.get("name")), arguments or "")
        return buf.index

    def _buffer_for(
        self,
        index: Any,
        call_id: str,
        *,
        legacy: bool = False,
        taken: Collection[int] = frozenset(),
    ) -> _CallBuffer:
        # a server's index is >= 0 (a negative one is read as none: the legacy call's is -1)
        if not legacy and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
            index = self._index_without_index(call_id, taken=taken)
        held = self._by_index.get(index)
        if held is None or (call_id and held.id and call_id != held.id):
            held = _CallBuffer(index=index)
            self._calls.append(held)
            self._by_index[index] = held
        return held

    def _index_without_index(self, call_id: str, *, taken: Collection[int]) -> int:
        """The index of a fragment that has none: its id's call, else a new or the last call.

        The entries of one delta's list are separate calls, each at its place, also when
        they share an id (docs/models.md, "Repairs": no call is dropped, none merged into
        another), so a fragment never goes to a call in ``taken`` (the calls earlier entries
        of its list went to). A fragment with an id goes to the first other call holding that
        id (its later fragments), and starts a new call when none does. One without an id
        continues the last call (its later fragments, as some servers send them) when it
        comes first in its list (``taken`` empty), and starts a new call otherwise.
        """
        calls = [buf for buf in self._calls if buf.index != _LEGACY_INDEX]
        for buf in calls:
            if call_id and buf.id == call_id and buf.index not in taken:
                return buf.index
        if not calls:
            return 0
        if call_id or taken:
            return max(buf.index for buf in calls) + 1
        return calls[-1].index

    def _synthetic_id(self, buf: _CallBuffer, ordinal: int) -> str:
        seed = f"{self.response_id}\0{buf.index}\0{ordinal}"
        if self.response_id is None:
            seed += f"\0{buf.name}\0{''.join(buf.arguments)}"
        return "call_" + hashlib.sha256(seed.encode()).hexdigest()[:24]


_LEGACY_INDEX = -1
"""The index of a legacy ``function_call`` (before any ``tool_calls`` index)."""


def _indexed(message: dict[str, Any]) -> dict[str, Any]:
    delta = dict(message)
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        calls = [c for c in calls if isinstance(c, dict)]
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(calls)]
    return delta


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, Mapping)]
        return "".join(t for t in texts if isinstance(t, str))
    return None


def _object_or_none(raw: str) -> dict[str, Any] | None:
    try:
        value = loads_json(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def loads_event(data: str) -> Any:
    """Decode one event's JSON: orjson first (fast), the stdlib for what it refuses (NaN).

    orjson reads integers beyond 64 bits as floats; that only matters for counts no server
    sends. Tool-call arguments arrive as JSON text inside the event and are decoded later by
    the stdlib, exactly.

    Raises:
        ValueError: ``data`` is not JSON (or nests too deeply, `loads_json`).
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return loads_json(data)
