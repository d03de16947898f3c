"""The OpenAI-compatible chat-completions model client (streaming, one HTTP attempt per call).

`OpenAIChatClient` implements `treadle.ports.ModelClient` over ``POST {base_url}/chat/completions``
with ``stream: true``. It works with OpenAI and the servers that copy its API (vLLM, llama.cpp,
Ollama, LiteLLM, OpenRouter, DeepSeek ...). Retries belong to the model gateway, not here.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from treadle._exceptions import ModelCallError, UsageError
from treadle._text import loads_json
from treadle.models._accumulate import (
    StreamAccumulator,
    classify_failure,
    error_fields,
    parse_retry_after,
)
from treadle.models._transport import (
    StreamReader,
    load_image,
)
from treadle.ports import DeltaCallback
from treadle.types import (
    Attempt,
    ImageRef,
    ImageSource,
    JSONValue,
    Message,
    ModelErrorInfo,
    ModelReply,
    ModelRequest,
    ToolCall,
    ToolSpec,
)

_RESERVED_PARAMS = frozenset({"model", "messages", "tools", "stream", "stream_options"})
_CAP_KEYS = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})


class OpenAIChatClient(StreamReader[StreamAccumulator]):
    """One streaming chat-completions attempt per `complete` call.

    Args:
        base_url: the API root, e.g. ``https://api.openai.com/v1`` (``/chat/completions`` is
            appended).
        api_key: sent as ``Authorization: Bearer``; never appears in an error or record.
        http_client: a client to use, its connection limits kept; the caller keeps ownership
            and closes it. When ``None``, one without a connection limit is created here and
            closed by `aclose` (docs/models.md, "Connections and headers").
        connect_timeout_s: seconds to open the TCP/TLS connection.
        first_byte_timeout_s: seconds from the start of the attempt (a wait for a pooled
            connection included) to the first data event (SSE comments and keep-alive pings
            do not count).
        idle_timeout_s: seconds of silence allowed between reads once the first data event came
            (comments reset this timer).
        image_source: resolves ``ref:`` image references to bytes, sent as ``data:`` URLs
            (the run's executor's images are resolved too: docs/models.md, "Images").
        extra_headers: added to every request. The value of each one whose name marks a
            credential (``Authorization``, ``api-key`` ...:
            `treadle._credentials.CREDENTIAL_HEADER`) never appears in an error or
            record, as the API key.
        send_reasoning: send an assistant message's reasoning back as ``reasoning_content``
            (DeepSeek thinking mode needs it on tool-call turns; other servers may refuse it).
        max_tokens_field: the body key for the output cap (``max_completion_tokens`` for
            servers that refuse ``max_tokens``).
        native_output: the server supports ``response_format`` with a JSON schema, so an
            agent's output type is asked for natively under ``output_mode="auto"``; ``False``
            makes such agents use the final-answer tool instead (docs/structured-output.md).

    Raises:
        UsageError: ``base_url`` is not an http(s) URL a request can go to, a timeout is not
            positive, ``api_key`` is empty or holds whitespace, a control character or a
            character outside ASCII (a line break read from a file), an extra header is not
            one an HTTP request can carry, or ``base_url`` holds user information beside an
            ``Authorization`` header (``api_key``'s, or one of ``extra_headers`` or
            ``http_client``'s), which it would replace (docs/models.md, "Connections and
            headers", "What goes on the wire").
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
        native_output: bool = True,
    ) -> None:
        self._open(
            url=(base_url, "/chat/completions"),
            api_key=api_key,
            http_client=http_client,
            timeouts_s=(connect_timeout_s, first_byte_timeout_s, idle_timeout_s),
            image_source=image_source,
            headers={
                "accept": "text/event-stream",
                "content-type": "application/json",
                **(extra_headers or {}),
            },
        )
        self._send_reasoning = send_reasoning
        self._max_tokens_field = max_tokens_field
        self.native_output = native_output

    def check_params(self, params: Mapping[str, JSONValue], *, output: bool = False) -> None:
        """Refuse params that would replace a key this client sets itself.

        `request_body` applies it to every request, and a `treadle.Agent` asks it when the
        agent is built, so such params fail before a run is written (docs/models.md, "What
        goes on the wire").

        Args:
            params: the request's params, in the provider's own form.
            output: the request asks for a native structured output (``response_format``).

        Raises:
            UsageError: a param would replace ``model``, ``messages``, ``tools``, ``stream``,
                ``stream_options`` or (with ``output``) ``response_format``; names them.
        """
        reserved = set(_RESERVED_PARAMS.intersection(params))
        if output and "response_format" in params:
            reserved.add("response_format")
        if reserved:
            raise UsageError(f"request params may not set {sorted(reserved)}")

    def request_body(
        self, request: ModelRequest, *, run_images: ImageSource | None = None
    ) -> dict[str, Any]:
        """The JSON body sent for ``request``.

        A ``ref:`` image is resolved through this client's ``image_source``, then through
        ``run_images`` (the attempt's `treadle.types.Attempt.image_source`; docs/models.md,
        "Images").

        ``max_tokens`` (or ``max_tokens_field``) is the request's ``max_output_tokens`` when set
        and is never overridden by ``params``; the other params are merged in last. A
        request's ``output`` becomes ``response_format: {"type": "json_schema",
        "json_schema": {"name", "schema", "strict", "description"}}``. Images a tool call
        returned follow the run of ``tool`` messages they belong to as one ``user`` message, a
        caption naming the call before its images: a Chat Completions ``tool`` message's
        content is text only (OpenAI API reference, "Create chat completion",
        https://platform.openai.com/docs/api-reference/chat/create; docs/models.md, "Images
        returned by tools").

        Raises:
            UsageError: a param would replace ``model``, ``messages``, ``tools``, the stream
                settings or (when the request has an ``output``) ``response_format``; or an
                image is on a system or assistant message or cannot be resolved
                (`treadle.models.ImageSource`).
        """
        body: dict[str, Any] = {
            "model": request.model,
            "messages": self._messages(request.messages, run_images),
        }
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if request.max_output_tokens is not None:
            body[self._max_tokens_field] = request.max_output_tokens
        if request.output is not None:
            schema: dict[str, Any] = {
                "name": request.output.name,
                "schema": dict(request.output.schema),
                "strict": request.output.strict,
            }
            if request.output.description:
                schema["description"] = request.output.description
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        self.check_params(request.params, output=request.output is not None)
        for key, value in request.params.items():
            if request.max_output_tokens is None or key not in _CAP_KEYS:
                body[key] = value
        return body

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: DeltaCallback | None = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        """Send one streaming request and return the assembled reply.

        Args:
            request: the model-visible request.
            on_delta: called with ``("text" | "reasoning", fragment)`` as fragments arrive.
            attempt: the attempt's deadlines (each the smaller of it and this client's
                timeouts), usage observer (called with each usage the server reports) and
                the run's image source (`treadle.types.Attempt`).

        Returns:
            The reply. A tool call cut off by ``finish_reason: length`` is in
            ``invalid_tool_calls`` (reason ``truncated``), never in ``tool_calls``.

        Raises:
            UsageError: the request cannot be encoded (see `request_body`).
            treadle.ModelCallError: the attempt failed; ``.info.kind`` is one of those listed on
                `treadle.types.ModelErrorInfo`, ``.partial_text`` holds text received before
                the failure (diagnostics only); or the error ``attempt.report_usage`` raised.

        Cancellation:
            A checkpoint. Cancelling closes the response and its connection.
        """
        acc = StreamAccumulator(on_delta=on_delta, redact=self._redact)
        body = self.request_body(request, run_images=attempt.image_source)
        return await self._attempt(body, self._auth_headers(), acc, attempt)

    def _auth_headers(self) -> dict[str, str]:
        if self._api_key is None:
            return self._headers
        return {**self._headers, "authorization": f"Bearer {self._api_key}"}

    first_event = "first data event"

    def _add_body(self, acc: StreamAccumulator, body: bytes) -> ModelReply:
        return acc.add_completion(body)

    def _finished(self, acc: StreamAccumulator) -> bool:
        """Whether a finish reason came, then the usage ``include_usage`` asks for.

        That is all a stream sends before ``[DONE]``.
        """
        return acc.finish_reason is not None and acc.usage.output_tokens is not None

    def _end_of_stream(self, acc: StreamAccumulator, *, truncated: bool) -> ModelReply:
        if acc.finish_reason is not None and not truncated:
            return acc.reply()
        tail = "; the last event was cut off" if truncated else ""
        message = f"stream ended without [DONE] or a finish_reason after {acc.events} events{tail}"
        raise acc.failure("incomplete_stream", message, retryable=True)

    def _status_error(
        self, response: httpx.Response, body: bytes, acc: StreamAccumulator
    ) -> ModelCallError:
        try:
            payload: Any = loads_json(body)
        except ValueError:
            payload = body.decode("utf-8", "replace").strip()
        message, code, type_ = error_fields(payload)
        status = response.status_code
        kind, retryable = classify_failure(status=status, code=code, type_=type_, message=message)
        retry_after = parse_retry_after(response.headers, now_s=time.time(), body=payload)
        info = ModelErrorInfo(
            kind=kind,
            message=self._redact(f"HTTP {status}: {message}" if message else f"HTTP {status}"),
            retryable=retryable,
            retry_after_s=retry_after if retryable else None,
            status=status,
        )
        return ModelCallError(info, usage=acc.usage)

    def _messages(
        self, messages: Sequence[Message], images: ImageSource | None
    ) -> list[dict[str, Any]]:
        """The wire messages; tool images follow their run of tool messages (decision 0073).

        ``images`` is the run's image source, asked after this client's own.
        """
        out: list[dict[str, Any]] = []
        run: list[Message] = []  # the tool messages since the last other message
        for message in messages:
            if message.role != "tool" and run:
                out.extend(self._tool_images(run, images))
                run = []
            if message.role == "tool":
                run.append(message)
            out.append(self._message(message, images))
        out.extend(self._tool_images(run, images))
        return out

    def _tool_images(
        self, run: Sequence[Message], images: ImageSource | None
    ) -> list[dict[str, Any]]:
        with_images = [m for m in run if m.images]
        if not with_images:
            return []
        parts: list[dict[str, Any]] = []
        for message in with_images:
            parts.append({"type": "text", "text": _caption(message)})
            parts.extend(self._image_part(image, images) for image in message.images)
        return [{"role": "user", "content": parts}]

    def _message(self, message: Message, images: ImageSource | None) -> dict[str, Any]:
        out: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.images and message.role != "tool":
            if message.role != "user":
                raise UsageError(
                    f"images are only allowed on user and tool messages, not {message.role}"
                )
            out["content"] = self._content_parts(message, images)
        if message.role == "tool":
            out["tool_call_id"] = message.tool_call_id
            out["content"] = message.content or ""
        if message.tool_calls:
            out["tool_calls"] = [_call(call) for call in message.tool_calls]
        if self._send_reasoning and message.role == "assistant" and message.reasoning:
            out["reasoning_content"] = message.reasoning
        return out

    def _content_parts(self, message: Message, images: ImageSource | None) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if message.content:
            parts.append({"type": "text", "text": message.content})
        parts.extend(self._image_part(image, images) for image in message.images)
        return parts

    def _image_part(self, image: ImageRef, images: ImageSource | None) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": self._image_url(image, images)}}

    def _image_url(self, image: ImageRef, images: ImageSource | None) -> str:
        if not image.url.startswith("ref:"):
            return image.url
        media_type, data = load_image(image, self._image_source, images)
        return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def _caption(message: Message) -> str:
    """The text before a tool call's images in the ``user`` message that carries them.

    Chat Completions ``tool`` messages hold text only, so the images a call returned are sent
    in a ``user`` message right after the run of tool messages, each call's images after
    this caption naming the call (docs/decisions/0073-tool-images-on-chat-completions.md).
    """
    count = len(message.images)
    noun = "image" if count == 1 else "images"
    return f"[{count} {noun} returned by the call {message.tool_call_id} ({message.name}):]"


def _tool(spec: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": spec.name, "parameters": dict(spec.parameters)}
    if spec.description:
        function["description"] = spec.description
    return {"type": "function", "function": function}


def _call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": json.dumps(dict(call.arguments))}
    return {"id": call.id, "type": "function", "function": function}
