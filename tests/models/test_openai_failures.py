"""OpenAIChatClient: error classification, deadlines and cancellation."""

from __future__ import annotations

import email.utils
import json
import time

import httpx
import pytest
import trio
from test_openai_client import HELLO, KEY, REQUEST, SSE, call, chunk, fail, sse

from treadle._exceptions import ModelCallError
from treadle.models import OpenAIChatClient, parse_retry_after
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server

# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "body", "kind", "retryable"),
    [
        (401, {"error": {"message": f"Incorrect API key provided: {KEY}"}}, "auth", False),
        (403, {"error": {"message": "forbidden"}}, "auth", False),
        (404, {"error": {"message": "no such model"}}, "not_found", False),
        (400, None, "bad_request", False),
        (422, {"detail": "bad field"}, "bad_request", False),
        (
            400,
            {"error": {"message": "This model's maximum context length is 8192 tokens.",
                       "type": "BadRequestError", "code": 400}},
            "context_length_exceeded",
            False,
        ),
        (500, {"error": {"message": "boom"}}, "server_error", True),
        (502, "<html>bad gateway</html>", "server_error", True),
        (503, None, "server_error", True),
        (408, None, "timeout", True),
        (429, {"error": {"message": "slow down"}}, "rate_limited", True),
    ],
)  # fmt: skip
async def test_http_errors_are_classified(status, body, kind, retryable):
    raw = b"" if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
    response = CannedResponse(
        status=status, headers={"content-type": "application/json"}, chunks=[raw]
    )
    err = await fail(response)
    assert (err.info.kind, err.info.retryable, err.info.status) == (kind, retryable, status)
    assert err.info.retry_after_s is None


async def test_retry_after_http_date_and_milliseconds():
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    err = await fail(CannedResponse(status=429, headers={"retry-after": future}))
    assert 25 <= err.info.retry_after_s <= 31
    err = await fail(
        CannedResponse(status=503, headers={"retry-after-ms": "1500", "retry-after": "9"})
    )
    assert err.info.retry_after_s == 1.5


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": " 2.5 "}, 2.5),
        ({"retry-after": "-3"}, 0.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, 10.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after-ms": "250"}, 0.25),
        ({}, None),
    ],
)
def test_parse_retry_after(headers, expected):
    now = email.utils.parsedate_to_datetime("Wed, 21 Oct 2015 07:28:00 GMT").timestamp()
    assert parse_retry_after(httpx.Headers(headers), now_s=now) == expected


@pytest.mark.parametrize(
    ("error", "kind", "retryable"),
    [
        ({"message": "x", "code": 502}, "server_error", True),
        ({"message": "x", "code": "rate_limit_exceeded"}, "rate_limited", True),
        ({"message": "x", "code": "context_length_exceeded"}, "context_length_exceeded", False),
        ({"message": "x", "type": "overloaded_error"}, "server_error", True),
        ({"message": "something odd"}, "upstream_error", True),
        ("plain text error", "upstream_error", True),
    ],
)
async def test_in_band_errors_are_classified(error, kind, retryable):
    chunks = [sse(chunk({"content": "part"})), sse({"error": error}), sse("[DONE]")]
    err = await fail(CannedResponse(headers=SSE, chunks=chunks))
    assert (err.info.kind, err.info.retryable, err.partial_text) == (kind, retryable, "part")


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"event: error\ndata: upstream timed out\n\n", "upstream_error"),
        (
            b'event: error\ndata: {"message": "busy", "type": "overloaded_error"}\n\n',
            "server_error",
        ),
        (b'event: error\ndata: {"error": {"message": "x", "code": 429}}\n\n', "rate_limited"),
    ],
)
async def test_named_error_events_are_in_band_errors(raw, kind):
    err = await fail(CannedResponse(headers=SSE, chunks=[raw, *HELLO]))
    assert (err.info.kind, err.info.retryable) == (kind, True)


@pytest.mark.parametrize(
    "chunks",
    [
        [b"data: {not json\n\n"],
        [b"data: [1, 2]\n\n"],
        [b'data: {"choices": []}\n\n', b"data: \xff\xfe\n\n"],
    ],
)
async def test_malformed_streams_are_invalid_response(chunks):
    err = await fail(CannedResponse(headers=SSE, chunks=chunks))
    assert (err.info.kind, err.info.retryable) == ("invalid_response", False)


async def test_unexpected_content_type_is_invalid_response():
    err = await fail(CannedResponse(headers={"content-type": "text/html"}, chunks=[b"<html>"]))
    assert err.info.kind == "invalid_response"


async def test_usage_reported_before_a_failure_is_kept():
    chunks = [sse(chunk({"content": "a"}, usage={"prompt_tokens": 4, "completion_tokens": 1}))]
    err = await fail(CannedResponse(headers=SSE, chunks=chunks, abort="close"))
    assert err.info.kind == "incomplete_stream"
    assert (err.usage.input_tokens, err.usage.output_tokens, err.usage.total_tokens) == (4, 1, None)


async def test_connection_refused_is_a_retryable_connection_error():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    client = OpenAIChatClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
    with pytest.raises(ModelCallError) as info:
        await client.complete(REQUEST)
    await client.aclose()
    assert (info.value.info.kind, info.value.info.retryable) == ("connection", True)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def _raising(exc_type):
    def handler(request):
        raise exc_type(f"failed for {request.url}")

    return handler


@pytest.mark.parametrize(
    ("exc_type", "kind"),
    [
        (httpx.ConnectTimeout, "timeout"),
        (httpx.PoolTimeout, "timeout"),
        (httpx.ConnectError, "connection"),
        (httpx.RemoteProtocolError, "connection"),
        (httpx.ProxyError, "connection"),
    ],
)
async def test_transport_exceptions_are_translated(exc_type, kind):
    http = httpx.AsyncClient(transport=httpx.MockTransport(_raising(exc_type)))
    client = OpenAIChatClient(base_url=f"https://h/{KEY}", api_key=KEY, http_client=http)
    with pytest.raises(ModelCallError) as info:
        await client.complete(REQUEST)
    assert (info.value.info.kind, info.value.info.retryable) == (kind, True)
    assert isinstance(info.value.__cause__, exc_type)
    assert KEY not in str(info.value)
    await client.aclose()
    assert not http.is_closed  # a given client stays open
    await http.aclose()


class _BrokenBody(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield sse(chunk({"content": "so far"}))
        raise httpx.ReadError("connection reset")


async def test_read_error_mid_body_is_incomplete_stream():
    transport = httpx.MockTransport(
        lambda r: httpx.Response(200, headers=SSE, stream=_BrokenBody())
    )
    async with httpx.AsyncClient(transport=transport) as http:
        client = OpenAIChatClient(base_url="https://h", http_client=http)
        with pytest.raises(ModelCallError) as info:
            await client.complete(REQUEST)
    assert (info.value.info.kind, info.value.partial_text) == ("incomplete_stream", "so far")
    assert isinstance(info.value.__cause__, httpx.ReadError)


# --------------------------------------------------------------------------- deadlines


async def test_first_byte_deadline_covers_slow_headers():
    start = trio.current_time()
    err = await fail(CannedResponse(headers=SSE, chunks=HELLO, delay_s=5), first_byte_timeout_s=0.2)
    assert (err.info.kind, err.info.retryable) == ("timeout", True)
    assert trio.current_time() - start < 3


async def test_idle_deadline_after_the_first_event():
    chunks = [sse(chunk({"content": "a"})), 5.0, *HELLO]
    err = await fail(CannedResponse(headers=SSE, chunks=chunks), idle_timeout_s=0.2)
    assert (err.info.kind, err.info.retryable, err.partial_text) == ("timeout", True, "a")
    assert "idle" in err.info.message


async def test_comments_reset_the_idle_timer():
    pings = [b": ping\n\n"] * 10  # one every 0.05 s: 0.5 s in all, idle limit 0.3 s
    chunks = [sse(chunk({"content": "a"})), *pings, *HELLO]
    reply, _ = await call(
        CannedResponse(headers=SSE, chunks=chunks, pause_s=0.05), idle_timeout_s=0.3
    )
    assert reply.text == "aHello"


async def test_cancelling_the_call_closes_the_connection():
    chunks = [sse(chunk({"content": "a"})), 30.0, *HELLO]
    async with open_loopback_server(canned(CannedResponse(headers=SSE, chunks=chunks))) as server:
        client = OpenAIChatClient(base_url=server.base_url)
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
