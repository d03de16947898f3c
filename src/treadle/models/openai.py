"""The OpenAI-compatible chat-completions model client (streaming, one HTTP attempt per call).

`OpenAIChatClient` implements `treadle.ports.ModelClient` over ``POST {base_url}/chat/completions``
with ``stream: true``. It works with OpenAI and the servers that copy its API (vLLM, llama.cpp,
Ollama, LiteLLM, OpenRouter, DeepSeek ...). Retries belong to the model gateway, not here.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import httpx
import trio

from treadle._exceptions import ModelCallError, UsageError
from treadle.models._accumulate import (
    StreamAccumulator,
    classify_failure,
    error_fields,
    parse_retry_after,
)
from treadle.models._sse import SSEDecodeError, SSEDecoder
from treadle.ports import DeltaCallback
from treadle.types import (
    ImageRef,
    Message,
    ModelErrorInfo,
    ModelReply,
    ModelRequest,
    ToolCall,
    ToolSpec,
    Usage,
)

ImageSource = Callable[[ImageRef], bytes]
"""Resolves a ``ref:<name>`` image to its bytes; raises `LookupError` or `OSError` if missing."""

UsageObserver = Callable[[Usage], None]
"""Receives the usage reported so far in the current attempt (running counts, tokens).

It may raise `treadle.ModelCallError` to end the attempt (the model gateway does so when the
reported usage crosses the run's remaining token budget); clients let that error propagate.
"""

_usage_observer: contextvars.ContextVar[UsageObserver | None] = contextvars.ContextVar(
    "treadle_usage_observer", default=None
)


@contextlib.contextmanager
def observe_usage(observer: UsageObserver) -> Iterator[None]:
    """Route `report_usage` calls made by the current task to ``observer`` inside the block.

    The model gateway wraps each attempt in this block, so a client needs no extra argument
    (the `treadle.ports.ModelClient` seam is unchanged).
    """
    token = _usage_observer.set(observer)
    try:
        yield
    finally:
        _usage_observer.reset(token)


_attempt_deadlines: contextvars.ContextVar[tuple[float, float, float] | None] = (
    contextvars.ContextVar("treadle_attempt_deadlines", default=None)
)


@contextlib.contextmanager
def attempt_deadlines(*, connect_s: float, first_byte_s: float, idle_s: float) -> Iterator[None]:
    """Tighten the connect, first-byte and stream-idle deadlines of attempts made in the block.

    A client applies the smaller of these and its own settings (seconds). The model gateway
    sets them from the agent's `treadle.types.Limits` for each attempt.
    """
    token = _attempt_deadlines.set((connect_s, first_byte_s, idle_s))
    try:
        yield
    finally:
        _attempt_deadlines.reset(token)


def current_deadlines() -> tuple[float, float, float] | None:
    """``(connect_s, first_byte_s, idle_s)`` set by `attempt_deadlines`, or ``None``."""
    return _attempt_deadlines.get()


def report_usage(usage: Usage) -> None:
    """Report the usage the server has reported so far in this attempt.

    A client calls this each time the server reports (running or final) usage. Without an
    observer (outside a gateway attempt) it does nothing.

    Raises:
        treadle.ModelCallError: the observer ended the attempt (e.g. kind ``token_budget``).
    """
    observer = _usage_observer.get()
    if observer is not None:
        observer(usage)


CLOSE_GRACE_S = 1.0
"""Seconds a shielded close of the HTTP response may take after a failure or cancellation."""
DRAIN_S = 0.25
"""Seconds to wait for the end of the body after the stream's last event (keeps the
connection reusable; a server that holds the body open past this loses the connection)."""
MAX_ERROR_BODY_BYTES = 64 * 1024
MAX_JSON_BODY_BYTES = 16 * 1024 * 1024
_RESERVED_PARAMS = frozenset({"model", "messages", "tools", "stream", "stream_options"})
_CAP_KEYS = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))


class OpenAIChatClient:
    """One streaming chat-completions attempt per `complete` call.

    Args:
        base_url: the API root, e.g. ``https://api.openai.com/v1`` (``/chat/completions`` is
            appended).
        api_key: sent as ``Authorization: Bearer``; never appears in an error or record.
        http_client: a client to use; the caller keeps ownership and closes it. When ``None``,
            one is created here and closed by `aclose`.
        connect_timeout_s: seconds to open the TCP/TLS connection.
        first_byte_timeout_s: seconds from sending the request to the first data event (SSE
            comments and keep-alive pings do not count).
        idle_timeout_s: seconds of silence allowed between reads once the first data event came
            (comments reset this timer).
        image_source: resolves ``ref:`` image references to bytes, sent as ``data:`` URLs.
        extra_headers: added to every request.
        send_reasoning: send an assistant message's reasoning back as ``reasoning_content``
            (DeepSeek thinking mode needs it on tool-call turns; other servers may refuse it).
        max_tokens_field: the body key for the output cap (``max_completion_tokens`` for
            servers that refuse ``max_tokens``).

    Raises:
        UsageError: ``base_url`` is not an http(s) URL, or a timeout is not positive.
    """

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 10.0,
        first_byte_timeout_s: float = 60.0,
        idle_timeout_s: float = 60.0,
        image_source: ImageSource | None = None,
        extra_headers: Mapping[str, str] | None = None,
        send_reasoning: bool = False,
        max_tokens_field: str = "max_tokens",
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise UsageError(f"base_url must start with http:// or https://, got {base_url!r}")
        timeouts = (connect_timeout_s, first_byte_timeout_s, idle_timeout_s)
        if not all(t > 0 for t in timeouts):
            raise UsageError(f"timeouts must be positive seconds, got {timeouts}")
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._api_key = api_key
        self._owns_client = http_client is None
        self._client = http_client if http_client is not None else httpx.AsyncClient()
        self._connect_s = connect_timeout_s
        self._first_byte_s = first_byte_timeout_s
        self._idle_s = idle_timeout_s
        self._image_source = image_source
        self._headers = {
            "accept": "text/event-stream",
            "content-type": "application/json",
            **(extra_headers or {}),
        }
        self._send_reasoning = send_reasoning
        self._max_tokens_field = max_tokens_field

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it (a given client stays open)."""
        if self._owns_client:
            await self._client.aclose()

    def request_body(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body sent for ``request``.

        ``max_tokens`` (or ``max_tokens_field``) is the request's ``max_output_tokens`` when set
        and is never overridden by ``params``; the other params are merged in last.

        Raises:
            UsageError: a param would replace ``model``, ``messages``, ``tools`` or the stream
                settings; or an image cannot be resolved (see `OpenAIChatClient`).
        """
        body: dict[str, Any] = {
            "model": request.model,
            "messages": [self._message(m) for m in request.messages],
        }
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if request.max_output_tokens is not None:
            body[self._max_tokens_field] = request.max_output_tokens
        reserved = _RESERVED_PARAMS.intersection(request.params)
        if reserved:
            raise UsageError(f"request params may not set {sorted(reserved)}")
        for key, value in request.params.items():
            if request.max_output_tokens is None or key not in _CAP_KEYS:
                body[key] = value
        return body

    async def complete(
        self, request: ModelRequest, *, on_delta: DeltaCallback | None = None
    ) -> ModelReply:
        """Send one streaming request and return the assembled reply.

        Args:
            request: the model-visible request.
            on_delta: called with ``("text" | "reasoning", fragment)`` as fragments arrive.

        Returns:
            The reply. A tool call cut off by ``finish_reason: length`` is in
            ``invalid_tool_calls`` (reason ``truncated``), never in ``tool_calls``.

        Raises:
            UsageError: the request cannot be encoded (see `request_body`).
            treadle.ModelCallError: the attempt failed; ``.info.kind`` is one of those listed on
                `treadle.types.ModelErrorInfo`, ``.partial_text`` holds text received before
                the failure (diagnostics only).

        Cancellation:
            A checkpoint. Cancelling closes the response and its connection.
        """
        connect_s, first_byte_s, idle_s = self._deadlines()
        http_request = self._client.build_request(
            "POST",
            self._url,
            content=_encode(self.request_body(request)),
            headers=self._auth_headers(),
            timeout=httpx.Timeout(connect_s, read=None, write=None),
        )
        acc = StreamAccumulator(on_delta=on_delta, redact=self._redact)
        deadline = trio.current_time() + first_byte_s
        response = await self._send(http_request, acc, deadline)
        chunks = response.aiter_bytes()
        try:
            return await self._read_response(response, chunks, acc, deadline, idle_s)
        finally:
            await _dispose(response, chunks)

    def _deadlines(self) -> tuple[float, float, float]:
        """``(connect, first byte, idle)`` seconds: this client's, tightened by the attempt's."""
        own = (self._connect_s, self._first_byte_s, self._idle_s)
        attempt = current_deadlines()
        if attempt is None:
            return own
        return (min(own[0], attempt[0]), min(own[1], attempt[1]), min(own[2], attempt[2]))

    def _auth_headers(self) -> dict[str, str]:
        if self._api_key is None:
            return self._headers
        return {**self._headers, "authorization": f"Bearer {self._api_key}"}

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    async def _send(
        self, http_request: httpx.Request, acc: StreamAccumulator, deadline: float
    ) -> httpx.Response:
        with trio.move_on_at(deadline):
            try:
                return await self._client.send(http_request, stream=True)
            except httpx.TimeoutException as exc:
                raise acc.failure("timeout", f"connect: {exc!r}", retryable=True) from exc
            except httpx.HTTPError as exc:
                raise acc.failure("connection", repr(exc), retryable=True) from exc
        raise acc.failure("timeout", "no response headers in time", retryable=True)

    async def _read_response(
        self,
        response: httpx.Response,
        chunks: AsyncIterator[bytes],
        acc: StreamAccumulator,
        deadline: float,
        idle_s: float,
    ) -> ModelReply:
        if not 200 <= response.status_code < 300:
            try:
                body = await self._read_body(chunks, acc, MAX_ERROR_BODY_BYTES, idle_s)
            except ModelCallError:
                body = b""  # the status alone classifies the failure
            raise self._status_error(response, body, acc)
        content_type = response.headers.get("content-type", "").lower()
        if "json" in content_type:
            body = await self._read_body(chunks, acc, MAX_JSON_BODY_BYTES, idle_s)
            reply = acc.add_completion(body)
            report_usage(reply.usage)
            return reply
        if content_type and "event-stream" not in content_type:
            raise acc.failure("invalid_response", f"unexpected content-type {content_type!r}")
        return await self._read_stream(chunks, acc, deadline, idle_s)

    async def _read_stream(
        self, chunks: AsyncIterator[bytes], acc: StreamAccumulator, deadline: float, idle_s: float
    ) -> ModelReply:
        decoder = SSEDecoder()
        reported = acc.usage
        # One scope for the whole stream, its deadline moved on each read (a scope per read
        # costs more than the rest of the per-chunk work).
        with trio.CancelScope(deadline=deadline) as scope:
            while not acc.done:
                if acc.events:
                    scope.deadline = trio.current_time() + idle_s
                try:
                    chunk = await anext(chunks, None)
                except httpx.HTTPError as exc:
                    message = f"stream broken after {acc.events} events: {exc!r}"
                    raise acc.failure("incomplete_stream", message, retryable=True) from exc
                if chunk is None:
                    return _end_of_stream(acc, truncated=decoder.close())
                for event in _decode(decoder, chunk, acc):
                    acc.add(event.data, event=event.event)
                    if acc.usage is not reported:  # the server reported (running) usage
                        reported = acc.usage
                        report_usage(reported)
        if not scope.cancelled_caught:
            await drain(chunks)
            return acc.reply()
        what = "next read (stream idle)" if acc.events else "first data event"
        raise acc.failure("timeout", f"no {what} in time", retryable=True)

    async def _next_chunk(
        self,
        chunks: AsyncIterator[bytes],
        acc: StreamAccumulator,
        deadline: float | None,
        idle_s: float,
    ) -> bytes | None:
        what = "first data event" if deadline is not None else "next read (stream idle)"
        deadline = deadline if deadline is not None else trio.current_time() + idle_s
        with trio.move_on_at(deadline):
            try:
                return await anext(chunks, None)
            except httpx.HTTPError as exc:
                message = f"stream broken after {acc.events} events: {exc!r}"
                raise acc.failure("incomplete_stream", message, retryable=True) from exc
        raise acc.failure("timeout", f"no {what} in time", retryable=True)

    async def _read_body(
        self, chunks: AsyncIterator[bytes], acc: StreamAccumulator, limit: int, idle_s: float
    ) -> bytes:
        parts: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = await self._next_chunk(chunks, acc, None, idle_s)
            if chunk is None:
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)[:limit]

    def _status_error(
        self, response: httpx.Response, body: bytes, acc: StreamAccumulator
    ) -> ModelCallError:
        try:
            payload: Any = json.loads(body)
        except ValueError:
            payload = body.decode("utf-8", "replace").strip()
        message, code, type_ = error_fields(payload)
        status = response.status_code
        kind, retryable = classify_failure(status=status, code=code, type_=type_, message=message)
        retry_after = parse_retry_after(response.headers, now_s=time.time())
        info = ModelErrorInfo(
            kind=kind,
            message=self._redact(f"HTTP {status}: {message}" if message else f"HTTP {status}"),
            retryable=retryable,
            retry_after_s=retry_after if retryable else None,
            status=status,
        )
        return ModelCallError(info, usage=acc.usage)

    def _message(self, message: Message) -> dict[str, Any]:
        out: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.images:
            if message.role != "user":
                raise UsageError(f"images are only allowed on user messages, not {message.role}")
            out["content"] = self._content_parts(message)
        if message.role == "tool":
            out["tool_call_id"] = message.tool_call_id
            out["content"] = message.content or ""
        if message.tool_calls:
            out["tool_calls"] = [_call(call) for call in message.tool_calls]
        if self._send_reasoning and message.role == "assistant" and message.reasoning:
            out["reasoning_content"] = message.reasoning
        return out

    def _content_parts(self, message: Message) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if message.content:
            parts.append({"type": "text", "text": message.content})
        for image in message.images:
            parts.append({"type": "image_url", "image_url": {"url": self._image_url(image)}})
        return parts

    def _image_url(self, image: ImageRef) -> str:
        if not image.url.startswith("ref:"):
            return image.url
        if self._image_source is None:
            raise UsageError(f"image {image.url!r} needs an image_source, and none was given")
        try:
            data = self._image_source(image)
        except (LookupError, OSError) as exc:
            raise UsageError(f"image {image.url!r} could not be loaded: {exc!r}") from exc
        if image.digest is not None and image.digest != _digest(data):
            raise UsageError(f"image {image.url!r}: bytes do not match digest {image.digest}")
        media_type = image.media_type or _sniff(data)
        if media_type is None:
            raise UsageError(f"image {image.url!r}: unknown media type; set ImageRef.media_type")
        return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def _tool(spec: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": spec.name, "parameters": dict(spec.parameters)}
    if spec.description:
        function["description"] = spec.description
    return {"type": "function", "function": function}


def _call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": json.dumps(dict(call.arguments))}
    return {"id": call.id, "type": "function", "function": function}


def _encode(body: dict[str, Any]) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise UsageError(f"the request cannot be encoded as JSON: {exc}") from exc


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _sniff(data: bytes) -> str | None:
    for magic, media_type in _MAGIC:
        if data.startswith(magic):
            return media_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


async def drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows a stream's last event, so the connection goes back to the pool.

    Gives up after `DRAIN_S` seconds or on a transport error (the reply is complete by then;
    the connection is closed instead of reused).
    """
    with trio.move_on_after(DRAIN_S), contextlib.suppress(httpx.HTTPError):
        while await anext(chunks, None) is not None:
            pass


async def _dispose(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """Close the response and its connection, even when the caller is cancelled.

    httpx reads the body through nested async generators; iterating once more after the close
    ends every one of them (with an error from the closed connection, which is expected here),
    so none is left suspended for the garbage collector.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE_S):
        await response.aclose()
        with contextlib.suppress(Exception):
            while await anext(chunks, None) is not None:
                pass


def _decode(decoder: SSEDecoder, chunk: bytes, acc: StreamAccumulator) -> list[Any]:
    try:
        return decoder.feed(chunk)
    except SSEDecodeError as exc:
        raise acc.failure("invalid_response", str(exc)) from exc


def _end_of_stream(acc: StreamAccumulator, *, truncated: bool) -> ModelReply:
    if acc.finish_reason is not None and not truncated:
        return acc.reply()
    tail = "; the last event was cut off" if truncated else ""
    message = f"stream ended without [DONE] or a finish_reason after {acc.events} events{tail}"
    raise acc.failure("incomplete_stream", message, retryable=True)
