"""AnthropicMessagesClient: error classification, truncated streams, deadlines, cancellation."""

from __future__ import annotations

import email.utils
import json
import time

import pytest
import trio
from test_anthropic_events import (
    PING,
    SSE,
    block_start,
    error_event,
    message_start,
    text_delta,
    text_reply,
)

from treadle._exceptions import ModelCallError
from treadle.models import AnthropicMessagesClient
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import Message, ModelRequest

KEY = "sk-ant-api03-secret-123456"
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="claude-x")
JSON = {"content-type": "application/json"}


async def fail(response: CannedResponse, **client_kwargs) -> ModelCallError:
    async with open_loopback_server(canned(response)) as server:
        client = AnthropicMessagesClient(base_url=server.base_url, api_key=KEY, **client_kwargs)
        try:
            with trio.fail_after(10), pytest.raises(ModelCallError) as info:
                await client.complete(REQUEST)
        finally:
            await client.aclose()
    err = info.value
    assert KEY not in str(err) and KEY not in err.info.message and KEY not in err.partial_text
    return err


def api_error(type_: str, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": type_, "message": message}}).encode()


# --------------------------------------------------------------------------- HTTP errors


@pytest.mark.parametrize(
    ("status", "body", "kind", "retryable"),
    [
        (400, api_error("invalid_request_error", "messages: field required"), "bad_request", False),
        (400, api_error("invalid_request_error", "prompt is too long: 208310 tokens > 200000 maximum"),
         "context_length_exceeded", False),
        (401, api_error("authentication_error", f"invalid x-api-key {KEY}"), "auth", False),
        (403, api_error("permission_error", "not allowed"), "auth", False),
        (404, api_error("not_found_error", "model: claude-x"), "not_found", False),
        (413, api_error("request_too_large", "too large"), "bad_request", False),
        (500, api_error("api_error", "internal"), "server_error", True),
        (529, api_error("overloaded_error", "Overloaded"), "server_error", True),
        (502, b"<html>bad gateway</html>", "server_error", True),
    ],
)  # fmt: skip
async def test_http_errors_are_classified(status, body, kind, retryable):
    err = await fail(CannedResponse(status=status, headers=JSON, chunks=[body]))
    assert (err.info.kind, err.info.retryable, err.info.status) == (kind, retryable, status)
    assert err.info.retry_after_s is None


async def test_rate_limit_carries_retry_after_seconds_and_http_date():
    body = api_error("rate_limit_error", "Number of request tokens has exceeded your limit")
    err = await fail(
        CannedResponse(status=429, headers={**JSON, "retry-after": "17"}, chunks=[body])
    )
    assert (err.info.kind, err.info.retryable, err.info.retry_after_s) == ("rate_limited", True, 17)
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    err = await fail(CannedResponse(status=429, headers={"retry-after": future}, chunks=[body]))
    assert 25 <= err.info.retry_after_s <= 31


async def test_non_retryable_errors_carry_no_retry_after():
    body = api_error("invalid_request_error", "bad")
    err = await fail(
        CannedResponse(status=400, headers={**JSON, "retry-after": "5"}, chunks=[body])
    )
    assert err.info.retry_after_s is None


# --------------------------------------------------------------------------- in-stream failures


@pytest.mark.parametrize(
    ("type_", "message", "kind", "retryable"),
    [
        ("overloaded_error", "Overloaded", "server_error", True),
        ("api_error", "Internal server error", "server_error", True),
        ("rate_limit_error", "slow down", "rate_limited", True),
        ("invalid_request_error", "bad", "bad_request", False),
    ],
)
async def test_error_event_mid_stream_keeps_partial_text_and_usage(type_, message, kind, retryable):
    chunks = [
        message_start(30, 1),
        block_start(0, {"type": "text", "text": ""}),
        text_delta(0, "part"),
        error_event(type_, message),
    ]
    err = await fail(CannedResponse(headers=SSE, chunks=chunks))
    assert (err.info.kind, err.info.retryable, err.partial_text) == (kind, retryable, "part")
    assert (err.usage.input_tokens, err.usage.output_tokens) == (30, 1)


@pytest.mark.parametrize(
    ("chunks", "abort"),
    [
        (text_reply("a")[:4], None),  # ends cleanly, but before message_delta / message_stop
        (text_reply("a")[:4], "close"),  # connection closed mid-body
        ([*text_reply("a")[:3], b'event: content_block_delta\ndata: {"type": "content'], None),
    ],
)
async def test_truncated_streams_are_incomplete_and_retryable(chunks, abort):
    err = await fail(CannedResponse(headers=SSE, chunks=chunks, abort=abort))
    assert (err.info.kind, err.info.retryable) == ("incomplete_stream", True)
    assert err.usage.input_tokens == 25  # reported in message_start before the cut


async def test_stream_ending_after_message_delta_without_message_stop_is_complete():
    async with open_loopback_server(
        canned(CannedResponse(headers=SSE, chunks=text_reply("ok")[:-1]))
    ) as server:
        client = AnthropicMessagesClient(base_url=server.base_url, api_key=KEY)
        reply = await client.complete(REQUEST)
        await client.aclose()
    assert (reply.text, reply.finish_reason) == ("ok", "stop")


@pytest.mark.parametrize(
    "chunk",
    [
        b"event: message_start\ndata: not json\n\n",
        b"event: message_start\ndata: [1, 2]\n\n",
        b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 7, '
        b'"delta": {"type": "text_delta", "text": "x"}}\n\n',
        b'event: message_start\ndata: {"type": "message_start"}\n\n',
    ],
)
async def test_malformed_events_are_invalid_response(chunk):
    err = await fail(CannedResponse(headers=SSE, chunks=[chunk, *text_reply("a")]))
    assert (err.info.kind, err.info.retryable) == ("invalid_response", False)


async def test_unexpected_content_type_is_invalid_response():
    err = await fail(CannedResponse(headers={"content-type": "text/html"}, chunks=[b"<html>"]))
    assert err.info.kind == "invalid_response"


async def test_connection_refused_is_a_retryable_connection_error():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    client = AnthropicMessagesClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
    with pytest.raises(ModelCallError) as info:
        await client.complete(REQUEST)
    await client.aclose()
    assert (info.value.info.kind, info.value.info.retryable) == ("connection", True)
    assert KEY not in str(info.value)


# --------------------------------------------------------------------------- deadlines


async def test_first_byte_deadline_covers_slow_headers():
    start = trio.current_time()
    err = await fail(
        CannedResponse(headers=SSE, chunks=text_reply("a"), delay_s=5), first_byte_timeout_s=0.2
    )
    assert (err.info.kind, err.info.retryable) == ("timeout", True)
    assert trio.current_time() - start < 3


async def test_idle_deadline_after_the_first_event():
    chunks = [*text_reply("a")[:4], 5.0, *text_reply("a")[4:]]
    err = await fail(CannedResponse(headers=SSE, chunks=chunks), idle_timeout_s=0.2)
    assert (err.info.kind, err.info.retryable, err.partial_text) == ("timeout", True, "a")
    assert "idle" in err.info.message


async def test_pings_before_the_message_start_do_not_stop_the_first_byte_deadline():
    # A ping counted as the first event: a server sending nothing but pings moved the
    # attempt to the idle deadline, which each ping renews, and only the attempt total ended it.
    chunks = [*[PING] * 40, *text_reply("a")]  # one every 0.05 s: 2 s of pings in all
    err = await fail(
        CannedResponse(headers=SSE, chunks=chunks, pause_s=0.05),
        first_byte_timeout_s=0.5,
        idle_timeout_s=5,
    )
    assert (err.info.kind, err.info.retryable) == ("timeout", True)
    assert err.info.message == "no first event in time"


async def test_pings_keep_a_slow_stream_alive():
    pings = [PING] * 10  # one every 0.05 s: 0.5 s in all, idle limit 0.3 s
    chunks = [*text_reply("a")[:4], *pings, *text_reply("a")[4:]]
    async with open_loopback_server(
        canned(CannedResponse(headers=SSE, chunks=chunks, pause_s=0.05))
    ) as server:
        client = AnthropicMessagesClient(base_url=server.base_url, idle_timeout_s=0.3)
        reply = await client.complete(REQUEST)
        await client.aclose()
    assert reply.text == "a"


async def test_cancelling_the_call_closes_the_connection():
    chunks = [*text_reply("a")[:4], 30.0, *text_reply("a")[4:]]
    async with open_loopback_server(canned(CannedResponse(headers=SSE, chunks=chunks))) as server:
        client = AnthropicMessagesClient(base_url=server.base_url)
        with trio.move_on_after(0.3) as scope:
            await client.complete(REQUEST)
        assert scope.cancelled_caught
        with trio.fail_after(5):
            await server.wait_early_disconnect()
        await client.aclose()
    assert server.early_disconnects == 1


@pytest.mark.parametrize("status", [301, 307, 308])
async def test_a_redirect_is_not_followed_and_names_where_it_points(status):
    where = "https://models.example.com/v1/next"
    err = await fail(CannedResponse(status=status, headers={"location": where}))
    assert (err.info.kind, err.info.retryable, err.info.status) == (
        "invalid_response",
        False,
        status,
    )
    assert f"HTTP {status}" in err.info.message and where in err.info.message
    assert "base_url" in err.info.message
