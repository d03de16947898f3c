"""The loopback HTTP server used by client tests."""

from __future__ import annotations

import httpx
import pytest
import trio

from treadle.testing.loopback import (
    CannedResponse,
    RecordedRequest,
    ResponseWriter,
    canned,
    open_loopback_server,
)


async def test_records_requests_and_serves_chunks_as_separate_reads():
    response = CannedResponse(headers={"x-a": "1"}, chunks=[b"ab", b"cd", b"ef"])
    async with (
        open_loopback_server(canned(response)) as server,
        httpx.AsyncClient() as http,
        http.stream("POST", server.base_url + "/p?q=1", json={"k": 2}) as reply,
    ):
        reads = [chunk async for chunk in reply.aiter_raw()]
    assert reads == [b"ab", b"cd", b"ef"]
    assert reply.headers["x-a"] == "1"
    assert reply.headers["transfer-encoding"] == "chunked"
    (request,) = server.requests
    assert (request.method, request.path, request.json()) == ("POST", "/p?q=1", {"k": 2})
    assert request.header("Content-Type") == "application/json"
    assert server.early_disconnects == 0


async def test_content_length_body_and_async_handler_and_keep_alive():
    async def handler(request: RecordedRequest) -> CannedResponse:
        await trio.lowlevel.checkpoint()
        return CannedResponse(status=201, chunks=[request.body, b"!"], chunked=False)

    async with open_loopback_server(handler) as server, httpx.AsyncClient() as http:
        first = await http.post(server.base_url, content=b"hi")
        second = await http.post(server.base_url, content=b"yo")
    assert (first.status_code, first.content, first.headers["content-length"]) == (201, b"hi!", "3")
    assert second.content == b"yo!"
    assert len(server.requests) == 2


async def test_successive_canned_responses_then_the_last_repeats():
    handler = canned(CannedResponse(status=500), CannedResponse(status=200))
    async with open_loopback_server(handler) as server, httpx.AsyncClient() as http:
        statuses = [(await http.get(server.base_url)).status_code for _ in range(3)]
    assert statuses == [500, 200, 200]


@pytest.mark.parametrize("abort", ["close", "reset"])
async def test_abort_cuts_the_body(abort):
    response = CannedResponse(chunks=[b"partial"], abort=abort)
    async with open_loopback_server(canned(response)) as server, httpx.AsyncClient() as http:
        with pytest.raises(httpx.TransportError):
            await http.get(server.base_url)


async def test_stream_handler_and_early_disconnect():
    async def write(request: RecordedRequest, writer: ResponseWriter) -> None:
        await writer.start(200, {"content-type": "text/plain"})
        await writer.write(b"first")
        await writer.pause(30)
        await writer.write(b"never")

    async with open_loopback_server(stream_handler=write) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while b"first" not in received:
            received += await stream.receive_some()
        await stream.aclose()
        with trio.fail_after(5):
            await server.wait_early_disconnect()
    assert server.early_disconnects == 1


async def test_handler_errors_answer_500_and_fail_the_block():
    def broken(request: RecordedRequest) -> CannedResponse:
        raise KeyError("bug in test handler")

    with pytest.raises(RuntimeError, match="handler failed") as info:
        async with open_loopback_server(broken) as server, httpx.AsyncClient() as http:
            reply = await http.get(server.base_url)
            assert reply.status_code == 500
    assert isinstance(info.value.__cause__, KeyError)


async def test_exactly_one_handler_is_required():
    with pytest.raises(ValueError, match="exactly one"):
        async with open_loopback_server():
            pass


async def test_an_error_of_the_block_comes_out_as_raised():
    """It came out inside the exception group of the server's nursery: a test's failed
    assertion in the block could not be caught as itself (``pytest.raises`` missed it)."""
    with pytest.raises(AssertionError, match="the block's own"):
        async with open_loopback_server(canned(CannedResponse(chunks=[b"x"]))):
            raise AssertionError("the block's own")
