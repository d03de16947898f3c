"""A one-shot check that an OpenAI-compatible endpoint answers, with bounded retries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import trio

from treadle._exceptions import ModelCallError, UsageError
from treadle.models._transport import CLOSE_GRACE_S
from treadle.models.openai import OpenAIChatClient
from treadle.types import Message, ModelReply, ModelRequest, ToolSpec, Usage

DEFAULT_PROMPT = "Reply with the single word: pong"


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
) -> dict[str, Any]:
    """Send one chat request (retrying retryable failures) and report what came back.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name.
        api_key: the bearer token, or ``None``.
        tools: tools to offer, in order.
        messages: the conversation; ``None`` sends one short user prompt.
        max_output_tokens: the output cap in tokens, or ``None`` for the server default.
        max_attempts: HTTP attempts in all (at least 1).
        retry_initial_s: backoff before the second attempt in seconds, doubled after each
            attempt, used when the server gave no Retry-After.
        max_retry_wait_s: the longest wait in seconds; a server asking for longer ends the
            probe with its error instead.
        http_client: a client to use (the caller keeps ownership), or ``None``.
        first_byte_timeout_s: see `OpenAIChatClient`.
        idle_timeout_s: see `OpenAIChatClient`.

    Returns:
        ``{"text", "tool_calls": [{"id", "name", "arguments"}], "finish_reason", "usage",
        "error"}``: ``usage`` is ``{"input_tokens", "output_tokens", "reasoning_tokens",
        "total_tokens"}`` (each ``None`` when unreported) or ``None`` when nothing was
        reported; ``error`` is ``None`` or ``{"kind", "retryable", "retry_after_s"}`` of the
        last failed attempt.

    Raises:
        UsageError: ``max_attempts`` is below 1, or the request cannot be built.
    """
    if max_attempts < 1:
        raise UsageError(f"max_attempts must be at least 1, got {max_attempts}")
    request = ModelRequest(
        messages=tuple(messages) if messages is not None else _default_messages(),
        tools=tuple(tools),
        model=model,
        max_output_tokens=max_output_tokens,
    )
    client = OpenAIChatClient(
        base_url=base_url,
        api_key=api_key,
        http_client=http_client,
        first_byte_timeout_s=first_byte_timeout_s,
        idle_timeout_s=idle_timeout_s,
    )
    try:
        return await _attempts(client, request, max_attempts, retry_initial_s, max_retry_wait_s)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE_S):
            await client.aclose()


async def _attempts(
    client: OpenAIChatClient,
    request: ModelRequest,
    max_attempts: int,
    retry_initial_s: float,
    max_retry_wait_s: float,
) -> dict[str, Any]:
    for attempt in range(1, max_attempts + 1):
        try:
            return _success(await client.complete(request))
        except ModelCallError as err:
            wait = err.info.retry_after_s
            if wait is None:
                wait = min(retry_initial_s * 2 ** (attempt - 1), max_retry_wait_s)
            if attempt == max_attempts or not err.info.retryable or wait > max_retry_wait_s:
                return _failure(err)
            await trio.sleep(wait)
    raise AssertionError("unreachable: the last attempt always returns")


def _default_messages() -> tuple[Message, ...]:
    return (Message(role="user", content=DEFAULT_PROMPT),)


def _usage(usage: Usage) -> dict[str, int | None] | None:
    counts = {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
        "total_tokens": usage.total_tokens,
    }
    return None if all(v is None for v in counts.values()) else counts


def _success(reply: ModelReply) -> dict[str, Any]:
    return {
        "text": reply.text,
        "tool_calls": [
            {"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in reply.tool_calls
        ],
        "finish_reason": reply.finish_reason,
        "usage": _usage(reply.usage),
        "error": None,
    }


def _failure(err: ModelCallError) -> dict[str, Any]:
    info = err.info
    return {
        "text": None,
        "tool_calls": [],
        "finish_reason": None,
        "usage": _usage(err.usage),
        "error": {
            "kind": info.kind,
            "retryable": info.retryable,
            "retry_after_s": info.retry_after_s,
        },
    }
