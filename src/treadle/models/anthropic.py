"""The Anthropic Messages model client (streaming, one HTTP attempt per call).

`AnthropicMessagesClient` implements `treadle.ports.ModelClient` over
``POST {base_url}/v1/messages`` with ``stream: true``. Retries, budgets and the attempt
deadline belong to the model gateway; this client enforces the connect, first-byte and idle
deadlines of one attempt (the tighter of its own and the attempt's) and reports running usage
to the attempt's observer (`treadle.types.Attempt`).
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Mapping
from typing import Any

import httpx

from treadle._credentials import redact_url_secrets
from treadle._exceptions import ModelCallError, UsageError
from treadle._text import loads_json
from treadle.models._accumulate import error_fields, parse_retry_after
from treadle.models._anthropic_stream import MessageAccumulator, classify_anthropic
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
    ToolSpec,
)

API_KEY_ENV = "ANTHROPIC_API_KEY"
"""The environment variable read when no ``api_key`` is given."""
ANTHROPIC_VERSION = "2023-06-01"
"""The ``anthropic-version`` header sent by default."""
DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` sent when neither the definition nor the params set one (it is required)."""
MAX_ERROR_BODY_BYTES = 64 * 1024
MAX_JSON_BODY_BYTES = 16 * 1024 * 1024
_RESERVED_PARAMS = frozenset({"model", "messages", "system", "tools", "stream"})
_CAP_KEYS = frozenset({"max_tokens", "max_completion_tokens", "max_output_tokens"})


class AnthropicMessagesClient(StreamReader[MessageAccumulator]):
    """One streaming Messages attempt per `complete` call.

    Args:
        base_url: the API root, e.g. ``https://api.anthropic.com`` (``/v1/messages`` is
            appended).
        api_key: sent as ``x-api-key``; when ``None``, read from ``ANTHROPIC_API_KEY`` (and
            no key is sent when that is unset). It never appears in an error or record.
        http_client: a client to use, its connection limits kept; the caller keeps ownership
            and closes it. When ``None``, one without a connection limit is created here and
            closed by `aclose` (docs/models.md, "Connections and headers").
        connect_timeout_s: seconds to open the TCP/TLS connection.
        first_byte_timeout_s: seconds from the start of the attempt (a wait for a pooled
            connection included) to the first event (a ``ping`` keep-alive is none).
        idle_timeout_s: seconds of silence allowed between reads after the first event
            (``ping`` events count as traffic).
        image_source: resolves ``ref:`` image references to bytes, sent as base64 sources
            (the run's executor's images are resolved too: docs/models.md, "Images").
        extra_headers: added to every request (e.g. ``anthropic-beta``). The value of each
            one whose name marks a credential (``x-goog-api-key``, ``Authorization`` ...:
            `treadle._credentials.CREDENTIAL_HEADER`) never appears in an error or
            record, as the API key.
        anthropic_version: the ``anthropic-version`` header.
        default_max_tokens: ``max_tokens`` when the request has no output cap and the params
            set none (the API requires one).

    Attributes:
        native_output: ``False``: the Messages API has no native structured output here, so an
            agent's output type is asked for with a final-answer tool
            (docs/structured-output.md).

    Raises:
        UsageError: ``base_url`` is not an http(s) URL a request can go to, a timeout is not
            positive, ``default_max_tokens`` is not positive, the API key is empty or holds
            whitespace, a control character or a character outside ASCII (a line break read
            from a file), an extra header or ``anthropic_version`` is not one an HTTP request
            can carry, or ``base_url`` holds user information beside an ``Authorization``
            header (of ``extra_headers`` or ``http_client``), which it would replace
            (docs/models.md, "Connections and headers", "What goes on the wire").
    """

    native_output = False

    def __init__(
        self,
        *,
        base_url: str = "https://api.anthropic.com",
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 10.0,
        first_byte_timeout_s: float = 60.0,
        idle_timeout_s: float = 60.0,
        image_source: ImageSource | None = None,
        extra_headers: Mapping[str, str] | None = None,
        anthropic_version: str = ANTHROPIC_VERSION,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        if default_max_tokens <= 0:
            raise UsageError(f"default_max_tokens must be positive, got {default_max_tokens}")
        self._open(
            url=(base_url, "/v1/messages"),
            api_key=api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None,
            http_client=http_client,
            timeouts_s=(connect_timeout_s, first_byte_timeout_s, idle_timeout_s),
            image_source=image_source,
            headers={
                "accept": "text/event-stream",
                "content-type": "application/json",
                "anthropic-version": anthropic_version,
                **(extra_headers or {}),
            },
        )
        self._default_max_tokens = default_max_tokens

    def __repr__(self) -> str:
        return f"AnthropicMessagesClient(url={redact_url_secrets(self._url)!r})"

    def check_params(self, params: Mapping[str, JSONValue], *, output: bool = False) -> None:
        """Refuse params that would replace a key this client sets itself.

        `request_body` applies it to every request, and a `treadle.Agent` asks it when the
        agent is built, so such params fail before a run is written (docs/models.md, "What
        goes on the wire").

        Args:
            params: the request's params, in the provider's own form.
            output: the request asks for a native structured output; this client has none,
                so it changes nothing here (`request_body` refuses such a request).

        Raises:
            UsageError: a param would replace ``model``, ``messages``, ``system``, ``tools``
                or ``stream``; names them. Or a ``max_tokens`` param is not a positive
                integer (`_check_max_tokens`).
        """
        reserved = _RESERVED_PARAMS.intersection(params)
        if reserved:
            raise UsageError(f"request params may not set {sorted(reserved)}")
        if "max_tokens" in params:
            _check_max_tokens(params["max_tokens"])

    def request_body(
        self, request: ModelRequest, *, run_images: ImageSource | None = None
    ) -> dict[str, Any]:
        """The JSON body sent for ``request``.

        ``max_tokens`` is the request's ``max_output_tokens`` when set (no param can raise
        it), else a ``max_tokens`` param, else ``default_max_tokens``; other output-cap params
        (``max_completion_tokens``, ``max_output_tokens``) are dropped. System messages become
        the top-level ``system``; tool messages become ``tool_result`` blocks of a user turn,
        whose ``content`` is a list of a ``text`` block and ``image`` blocks when the call
        returned images (a ``tool_result``'s content may hold text, image and document
        blocks: Anthropic's "Handle tool calls",
        https://platform.claude.com/docs/en/agents-and-tools/tool-use/handle-tool-calls);
        consecutive turns of one role are merged. Other params (``temperature``,
        ``thinking``, ``tool_choice`` ...) are merged in last, in Anthropic's own form. A
        ``ref:`` image is resolved through this client's ``image_source``, then through
        ``run_images`` (the attempt's `treadle.types.Attempt.image_source`; docs/models.md,
        "Images").

        Raises:
            UsageError: a param would replace ``model``, ``messages``, ``system``, ``tools`` or
                ``stream``, or a ``max_tokens`` param is not a positive integer
                (`check_params`); an image is on a system or assistant message or cannot be
                resolved (`treadle.models.ImageSource`); the
                request asks for a native structured ``output`` (this client has none: the
                agent's output type is asked for with a final-answer tool).
        """
        self.check_params(request.params)
        if request.output is not None:
            raise UsageError(
                "the Anthropic client has no native structured output: use output_mode='tool'"
            )
        system = [m.content for m in request.messages if m.role == "system" and m.content]
        body: dict[str, Any] = {
            "model": request.model,
            "max_tokens": self._max_tokens(request),
            "messages": self._turns(request.messages, run_images),
        }
        if system:
            body["system"] = "\n\n".join(system)
        if request.tools:
            body["tools"] = [_tool(spec) for spec in request.tools]
        body["stream"] = True
        for key, value in request.params.items():
            if key not in _CAP_KEYS:
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
            on_delta: called with ``("text" | "reasoning", fragment)`` as fragments arrive
                (thinking is ``reasoning``).
            attempt: the attempt's deadlines (each the smaller of it and this client's
                timeouts), usage observer (called with each usage the server reports,
                ``message_start`` included) and the run's image source
                (`treadle.types.Attempt`).

        Returns:
            The reply, with ``finish_reason`` in treadle's names (``stop``, ``tool_calls``,
            ``length`` ...). A tool call cut off by ``max_tokens`` is in ``invalid_tool_calls``
            (reason ``truncated``), never in ``tool_calls``.

        Raises:
            UsageError: the request cannot be encoded (see `request_body`).
            treadle.ModelCallError: the attempt failed; ``.info.kind`` is one of those listed on
                `treadle.types.ModelErrorInfo`, ``.usage`` holds the usage reported before the
                failure and ``.partial_text`` the text received (diagnostics only); or the
                error ``attempt.report_usage`` raised.

        Cancellation:
            A checkpoint. Cancelling closes the response and its connection.
        """
        acc = MessageAccumulator(on_delta=on_delta, redact=self._redact)
        body = self.request_body(request, run_images=attempt.image_source)
        return await self._attempt(body, self._auth_headers(), acc, attempt)

    def _auth_headers(self) -> dict[str, str]:
        if self._api_key is None:
            return self._headers
        return {**self._headers, "x-api-key": self._api_key}

    def _add_body(self, acc: MessageAccumulator, body: bytes) -> ModelReply:
        return acc.add_message(body)

    def _finished(self, acc: MessageAccumulator) -> bool:
        """``message_delta`` gave the stop reason: every content block came before it."""
        return acc.stop_reason is not None

    def _end_of_stream(self, acc: MessageAccumulator, *, truncated: bool) -> ModelReply:
        if acc.stop_reason is not None and not truncated:
            return acc.reply()  # message_delta came; only message_stop is missing
        tail = "; the last event was cut off" if truncated else ""
        message = f"stream ended without message_stop after {acc.events} events{tail}"
        raise acc.failure("incomplete_stream", message, retryable=True)

    def _status_error(
        self, response: httpx.Response, body: bytes, acc: MessageAccumulator
    ) -> ModelCallError:
        try:
            payload: Any = loads_json(body)
        except ValueError:
            payload = body.decode("utf-8", "replace").strip()
        message, _, type_ = error_fields(payload)
        status = response.status_code
        kind, retryable = classify_anthropic(status=status, type_=type_, message=message)
        retry_after = parse_retry_after(response.headers, now_s=time.time(), body=payload)
        info = ModelErrorInfo(
            kind=kind,
            message=self._redact(f"HTTP {status}: {message}" if message else f"HTTP {status}"),
            retryable=retryable,
            retry_after_s=retry_after if retryable else None,
            status=status,
        )
        return ModelCallError(info, usage=acc.usage)

    # ------------------------------------------------------------------ request building

    def _max_tokens(self, request: ModelRequest) -> int:
        """The ``max_tokens`` sent: the request's cap, else its param, else the default.

        `check_params` has refused a ``max_tokens`` param that is not a positive integer, so
        a param given is always the one sent (docs/models.md, "Output cap").
        """
        if request.max_output_tokens is not None:
            return request.max_output_tokens
        param = request.params.get("max_tokens")
        return param if isinstance(param, int) else self._default_max_tokens

    def _turns(
        self, messages: tuple[Message, ...], images: ImageSource | None
    ) -> list[dict[str, Any]]:
        turns: list[dict[str, Any]] = []
        for message in messages:
            if message.role == "system":
                continue
            role = "assistant" if message.role == "assistant" else "user"
            blocks = self._blocks(message, images)
            if turns and turns[-1]["role"] == role:
                turns[-1]["content"].extend(blocks)
            else:
                turns.append({"role": role, "content": blocks})
        for turn in turns:
            content = turn["content"]
            if len(content) == 1 and content[0]["type"] == "text":
                turn["content"] = content[0]["text"]
        return turns

    def _blocks(self, message: Message, images: ImageSource | None) -> list[dict[str, Any]]:
        if message.images and message.role not in ("user", "tool"):
            raise UsageError(
                f"images are only allowed on user and tool messages, not {message.role}"
            )
        if message.role == "tool":
            content: str | list[dict[str, Any]] = message.content or ""
            if message.images:
                text = [{"type": "text", "text": message.content}] if message.content else []
                content = [*text, *(self._image(image, images) for image in message.images)]
            return [
                {
                    "type": "tool_result",
                    "tool_use_id": message.tool_call_id or "",
                    "content": content,
                }
            ]
        blocks: list[dict[str, Any]] = []
        if message.role == "assistant" and message.reasoning and message.reasoning_signature:
            # Anthropic requires the signed thinking block of a tool-use turn back, unchanged.
            blocks.append(
                {
                    "type": "thinking",
                    "thinking": message.reasoning,
                    "signature": message.reasoning_signature,
                }
            )
        if message.content or (message.role == "user" and not message.images):
            blocks.append({"type": "text", "text": message.content or ""})
        blocks.extend(self._image(image, images) for image in message.images)
        for call in message.tool_calls:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": dict(call.arguments),
                }
            )
        return blocks

    def _image(self, image: ImageRef, images: ImageSource | None) -> dict[str, Any]:
        if not image.url.startswith("ref:"):
            return {"type": "image", "source": {"type": "url", "url": image.url}}
        media_type, data = load_image(image, self._image_source, images)
        encoded = base64.b64encode(data).decode("ascii")
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": encoded},
        }


def _check_max_tokens(value: JSONValue) -> None:
    """Refuse a ``max_tokens`` param that is not a positive integer.

    The Messages API requires an integer number of tokens. Sending ``default_max_tokens`` in
    place of such a value would raise the output allowed without a word (``100.0`` or
    ``"100"`` would ask for 4,096 tokens) (docs/models.md, "Output cap"; docs/decisions/0133).

    Raises:
        UsageError: ``value`` is not an ``int`` (a ``bool``, a float such as ``100.0``, a
            string or ``None`` included) or is below 1; the message quotes it.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"the max_tokens param must be a positive integer, got {value!r}")


def _tool(spec: ToolSpec) -> dict[str, Any]:
    tool: dict[str, Any] = {"name": spec.name, "input_schema": dict(spec.parameters)}
    if spec.description:
        tool["description"] = spec.description
    return tool
