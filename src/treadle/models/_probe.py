"""A one-shot check of a model endpoint, reporting the decision a run would make.

`probe` sends one request through the same client a run uses (`OpenAIChatClient` or
`AnthropicMessagesClient`), with bounded retries, and parses the client's own `ModelReply`
with the run's decision parser, so the decision it reports is the one a run's step record
would hold (docs/models.md, "Probing an endpoint").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import httpx
import trio
from cattrs.preconf.json import make_converter

from treadle._exceptions import ModelCallError, UsageError
from treadle._text import valid_unicode
from treadle.models._transport import CLOSE_GRACE_S
from treadle.parsers import strict_arguments
from treadle.ports import DecisionParser, ModelClient
from treadle.types import Message, ModelReply, ModelRequest, ParsedReply, ToolSpec

DEFAULT_PROMPT = "Reply with the single word: pong"

Protocol = Literal["openai", "anthropic"]
"""The wire protocols `probe` speaks: OpenAI chat completions, Anthropic Messages."""

PROTOCOLS: tuple[Protocol, ...] = ("openai", "anthropic")

_JSON = make_converter()


async def probe(
    *,
    base_url: str,
    model: str,
    api_key: str | None = None,
    tools: Sequence[ToolSpec] = (),
    messages: Sequence[Message] | None = None,
    max_output_tokens: int | None = None,
    max_attempts: int = 3,
    retry_initial_s: float = 1.0,
    max_retry_wait_s: float = 60.0,
    http_client: httpx.AsyncClient | None = None,
    first_byte_timeout_s: float = 60.0,
    idle_timeout_s: float = 60.0,
    protocol: Protocol = "openai",
    parser: DecisionParser | None = None,
) -> dict[str, Any]:
    """Send one request (retrying retryable failures) and report what came back.

    Args:
        base_url: the API root: ``http://127.0.0.1:8000/v1`` for ``openai``, what
            `AnthropicMessagesClient` takes (``https://api.anthropic.com``) for ``anthropic``.
        model: the model name.
        api_key: the key, or ``None`` (the Anthropic client then reads ``ANTHROPIC_API_KEY``).
        tools: tools to offer, in order.
        messages: the conversation; ``None`` sends one short user prompt.
        max_output_tokens: the output cap in tokens, or ``None`` for the client's default.
        max_attempts: HTTP attempts in all (at least 1).
        retry_initial_s: backoff before the second attempt in seconds, doubled after each
            attempt, used when the server gave no Retry-After.
        max_retry_wait_s: the longest wait in seconds; a server asking for longer ends the
            probe with its error instead.
        http_client: a client to use (the caller keeps ownership), or ``None``.
        first_byte_timeout_s: see `OpenAIChatClient`.
        idle_timeout_s: see `OpenAIChatClient`.
        protocol: ``openai`` or ``anthropic``.
        parser: the decision parser a run would use (default `NativeToolCallParser`).

    Returns:
        ``{"protocol", "model", <every field of ModelReply>, "decision", "error"}``: the
        reply's fields (``text``, ``reasoning``, ``reasoning_signature``, ``tool_calls``,
        ``invalid_tool_calls``, ``finish_reason``, ``usage``, ``response_id``, ``refusal``,
        ``provider_finish_reason``) under the names a run's model-result record uses, all
        present (``None`` or empty when absent), made what a run records (a call with
        non-finite numbers among the invalid calls, lone surrogates replaced: counted in
        ``surrogates_replaced``); ``decision`` is ``{"kind", "actions", "text",
        "feedback", "reason", "repairs"}`` as the parser decided, ``None`` when the call
        failed; ``error`` is ``None`` or ``{"kind", "message", "status", "retryable",
        "retry_after_s"}`` of the last failed attempt (``message`` is the provider's,
        credentials removed).

    Raises:
        UsageError: ``max_attempts`` is below 1, ``protocol`` is unknown, or the request
            cannot be built.
    """
    if max_attempts < 1:
        raise UsageError(f"max_attempts must be at least 1, got {max_attempts}")
    request = ModelRequest(
        messages=tuple(messages) if messages is not None else _default_messages(),
        tools=tuple(tools),
        model=model,
        max_output_tokens=max_output_tokens,
    )
    client = _client(protocol, base_url, api_key, http_client, first_byte_timeout_s, idle_timeout_s)
    try:
        reply, error = await _attempts(
            client, request, max_attempts, retry_initial_s, max_retry_wait_s
        )
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE_S):
            await client.aclose()
    report: dict[str, Any] = {"protocol": protocol, "model": model}
    if error is None:
        assert reply is not None
        # What a run records: strict-JSON arguments, valid Unicode (as the gateway does).
        recorded, replaced = valid_unicode(strict_arguments(reply))
        report |= _plain(recorded)
        report["surrogates_replaced"] = replaced
        report["decision"] = _decision(_parser(parser).parse(recorded, request.tools))
        report["error"] = None
    else:
        report |= _plain(ModelReply(usage=error.usage))
        report["surrogates_replaced"] = 0
        report["decision"] = None
        report["error"] = _plain(valid_unicode(error.info)[0])
    return report


def _client(
    protocol: str,
    base_url: str,
    api_key: str | None,
    http_client: httpx.AsyncClient | None,
    first_byte_timeout_s: float,
    idle_timeout_s: float,
) -> Any:
    options: dict[str, Any] = {
        "base_url": base_url,
        "api_key": api_key,
        "http_client": http_client,
        "first_byte_timeout_s": first_byte_timeout_s,
        "idle_timeout_s": idle_timeout_s,
    }
    if protocol == "openai":
        from treadle.models.openai import OpenAIChatClient

        return OpenAIChatClient(**options)
    if protocol == "anthropic":
        from treadle.models.anthropic import AnthropicMessagesClient

        return AnthropicMessagesClient(**options)
    raise UsageError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")


def _parser(parser: DecisionParser | None) -> DecisionParser:
    if parser is not None:
        return parser
    from treadle.parsers import NativeToolCallParser

    return NativeToolCallParser()


async def _attempts(
    client: ModelClient,
    request: ModelRequest,
    max_attempts: int,
    retry_initial_s: float,
    max_retry_wait_s: float,
) -> tuple[ModelReply | None, ModelCallError | None]:
    for attempt in range(1, max_attempts + 1):
        try:
            return await client.complete(request), None
        except ModelCallError as err:
            wait = err.info.retry_after_s
            if wait is None:
                wait = min(retry_initial_s * 2 ** (attempt - 1), max_retry_wait_s)
            if attempt == max_attempts or not err.info.retryable or wait > max_retry_wait_s:
                return None, err
            await trio.sleep(wait)
    raise AssertionError("unreachable: the last attempt always returns")


def _default_messages() -> tuple[Message, ...]:
    return (Message(role="user", content=DEFAULT_PROMPT),)


def _plain(value: Any) -> dict[str, Any]:
    """An attrs record as plain JSON data, every field present, under its record names."""
    data: dict[str, Any] = _JSON.unstructure(value)
    return data


def _decision(parsed: ParsedReply) -> dict[str, Any]:
    return {
        "kind": parsed.kind.value,
        "actions": [
            {"id": a.id, "name": a.name, "arguments": dict(a.arguments)} for a in parsed.actions
        ],
        "text": parsed.text,
        "feedback": parsed.feedback,
        "reason": parsed.reason,
        "repairs": list(parsed.repairs),
    }
