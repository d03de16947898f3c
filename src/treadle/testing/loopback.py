"""A small HTTP/1.1 server on 127.0.0.1 that serves canned or scripted responses to tests.

It exists so that model clients are tested through a real socket and a real HTTP stack:
bodies go out as separate chunked writes (so the client sees separate reads), a connection
can be cut mid-body, and the server records what it received and whether the client went
away early (for example because the client's call was cancelled).

Example::

    async with open_loopback_server(canned(CannedResponse(chunks=[b"data: ..."]))) as server:
        client = OpenAIChatClient(base_url=server.base_url)
        ...
        assert server.requests[0].json()["stream"] is True
"""

from __future__ import annotations

import inspect
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import h11
import trio

from treadle._exceptions import TreadleError, one_error

MAX_REQUEST_BYTES = 8 * 1024 * 1024


@attrs.frozen(kw_only=True)
class RecordedRequest:
    """One request as the server received it.

    Attributes:
        method: e.g. ``POST``.
        path: the request target, e.g. ``/v1/chat/completions``.
        headers: ``(name, value)`` pairs in arrival order, names lower-cased.
        body: the raw body.
    """

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or ``None``."""
        wanted = name.lower()
        return next((value for key, value in self.headers if key == wanted), None)

    def json(self) -> Any:
        """The body decoded as JSON. Raises `ValueError` when it is not JSON."""
        return json.loads(self.body)


@attrs.frozen(kw_only=True)
class CannedResponse:
    """A response described as data.

    Attributes:
        status: the HTTP status.
        headers: response headers; ``content-length`` or ``transfer-encoding`` are added.
        chunks: the body, one write per ``bytes`` item; a ``float`` item is an extra pause in
            seconds at that point.
        pause_s: seconds between two writes, so the client sees separate reads.
        delay_s: seconds to wait before sending the status line.
        abort: after the last chunk, ``"close"`` ends the connection without finishing the body
            (no terminating chunk), ``"reset"`` does so with a TCP reset; ``None`` finishes it.
        chunked: chunked transfer encoding (default) or a ``content-length`` body.
    """

    status: int = 200
    headers: Mapping[str, str] = attrs.field(factory=dict)
    chunks: Sequence[bytes | float] = ()
    pause_s: float = 0.01
    delay_s: float = 0.0
    abort: Literal["close", "reset"] | None = None
    chunked: bool = True


class ClientGone(TreadleError):
    """The client closed the connection before the response was complete."""


@attrs.define(eq=False)
class ResponseWriter:
    """Writes one response on a connection; handed to a stream handler.

    Every method raises `ClientGone` when the client has disconnected; a handler may let it
    propagate (the server records the early disconnect).
    """

    _stream: trio.SocketStream
    _conn: h11.Connection
    started: bool = False
    finished: bool = False

    async def start(self, status: int, headers: Mapping[str, str] | None = None) -> None:
        """Send the status line and headers (chunked body unless ``content-length`` given)."""
        pairs = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await self._send(h11.Response(status_code=status, headers=pairs))
        self.started = True

    async def write(self, data: bytes) -> None:
        """Send ``data`` as one write (one chunk when chunked)."""
        if data:
            await self._send(h11.Data(data=data))

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds`` while watching for the client closing the connection."""
        with trio.move_on_after(seconds):
            while True:
                try:
                    data = await self._stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise ClientGone from exc
                if not data:
                    raise ClientGone
                self._conn.receive_data(data)

    async def end(self) -> None:
        """Finish the body normally."""
        await self._send(h11.EndOfMessage())
        self.finished = True

    async def abort(self, *, reset: bool = False) -> None:
        """Close the connection without finishing the body (``reset``: send a TCP RST)."""
        if reset:
            linger = struct.pack("ii", 1, 0)
            self._stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        await self._stream.aclose()
        self.finished = True

    async def _send(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        try:
            if data:
                await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone from exc


Handler = Callable[[RecordedRequest], "CannedResponse | Awaitable[CannedResponse]"]
"""Maps a request to a canned response (sync or async)."""
StreamHandler = Callable[[RecordedRequest, ResponseWriter], Awaitable[None]]
"""Writes the response itself through a `ResponseWriter`."""


def canned(*responses: CannedResponse) -> Handler:
    """A handler answering successive requests with ``responses``; the last one repeats."""
    if not responses:
        raise ValueError("canned() needs at least one response")
    queue = list(responses)

    def handler(request: RecordedRequest) -> CannedResponse:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return handler


async def write_canned(response: CannedResponse, writer: ResponseWriter) -> None:
    """Write ``response`` through ``writer`` (the default stream handler's body)."""
    if response.delay_s:
        await writer.pause(response.delay_s)
    headers = dict(response.headers)
    if not response.chunked:
        size = sum(len(c) for c in response.chunks if isinstance(c, bytes))
        headers["content-length"] = str(size)
    await writer.start(response.status, headers)
    for index, chunk in enumerate(response.chunks):
        if isinstance(chunk, bytes):
            if index and response.pause_s:
                await writer.pause(response.pause_s)
            await writer.write(chunk)
        else:
            await writer.pause(chunk)
    if response.abort is not None:
        await writer.abort(reset=response.abort == "reset")
    else:
        await writer.end()


@attrs.define(eq=False)
class LoopbackServer:
    """A running loopback server (see `open_loopback_server`).

    Attributes:
        port: the TCP port on 127.0.0.1.
        requests: every complete request received, in arrival order.
        early_disconnects: responses the client abandoned before they were complete.
        errors: exceptions raised by the handler (answered with status 500).
    """

    port: int
    requests: list[RecordedRequest] = attrs.Factory(list)
    early_disconnects: int = 0
    errors: list[Exception] = attrs.Factory(list)
    _disconnected: trio.Event = attrs.field(init=False, factory=trio.Event)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` (no trailing slash)."""
        return f"http://127.0.0.1:{self.port}"

    async def wait_early_disconnect(self) -> None:
        """Return once a client has abandoned a response (immediately if one already did)."""
        await self._disconnected.wait()

    def _record_disconnect(self) -> None:
        self.early_disconnects += 1
        self._disconnected.set()


@asynccontextmanager
async def open_loopback_server(
    handler: Handler | None = None, *, stream_handler: StreamHandler | None = None
) -> AsyncIterator[LoopbackServer]:
    """Serve HTTP/1.1 on 127.0.0.1 (a free port) for the duration of the block.

    An exception the block raises comes out as it was raised, not inside the exception
    group of the server's nursery.

    Args:
        handler: returns the canned response for each request.
        stream_handler: alternatively, writes each response itself; exactly one of the two.

    Yields:
        The server; ``server.base_url`` is where to send requests.

    Raises:
        ValueError: neither or both handlers were given.
        RuntimeError: on exit, when a handler raised while serving (the first error chained).

    Resource handling:
        Leaving the block cancels every connection still open.
    """
    if (handler is None) == (stream_handler is None):
        raise ValueError("give exactly one of handler and stream_handler")
    respond = stream_handler if stream_handler is not None else _canned_writer(handler)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server = LoopbackServer(port=listeners[0].socket.getsockname()[1])
    async with one_error(), trio.open_nursery() as nursery:
        serve = _connection_handler(server, respond)
        await nursery.start(trio.serve_listeners, serve, listeners)
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()
    if server.errors:
        raise RuntimeError(f"loopback handler failed {len(server.errors)} time(s)") from (
            server.errors[0]
        )


def _canned_writer(handler: Handler | None) -> StreamHandler:
    assert handler is not None

    async def respond(request: RecordedRequest, writer: ResponseWriter) -> None:
        response = handler(request)
        if inspect.isawaitable(response):
            response = await response
        await write_canned(response, writer)

    return respond


def _connection_handler(
    server: LoopbackServer, respond: StreamHandler
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    async def serve(stream: trio.SocketStream) -> None:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            while await _serve_one(server, respond, stream, conn):
                conn.start_next_cycle()
        except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a client that breaks the protocol or resets is not the server's failure
        finally:
            await stream.aclose()

    return serve


async def _serve_one(
    server: LoopbackServer,
    respond: StreamHandler,
    stream: trio.SocketStream,
    conn: h11.Connection,
) -> bool:
    request = await _read_request(stream, conn)
    if request is None:
        return False
    server.requests.append(request)
    writer = ResponseWriter(stream=stream, conn=conn)
    try:
        await _respond(server, respond, request, writer)
    except ClientGone:
        server._record_disconnect()
        return False
    return conn.our_state is h11.DONE and conn.their_state is h11.DONE


async def _respond(
    server: LoopbackServer,
    respond: StreamHandler,
    request: RecordedRequest,
    writer: ResponseWriter,
) -> None:
    try:
        await respond(request, writer)
    except ClientGone:
        raise
    except Exception as exc:
        server.errors.append(exc)
        if not writer.started:
            await writer.start(500, {"content-type": "text/plain"})
            await writer.write(f"loopback handler failed: {exc!r}".encode())
    if not writer.finished:
        await writer.end()


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> RecordedRequest | None:
    head: h11.Request | None = None
    body: list[bytes] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body.append(event.data)
        elif isinstance(event, h11.EndOfMessage) and head is not None:
            return RecordedRequest(
                method=head.method.decode(),
                path=head.target.decode(),
                headers=tuple((k.decode().lower(), v.decode()) for k, v in head.headers),
                body=b"".join(body),
            )
        else:
            return None  # ConnectionClosed or PAUSED: nothing more to serve
