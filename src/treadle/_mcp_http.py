"""The streamable HTTP transport under `treadle.mcp`'s sessions (private; extra ``treadle[mcp]``).

It is the SDK's (`mcp.client.streamable_http.streamable_http_client`) with two checks of
treadle's, so that only an answer the server sent reads as the server's answer (docs/mcp.md,
"Results"; docs/decisions/0103-mcp-http-failures-end-the-run.md):

* under it, `_CheckedTransport` answers a request whose HTTP request fails, or that gets an HTTP
  answer that is no MCP answer, with a JSON-RPC error, and notes in `_Answers` the id of every
  answer the server sends (a JSON body, an event of an event stream) before the SDK reads it;
* over it, `_ServerErrorsOnly` marks every JSON-RPC error the session is handed for a request
  whose answer the server never sent (`NoServerAnswer`): the SDK makes such errors up under the
  request's id when an event stream ends or breaks before the answer, an event is over the size
  limit, a reconnection fails, or a redirect is not followed, and `_CheckedTransport` makes one
  up for the failures above. `no_server_answer` tells them apart, by what was on the wire, not
  by their words; `never_sent` tells those of a request that never left (no connection);
* the session's closing DELETE waits at most `CLOSE_TIMEOUT_S` for its answer (redirects
  followed included).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Final, Self

import anyio
import attrs
import httpx2
import mcp_types
from mcp import MCPError
from mcp.client._transport import ReadStream, TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

MAX_EVENT_BYTES: Final = 1024 * 1024
"""The most bytes one event of an event stream may hold (the SDK's default limit): a bigger one
breaks the stream there, and the call it answers gets no answer (docs/mcp.md, "Results")."""
CLOSE_TIMEOUT_S: Final = 5.0
"""Seconds the server may take to answer the session's closing DELETE (its whole answer, and
those of the redirects it answers with):
leaving an `open_mcp_tools` block waits no longer for a server that does not answer it
(docs/mcp.md, "The session")."""
_REQUEST_FAILED: Final = "the HTTP request failed: "
_FRAMING: Final = frozenset({"content-encoding", "content-length", "transfer-encoding"})
_UNSENT: Final = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
"""The failures of a request that never left the client: no connection was had for it."""


@attrs.frozen
class NoServerAnswer:
    """The ``data`` of a JSON-RPC error the server never sent, as `_ServerErrorsOnly` marks it.

    Attributes:
        code: the code of the error as it was made up (by the SDK or `_CheckedTransport`).
        message: its message.
        sent: whether the request left the client (``False``: it provably never reached the
            server: no connection to the server could be made, or none was free in time).
    """

    code: int
    message: str
    sent: bool = True


def no_server_answer(error: MCPError) -> bool:
    """Whether ``error`` ended a request whose answer the server never sent over HTTP."""
    return isinstance(error.data, NoServerAnswer)


def never_sent(error: MCPError) -> bool:
    """Whether ``error`` ended a request that never left the client (no connection was had)."""
    return isinstance(error.data, NoServerAnswer) and not error.data.sent


class _Answers:
    """The ids of the requests the server answered whose answer the session has not read yet.

    Ids are kept as the SDK matches them (`coerce_request_id`: "4" is 4): it hands the session
    an answer on a resumed stream under the id of the request it resumed, whatever the id
    the server wrote.

    Noted by `_CheckedTransport` as an answer arrives, taken by `_ServerErrorsOnly` as the
    session reads it (the SDK reads each answer after it was noted).
    """

    def __init__(self) -> None:
        self._ids: Counter[mcp_types.RequestId] = Counter()
        self._unsent: set[mcp_types.RequestId] = set()

    def note(self, request_id: mcp_types.RequestId | None) -> None:
        """Note an answer to ``request_id`` (one without an id answers no request)."""
        if request_id is not None:
            self._ids[coerce_request_id(request_id)] += 1

    def take(self, request_id: mcp_types.RequestId | None) -> bool:
        """Whether the server answered ``request_id`` (each answer is taken once)."""
        if request_id is None:
            return False
        key = coerce_request_id(request_id)
        if not self._ids[key]:  # (a Counter's lookup adds no key)
            return False
        self._ids[key] -= 1
        if not self._ids[key]:
            del self._ids[key]
        return True

    def note_unsent(self, request_id: mcp_types.RequestId | None) -> None:
        """Note that the request ``request_id`` never left the client."""
        if request_id is not None:
            self._unsent.add(coerce_request_id(request_id))

    def take_unsent(self, request_id: mcp_types.RequestId | None) -> bool:
        """Whether the request ``request_id`` never left the client (taken once)."""
        key = None if request_id is None else coerce_request_id(request_id)
        if key not in self._unsent:
            return False
        self._unsent.discard(key)
        return True


@asynccontextmanager
async def open_http(url: str) -> AsyncIterator[TransportStreams]:
    """The SDK's streamable HTTP transport to ``url``, with treadle's checks.

    `_CheckedTransport` is under it and `_ServerErrorsOnly` over its read stream; the HTTP
    client is closed on leaving.
    The SDK's own limit of an event's size is lifted: `_CheckedTransport` reads every event
    stream first, at most `MAX_EVENT_BYTES` an event.
    """
    answers = _Answers()
    # no bound on the connections: each call in flight holds one (HTTP/1.1), and a call that
    # waited for a free one would fail unsent (docs/mcp.md, "Results")
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=20)
    http = httpx2.AsyncClient(
        # the SDK's defaults; a tool call's answer has no read timeout (`_unbounded_read`)
        timeout=httpx2.Timeout(30.0, read=300.0),
        transport=_CheckedTransport(httpx2.AsyncHTTPTransport(limits=limits), answers),
    )
    async with (
        http,
        streamable_http_client(url, http_client=http, max_sse_event_size=None) as (read, write),
    ):
        yield _ServerErrorsOnly(read, answers), write


class _CheckedTransport(httpx2.AsyncBaseTransport):
    """An HTTP transport that answers a failed request with a JSON-RPC error and notes answers.

    A POST of a request fails when its connection fails (before the response headers: a
    server that died while it held the call; or while a JSON body is read: one that died in
    its answer), and when it gets an HTTP answer that is no JSON-RPC answer (`_no_mcp_answer`).
    The SDK lets a connection error escape its own task group, which would cancel the caller's
    whole block, and turns a non-JSON-RPC answer into a JSON-RPC error of its own making: here
    the request gets a JSON-RPC error saying what failed, which no answer of the server's
    noted, so `_ServerErrorsOnly` marks it (the call's ENV_ERROR; docs/mcp.md, "Results";
    docs/decisions/0103-mcp-http-failures-end-the-run.md). A POST's JSON answer is read whole
    here for that. An event stream (a POST's or a GET's) is read here event by event
    (`_NotedEvents`). Other requests keep their errors, which the SDK handles itself; the
    session's closing DELETE is bounded (`CLOSE_TIMEOUT_S`).
    """

    def __init__(self, inner: httpx2.AsyncBaseTransport, answers: _Answers) -> None:
        self._inner = inner
        self._answers = answers
        self._close_deadline: float | None = None  # of the closing DELETE and its redirects

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.method == "POST":
            return await self._post(request)
        if request.method == "DELETE":
            return await self._closing(request)
        return self._noted(await self._inner.handle_async_request(request), request, None)

    async def _closing(self, request: httpx2.Request) -> httpx2.Response:
        """The answer to the session's closing DELETE, read whole within the close's bound.

        The bound is `CLOSE_TIMEOUT_S` from the first DELETE. The SDK sends it as the
        session ends and waits for it unbounded but by the client's read timeout (300 s: an
        event stream may be quiet that long), and follows its redirects on the same origin
        (20 of them, each a DELETE here): the bound is the whole close's.

        Raises:
            httpx2.TimeoutException: no whole answer came in time (the SDK logs it).
            httpx2.TransportError: the request failed.
        """
        if self._close_deadline is None:
            self._close_deadline = anyio.current_time() + CLOSE_TIMEOUT_S
        with anyio.CancelScope(deadline=self._close_deadline):
            response = await self._inner.handle_async_request(request)
            return _buffered(response, await _read_whole(response), request)
        raise httpx2.ReadTimeout(
            f"the server did not answer the session's closing DELETE within {CLOSE_TIMEOUT_S:g} s",
            request=request,
        )

    async def _post(self, request: httpx2.Request) -> httpx2.Response:
        request_id = _request_id(request)
        if _request_method(request) == "tools/call":
            _unbounded_read(request)
        try:
            response = await self._inner.handle_async_request(request)
            response.request = request
            body = await _read_whole(response) if _is_json(response) else None
        except _UNSENT as exc:  # no connection: the request never left
            self._answers.note_unsent(request_id)
            return _failed_request(request, f"{type(exc).__name__}: {exc}")
        except (httpx2.TransportError, httpx2.DecodingError) as exc:
            return _failed_request(request, f"{type(exc).__name__}: {exc}")
        message = None if body is None else _jsonrpc(body)
        if request_id is not None:
            why = _no_mcp_answer(response, body is not None, message)
            if why is not None:
                await response.aclose()
                return _failed_request(request, why)
        if body is None:
            return self._noted(response, request, request_id)
        if request_id is not None and isinstance(
            message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError
        ):
            # the SDK gives an error at an HTTP error status the request's id
            self._answers.note(request_id if response.status_code >= 400 else message.id)
        return _buffered(response, body, request)

    def _noted(
        self,
        response: httpx2.Response,
        request: httpx2.Request,
        request_id: mcp_types.RequestId | None,
    ) -> httpx2.Response:
        """``response``, whose events, if it is an event stream, are noted as they are read."""
        kind = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "text/event-stream" or response.status_code >= 300:
            return response
        response.request = request
        headers = [
            (k, v)
            for k, v in response.headers.multi_items()
            if k.lower() not in _FRAMING and k.lower() != "content-type"
        ]
        headers.append(("content-type", "text/event-stream; charset=utf-8"))
        return httpx2.Response(
            response.status_code,
            headers=headers,
            stream=_NotedEvents(response, self._answers, request_id),
            request=request,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _NotedEvents(httpx2.AsyncByteStream):
    """An event stream's body, passed on one event at a time once the answer in it is noted.

    The events are read here (httpx2's `EventSource`, at most `MAX_EVENT_BYTES` each) and
    passed on each once it is whole, written anew as UTF-8 text: the SDK reads exactly the
    events read here, and each only after its answer was noted in `_Answers` (under
    ``request_id``, the id the SDK gives an answer on a POST's stream; on a GET's, the
    answer's own). An error of the stream (the connection broke, an event over the limit)
    reaches the SDK as it is, which then ends the request with an error of its own making.
    """

    def __init__(
        self,
        response: httpx2.Response,
        answers: _Answers,
        request_id: mcp_types.RequestId | None,
    ) -> None:
        self._response = response
        self._answers = answers
        self._request_id = request_id
        self._events = httpx2.EventSource(response, max_event_size=MAX_EVENT_BYTES).__aiter__()

    def __aiter__(self) -> _NotedEvents:
        return self

    async def __anext__(self) -> bytes:
        event = await self._events.__anext__()
        self._note(event)
        return _encoded(event)

    def _note(self, event: httpx2.ServerSentEvent) -> None:
        """Note the answer ``event`` holds, read as the SDK reads it."""
        if event.event != "message" or not event.data:
            return
        message = _jsonrpc(event.data.encode())
        if isinstance(message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError):
            self._answers.note(self._request_id if self._request_id is not None else message.id)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined]  # an async generator
        finally:
            await self._response.aclose()


def _encoded(event: httpx2.ServerSentEvent) -> bytes:
    """``event`` as the text of one event (that an SSE parser reads back as ``event``)."""
    lines = [f"event: {event.event}", f"id: {event.id}"]
    if event.retry is not None:
        lines.append(f"retry: {event.retry}")
    if event.data:
        lines.extend(f"data: {line}" for line in event.data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


class ReadStreamFilter:
    """A session's read stream seen through a filter (the SDK's ``ReadStream`` protocol).

    A subclass gives `receive`; closing, iterating and the ``async with`` block act on the
    stream it wraps.
    """

    def __init__(self, inner: ReadStream[SessionMessage | Exception]) -> None:
        self._inner = inner

    async def receive(self) -> SessionMessage | Exception:
        """The next message or parse error, or `anyio.EndOfStream`."""
        return await self._inner.receive()

    async def aclose(self) -> None:
        """Close the wrapped stream."""
        await self._inner.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class _ServerErrorsOnly(ReadStreamFilter):
    """The session's read stream, on which a JSON-RPC error the server never sent is marked.

    An error for a request whose answer `_Answers` has not noted (the SDK's or
    `_CheckedTransport`'s) reaches the session as a "connection closed" error
    (``CONNECTION_CLOSED``) saying "the HTTP request failed: " and what it said, with a
    `NoServerAnswer` as its data (`no_server_answer`). Everything else passes as it is.
    """

    def __init__(self, inner: ReadStream[SessionMessage | Exception], answers: _Answers) -> None:
        super().__init__(inner)
        self._answers = answers

    @property
    def last_context(self) -> Any:
        """The context of the last message's sender, or ``None`` (the SDK runs requests in it)."""
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        item = await self._inner.receive()
        if not isinstance(item, SessionMessage):
            return item
        message = item.message
        if not isinstance(message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError):
            return item
        if self._answers.take(message.id) or isinstance(message, mcp_types.JSONRPCResponse):
            return item
        sent = not self._answers.take_unsent(message.id)
        return SessionMessage(message=_unanswered(message, sent), metadata=item.metadata)


def _unanswered(message: mcp_types.JSONRPCError, sent: bool) -> mcp_types.JSONRPCError:
    made_up = message.error
    error = mcp_types.ErrorData(
        code=mcp_types.CONNECTION_CLOSED,
        message=_REQUEST_FAILED + made_up.message,
        data=NoServerAnswer(code=made_up.code, message=made_up.message, sent=sent),
    )
    return mcp_types.JSONRPCError(jsonrpc="2.0", id=message.id, error=error)


def _no_mcp_answer(
    response: httpx2.Response, json_body: bool, message: mcp_types.JSONRPCMessage | None
) -> str | None:
    """Why ``response`` is no answer to a JSON-RPC request, or ``None``.

    An answer is a JSON-RPC answer (a result or an error; an error at a status of 400 or more)
    or an event stream: a JSON body holding a notification or a request answers nothing (the
    SDK would wait for the answer until the call's timeout; docs/mcp.md, "Results"). A redirect
    is none: following it would send the request again (the SDK follows one on the same
    origin, a loop up to 20 times), and a call reaches the server at most once.
    ``json_body``: the body is JSON, read whole; ``message``: the JSON-RPC message it holds.
    """
    status = response.status_code
    kind = response.headers.get("content-type", "") or "no content type"
    what = f"HTTP {status} {response.reason_phrase} ({kind.split(';')[0]})"
    if 300 <= status < 400:
        return f"{what}, {_redirect(response)}, not followed (a call is sent once)"
    if status == 202:
        return f"{what}, no answer to the request"
    if not json_body:
        streamed = kind.lower().startswith("text/event-stream") and status < 400
        return None if streamed else f"{what}, no MCP answer"
    if status >= 400 and not isinstance(message, mcp_types.JSONRPCError):
        return f"{what}, no JSON-RPC error"
    if message is None:
        return f"{what}, no JSON-RPC message"
    if not isinstance(message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError):
        return f"{what}, a JSON-RPC {_kind(message)}, no answer to the request"
    return None


def _kind(message: mcp_types.JSONRPCMessage) -> str:
    """``"request"`` or ``"notification"``: what a JSON-RPC message that is no answer is."""
    return "request" if isinstance(message, mcp_types.JSONRPCRequest) else "notification"


def _redirect(response: httpx2.Response) -> str:
    """Where ``response`` redirects to, as "a redirect to <URL>" (`shown_url`)."""
    location = response.headers.get("location")
    if not location:
        return "a redirect without a Location"
    try:
        url = response.request.url.join(location)
    except httpx2.InvalidURL:
        return "a redirect to an invalid Location"
    return f"a redirect to {shown_url(url)}"


def shown_url(url: str | httpx2.URL) -> str:
    """``url`` as errors show it: without userinfo, query or fragment, which can hold secrets.

    Returns:
        The URL's scheme, host, port and path; ``"an invalid URL"`` when it cannot be parsed.
    """
    try:
        parsed = httpx2.URL(url)
        return str(parsed.copy_with(userinfo=b"", query=None, fragment=None))
    except httpx2.InvalidURL:
        return "an invalid URL"


def _request_id(request: httpx2.Request) -> mcp_types.RequestId | None:
    """The id of the JSON-RPC request ``request`` sends; ``None`` for any other message."""
    sent = _sent(request)
    if sent is None or "method" not in sent:
        return None
    found = sent.get("id")
    return found if isinstance(found, int | str) and not isinstance(found, bool) else None


def _request_method(request: httpx2.Request) -> str | None:
    """The method of the JSON-RPC message ``request`` sends, or ``None``."""
    sent = _sent(request)
    method = None if sent is None else sent.get("method")
    return method if isinstance(method, str) else None


def _sent(request: httpx2.Request) -> dict[str, Any] | None:
    """The JSON object ``request`` sends, or ``None``."""
    try:
        sent = json.loads(request.content)
    except (httpx2.RequestNotRead, ValueError):
        return None
    return sent if isinstance(sent, dict) else None


def _unbounded_read(request: httpx2.Request) -> None:
    """Lift the HTTP client's read timeout from ``request``, a tool call.

    The call's own ``timeout_s`` bounds it (docs/mcp.md, "Results"): a tool may run longer
    than the client's read timeout without a byte sent, as a JSON answer comes only at its end.
    """
    timeout = dict(request.extensions.get("timeout", {}))
    timeout["read"] = None
    request.extensions["timeout"] = timeout


def _jsonrpc(body: bytes) -> mcp_types.JSONRPCMessage | None:
    """The JSON-RPC message ``body`` holds, or ``None``."""
    try:
        return mcp_types.jsonrpc_message_adapter.validate_json(body, by_name=False)
    except ValidationError:
        return None


def _is_json(response: httpx2.Response) -> bool:
    return response.headers.get("content-type", "").lower().startswith("application/json")


async def _read_whole(response: httpx2.Response) -> bytes:
    """The decoded body of ``response``, which is closed after.

    Raises:
        httpx2.TransportError: the connection failed while the body was read.
        httpx2.DecodingError: the body is no valid data of its content encoding.
    """
    try:
        return await response.aread()
    finally:
        await response.aclose()


def _buffered(response: httpx2.Response, body: bytes, request: httpx2.Request) -> httpx2.Response:
    """``response`` to ``request`` again, with ``body`` (decoded already) as its content."""
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _FRAMING]
    return httpx2.Response(
        response.status_code,
        headers=headers,
        content=body,
        request=request,
        extensions=response.extensions,
    )


def _failed_request(request: httpx2.Request, why: str) -> httpx2.Response:
    """A JSON-RPC error as the answer to ``request``, saying ``why`` (which no server sent)."""
    error = {"code": mcp_types.CONNECTION_CLOSED, "message": why}
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
    return httpx2.Response(
        503, headers={"content-type": "application/json"}, content=body, request=request
    )
