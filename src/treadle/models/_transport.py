"""What the OpenAI and Anthropic clients share.

Sending one streaming request and reading its response (status, JSON body or server-sent
events) under the attempt's deadlines, reporting usage to the attempt's observer: both come
from the `treadle.types.Attempt` the model gateway passes to ``complete``.

`StreamReader` holds the reading loop; each client supplies its accumulator and three hooks
(a JSON body, the end of a stream without its final event, and an HTTP error status).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import re
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

import httpx
import trio

from treadle._credentials import check_base_url, credentials_sent, shown_url
from treadle._credentials import redact_url_secrets as redact_url_secrets
from treadle._exceptions import ModelCallError, UsageError
from treadle._text import valid_text
from treadle.models._accumulate import loads_event
from treadle.models._sse import MAX_EVENT_BYTES, SSEDecodeError, SSEDecoder, SSEEvent
from treadle.types import Attempt, ImageRef, ImageSource, ModelReply, Usage

CLOSE_GRACE_S = 1.0
"""Seconds a shielded close of the HTTP response may take after a failure or cancellation."""
DRAIN_S = 0.25
"""Seconds to wait for the end of the body after the stream's last event (keeps the
connection reusable; a server that holds the body open past this loses the connection)."""
MAX_ERROR_BODY_BYTES = 64 * 1024
"""Bytes of an error response's body read to classify it (the rest is not read)."""
MAX_JSON_BODY_BYTES = MAX_EVENT_BYTES
"""The longest non-streamed JSON body, in bytes: the bound of a stream's line or event
(docs/models.md, "Replies, finish reasons, reasoning")."""
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))


class Accumulator(Protocol):
    """What `StreamReader` needs of a client's stream accumulator."""

    @property
    def done(self) -> bool:
        """The stream's final event was seen."""
        ...

    @property
    def events(self) -> int:
        """Events of the reply seen so far; the first one ends the first-byte deadline.

        A keep-alive (an SSE comment, an Anthropic ``ping``) is not counted (docs/models.md,
        "Deadlines inside every attempt").
        """
        ...

    @property
    def usage(self) -> Usage:
        """Usage reported so far (replaced, never mutated, on each report)."""
        ...

    def add(self, data: str, *, event: str = "message") -> None:
        """Fold one event's data."""
        ...

    def failure(
        self, kind: str, message: str, *, retryable: bool = False, status: int | None = None
    ) -> ModelCallError:
        """A classified error carrying the usage and text seen so far (and ``status``)."""
        ...

    def reply(self) -> ModelReply:
        """The assembled reply."""
        ...


A = TypeVar("A", bound=Accumulator)


class StreamReader(Generic[A]):
    """The response-reading half of a streaming model client.

    Subclasses set ``_client`` (the `httpx.AsyncClient`, ``_owns_client`` when they made it)
    and implement `_add_body`, `_end_of_stream` and `_status_error`. ``async with client:``
    closes what the client opened, as `aclose` does.
    """

    first_event: ClassVar[str] = "first event"
    """How a timeout before any event names what it waited for."""

    _client: httpx.AsyncClient
    _owns_client: bool
    _url: str
    _api_key: str | None
    _credentials: tuple[str, ...]
    """Every credential the client sends (`treadle._credentials.credentials_sent`), longest
    first."""
    _connect_s: float
    _first_byte_s: float
    _idle_s: float
    _image_source: ImageSource | None
    _headers: dict[str, str]

    def _open(
        self,
        *,
        url: tuple[str, str],
        api_key: str | None,
        http_client: httpx.AsyncClient | None,
        timeouts_s: tuple[float, float, float],
        image_source: ImageSource | None,
        headers: Mapping[str, str],
    ) -> None:
        """Check and keep what a client's constructor was given, in the one way both have.

        Args:
            url: ``(base_url, path)``; requests go to their join (`join_url`).
            api_key: the key `_auth_headers` sends, checked (`check_api_key`).
            http_client: the caller's client, kept open by `aclose`; ``None`` makes one
                (`own_http_client`) that `aclose` closes.
            timeouts_s: ``(connect, first byte, idle)`` seconds.
            image_source: resolves ``ref:`` images.
            headers: every request's headers, the caller's extra ones last (`check_headers`).

        Raises:
            UsageError: the base URL, a timeout, the key or a header is refused, or the base
                URL's user information would replace an ``Authorization`` header (docs/models.md,
                "Connections and headers").
        """
        base_url, path = url
        check_base_url(base_url)
        if not all(t > 0 for t in timeouts_s):
            raise UsageError(f"timeouts must be positive seconds, got {timeouts_s}")
        self._url = join_url(base_url, path)
        install_log_redaction()
        self._api_key = check_api_key(api_key)
        self._connect_s, self._first_byte_s, self._idle_s = timeouts_s
        self._image_source = image_source
        self._headers = check_headers(headers)
        given_headers = http_client.headers if http_client is not None else {}
        check_userinfo(base_url, {**given_headers, **self._auth_headers()})
        self._owns_client = http_client is None
        self._client = http_client if http_client is not None else own_http_client()
        self._credentials = credentials_sent(
            self._api_key, {**self._client.headers, **self._headers}, base_url
        )

    def _auth_headers(self) -> dict[str, str]:
        """`_headers` with the API key in the provider's header, when there is a key."""
        raise NotImplementedError

    async def _attempt(
        self, body: dict[str, Any], headers: dict[str, str], acc: A, attempt: Attempt
    ) -> ModelReply:
        """Send ``body`` to ``self._url`` and read the reply into ``acc``.

        Deadlines are this client's, tightened by ``attempt``'s: connect through httpx, first
        event and stream idle through trio cancel scopes. Each usage the server reports goes
        to ``attempt.report_usage``.

        Raises:
            UsageError: ``body`` cannot be encoded as JSON.
            treadle.ModelCallError: the attempt failed (classified by ``acc`` and the hooks);
                a request that cannot be built or sent as HTTP is a ``bad_request``, not
                retryable (`_build`).

        Cancellation:
            A checkpoint. Cancelling closes the response and its connection.
        """
        connect_s, first_byte_s, idle_s = self._deadlines(attempt)
        http_request = self._build(encode_body(body), headers, connect_s, acc)
        deadline = trio.current_time() + first_byte_s
        response = await self._send(http_request, acc, deadline)
        chunks = response.aiter_bytes()
        try:
            return await self._read_response(response, chunks, acc, deadline, idle_s, attempt)
        finally:
            await dispose(response, chunks)

    def _build(
        self, content: bytes, headers: dict[str, str], connect_s: float, acc: A
    ) -> httpx.Request:
        """The HTTP request of one attempt, its connect timeout ``connect_s`` seconds.

        Only the connect timeout is httpx's: the wait for a connection of the client's pool
        counts in the first-byte deadline instead, and reads are bounded by the trio scopes
        (docs/models.md, "Deadlines inside every attempt").

        Raises:
            treadle.ModelCallError: ``bad_request``, not retryable: the URL or a header cannot
                be put into an HTTP request (the constructors refuse such values; this keeps
                one that got past them from interrupting the run).
        """
        try:
            return self._client.build_request(
                "POST",
                self._url,
                content=content,
                headers=headers,
                timeout=httpx.Timeout(connect_s, read=None, write=None, pool=None),
            )
        except (httpx.InvalidURL, ValueError, TypeError) as exc:
            raise acc.failure("bad_request", self._unsendable(exc)) from exc

    def _unsendable(self, exc: Exception) -> str:
        """The message of a request that cannot be built or sent, credentials hidden."""
        return self._redact(f"the request cannot be sent as HTTP: {exc!r}")

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it (a given client stays open)."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        """The client itself; leaving the block closes it (`aclose`)."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the client (`aclose`)."""
        await self.aclose()

    def _deadlines(self, attempt: Attempt) -> tuple[float, float, float]:
        """``(connect, first byte, idle)`` seconds: this client's, tightened by the attempt's."""
        return (
            min(self._connect_s, attempt.connect_s),
            min(self._first_byte_s, attempt.first_byte_s),
            min(self._idle_s, attempt.idle_s),
        )

    def _redact(self, text: str) -> str:
        """``text`` with every credential the client sends replaced by ``***``.

        That is each of `_credentials` (the API key, credential headers, the user
        information of the base URL: `treadle._credentials.credentials_sent`), also as a
        ``repr`` writes it (an error quoting a header's bytes escapes them), and its start
        where a message was cut short inside it (a server's message is kept to 500
        characters); then URL credentials (`treadle._credentials.redact_url_secrets`;
        docs/models.md, "Credentials").
        """
        for secret in self._credentials:
            for form in (secret, repr(secret)[1:-1], repr(secret.encode("utf-8", "replace"))[2:-1]):
                text = text.replace(form, "***")
            text = _without_key_starts(text, secret)
        return redact_url_secrets(text)

    def _add_body(self, acc: A, body: bytes) -> ModelReply:
        """Assemble a non-streamed JSON body (a server that ignored ``stream: true``)."""
        raise NotImplementedError

    def _end_of_stream(self, acc: A, *, truncated: bool) -> ModelReply:
        """The reply when the body ended before the stream's final event, or the error."""
        raise NotImplementedError

    def _status_error(self, response: httpx.Response, body: bytes, acc: A) -> ModelCallError:
        """Classify a non-2xx response."""
        raise NotImplementedError

    def _redirected(self, response: httpx.Response, acc: A) -> ModelCallError:
        """A redirect, never followed: the request, with its API key, would go elsewhere.

        docs/models.md, "Errors and retryability": ``invalid_response``, not retryable.
        """
        where = response.headers.get("location")
        to = f" to {where}" if where else ""
        message = self._redact(
            f"HTTP {response.status_code}: the endpoint redirects{to}; a model call never "
            "follows a redirect (its body and API key would go to another address): set "
            "base_url to the address the model is served at"
        )
        return acc.failure("invalid_response", message, status=response.status_code)

    async def _send(self, http_request: httpx.Request, acc: A, deadline: float) -> httpx.Response:
        """The response head of ``http_request``, its body still to be read.

        A redirect is never followed, whatever the client's ``follow_redirects`` says: the
        request's body and credentials would go to another address (a given ``http_client``
        that follows redirects drops only ``Authorization`` on the way, not ``x-api-key`` or
        an ``extra_headers`` key); `_read_response` refuses the 3xx (docs/models.md,
        "Connections and headers").

        Raises:
            treadle.ModelCallError: ``timeout`` (retryable) when no head came by ``deadline``
                (trio's clock) or the connect timed out; ``bad_request`` (not retryable) when
                the request breaks HTTP; ``connection`` (retryable) on another transport error.
        """
        with trio.move_on_at(deadline):
            try:
                return await self._client.send(http_request, stream=True, follow_redirects=False)
            except httpx.TimeoutException as exc:
                raise acc.failure("timeout", f"connect: {exc!r}", retryable=True) from exc
            except (httpx.LocalProtocolError, httpx.UnsupportedProtocol) as exc:
                # The request itself breaks HTTP (a header value h11 refuses): sending it
                # again cannot succeed (docs/models.md, "Errors and retryability").
                raise acc.failure("bad_request", self._unsendable(exc)) from exc
            except httpx.HTTPError as exc:
                raise acc.failure("connection", repr(exc), retryable=True) from exc
        raise acc.failure("timeout", "no response headers in time", retryable=True)

    async def _read_response(
        self,
        response: httpx.Response,
        chunks: AsyncIterator[bytes],
        acc: A,
        deadline: float,
        idle_s: float,
        attempt: Attempt,
    ) -> ModelReply:
        if 300 <= response.status_code < 400:
            raise self._redirected(response, acc)
        if not 200 <= response.status_code < 300:
            try:
                body = await self._read_body(chunks, acc, MAX_ERROR_BODY_BYTES, idle_s)
            except ModelCallError:
                body = b""  # the status alone classifies the failure
            raise self._status_error(response, body, acc)
        content_type = response.headers.get("content-type", "").lower()
        if "event-stream" in content_type:
            return await self._read_stream(chunks, acc, deadline, idle_s, attempt)
        # The request asked for a stream, so a body that is one, whatever its label (a
        # newline-delimited JSON one included), is read as one, as the official SDKs read it
        # (docs/models.md, "Replies, finish reasons, reasoning").
        head, chunks = await self._peek(chunks, acc, deadline)
        if SSE_START.match(head):
            return await self._read_stream(chunks, acc, deadline, idle_s, attempt)
        if any(label in content_type for label in NDJSON_TYPES):
            return await self._read_lines(chunks, acc, deadline, idle_s, attempt)
        if "json" in content_type or head.removeprefix(_BOM).lstrip().startswith(b"{"):
            body = await self._read_json_body(chunks, acc, idle_s)
            reply = self._add_body(acc, body)
            attempt.report_usage(reply.usage)
            return reply
        raise acc.failure(
            "invalid_response",
            f"unexpected content-type {content_type!r}: the body is neither a JSON object nor "
            "server-sent events",
        )

    async def _read_lines(
        self,
        chunks: AsyncIterator[bytes],
        acc: A,
        deadline: float,
        idle_s: float,
        attempt: Attempt,
    ) -> ModelReply:
        """Read newline-delimited JSON as the stream of its lines' events (`as_sse`).

        Raises:
            treadle.ModelCallError: as `_read_stream`; ``invalid_response``, not retryable,
                when a line grows past `MAX_EVENT_BYTES` before it ends (docs/models.md,
                "Replies, finish reasons, reasoning").
        """
        try:
            async with contextlib.aclosing(as_sse(chunks)) as events:
                return await self._read_stream(events, acc, deadline, idle_s, attempt)
        except SSEDecodeError as exc:
            raise acc.failure("invalid_response", str(exc)) from exc

    async def _peek(
        self, chunks: AsyncIterator[bytes], acc: A, deadline: float
    ) -> tuple[bytes, AsyncIterator[bytes]]:
        """The body's first bytes, and the whole body again.

        The first bytes run to the end of the first line that is not blank (`_line_ended`),
        or are at least `PEEK_BYTES`, or are the whole body: what `SSE_START` and the JSON
        check look at is then the same however the server's writes were split into reads
        (a keep-alive blank line read on its own says nothing of what follows it).
        """
        seen: list[bytes] = []
        size = 0
        while size < PEEK_BYTES and not _line_ended(b"".join(seen)):
            chunk = await self._next_chunk(chunks, acc, deadline, 0.0)
            if chunk is None:
                break
            seen.append(chunk)
            size += len(chunk)
        return b"".join(seen), _Replayed(seen, chunks)

    async def _read_stream(
        self,
        chunks: AsyncIterator[bytes],
        acc: A,
        deadline: float,
        idle_s: float,
        attempt: Attempt,
    ) -> ModelReply:
        decoder = SSEDecoder()
        reported = acc.usage
        report_usage = attempt.report_usage
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
                    return self._end_of_stream(acc, truncated=decoder.close())
                for event in decode_chunk(decoder, chunk, acc):
                    acc.add(event.data, event=event.event)
                    if acc.usage is not reported:  # the server reported (running) usage
                        reported = acc.usage
                        report_usage(reported)
        if not scope.cancelled_caught:
            await drain(chunks)
            return acc.reply()
        if acc.events and self._finished(acc):  # the whole reply came; only the end did not
            return self._end_of_stream(acc, truncated=decoder.close())
        what = "next read (stream idle)" if acc.events else self.first_event
        raise acc.failure("timeout", f"no {what} in time", retryable=True)

    def _finished(self, acc: A) -> bool:
        """Whether ``acc`` holds a whole reply, although its stream has not ended.

        A stream that then stays open past the idle deadline is taken as ended, rather than
        its whole reply thrown away and asked for (and paid for) again (docs/models.md,
        "Replies, finish reasons, reasoning"). No by default.
        """
        return False

    async def _next_chunk(
        self,
        chunks: AsyncIterator[bytes],
        acc: A,
        deadline: float | None,
        idle_s: float,
    ) -> bytes | None:
        what = self.first_event if deadline is not None else "next read (stream idle)"
        deadline = deadline if deadline is not None else trio.current_time() + idle_s
        with trio.move_on_at(deadline):
            try:
                return await anext(chunks, None)
            except httpx.HTTPError as exc:
                message = f"stream broken after {acc.events} events: {exc!r}"
                raise acc.failure("incomplete_stream", message, retryable=True) from exc
        raise acc.failure("timeout", f"no {what} in time", retryable=True)

    async def _read_json_body(self, chunks: AsyncIterator[bytes], acc: A, idle_s: float) -> bytes:
        """A non-streamed JSON body, whole; the reading stops once the body is past the bound.

        Raises:
            treadle.ModelCallError: ``invalid_response``, not retryable, when the body is
                longer than `MAX_JSON_BODY_BYTES` (docs/models.md, "Replies, finish reasons,
                reasoning"); as `_read_body` when reading it fails.
        """
        body = await self._read_body(chunks, acc, MAX_JSON_BODY_BYTES + 1, idle_s)
        if len(body) > MAX_JSON_BODY_BYTES:
            raise acc.failure(
                "invalid_response",
                f"a JSON body longer than {MAX_JSON_BODY_BYTES} bytes, the bound of a reply",
            )
        return body

    async def _read_body(
        self, chunks: AsyncIterator[bytes], acc: A, limit: int, idle_s: float
    ) -> bytes:
        """The body's first ``limit`` bytes (all of it when shorter); the rest is not read.

        Raises:
            treadle.ModelCallError: ``timeout`` (retryable) when no read comes within
                ``idle_s`` seconds, ``incomplete_stream`` (retryable) when the body breaks
                off (`_next_chunk`).
        """
        parts: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = await self._next_chunk(chunks, acc, None, idle_s)
            if chunk is None:
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)[:limit]


def join_url(base_url: str, path: str) -> str:
    """``path`` appended to the path of ``base_url``, its query string kept after it.

    ``join_url("https://host/v1?api-version=2024", "/chat/completions")`` is
    ``https://host/v1/chat/completions?api-version=2024``; a trailing ``/`` of the base path
    is not doubled, and a fragment is dropped (it is never sent).

    Raises:
        UsageError: ``base_url`` cannot be parsed (an unclosed ``[`` of an IPv6 address); the
            message quotes it with its credentials hidden.
    """
    try:
        parts = urllib.parse.urlsplit(base_url)
    except ValueError as exc:
        raise UsageError(f"base_url {shown_url(base_url)!r} is not a valid URL: {exc}") from exc
    joined = parts.path.rstrip("/") + "/" + path.lstrip("/")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, joined, parts.query, ""))


KEY_START_CHARS = 8
"""The shortest start of an API key that is redacted on its own (a message cut inside it)."""


def _without_key_starts(text: str, key: str) -> str:
    """``text`` with each run of the key's first characters replaced by ``***``.

    A run is at least `KEY_START_CHARS` characters long (the whole key when it is shorter),
    or 3 at the very end of ``text``, where a message cut short inside the key ends.
    """
    least = min(len(key), KEY_START_CHARS)
    head = key[:least]
    parts: list[str] = []
    start = 0
    while (found := text.find(head, start)) >= 0:
        end = found + least
        while end < len(text) and end - found < len(key) and text[end] == key[end - found]:
            end += 1
        parts += (text[start:found], "***")
        start = end
    text = "".join(parts) + text[start:] if parts else text
    for size in range(min(len(key), KEY_START_CHARS) - 1, 2, -1):
        if text.endswith(key[:size]):
            return text[:-size] + "***"
    return text


def check_api_key(api_key: str | None) -> str | None:
    """``api_key`` as given, refused unless an HTTP header can carry it as it is.

    A key read from a file with its line break would be sent in a header no server
    accepts, and the error quoting that header would carry the key; a key with a character
    outside ASCII cannot be put into a header at all (docs/models.md, "Connections and
    headers").

    Raises:
        UsageError: the key is empty (``None`` sends no key), or it holds a space, a line
            break or another control character, or a character outside printable ASCII
            (strip it: ``open(path).read().strip()``). The message does not quote the key.
    """
    if api_key == "":
        raise UsageError("the API key is empty: give api_key=None to send no key")
    if api_key is not None and not _TOKEN_VALUE.fullmatch(api_key):
        raise UsageError(
            "the API key holds whitespace or a control character (a line break read from a "
            "file?) or a character outside ASCII, which an HTTP header cannot carry: strip it"
        )
    return api_key


_HEADER_NAME = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
"""A header name: an RFC 9110 token (section 5.1)."""
_HEADER_VALUE = re.compile(r"(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?")
"""A header value a request can carry: printable ASCII, spaces and tabs only between visible
characters (RFC 9110, section 5.5; httpx encodes a value as ASCII, h11 refuses the rest)."""
_TOKEN_VALUE = re.compile(r"[\x21-\x7e]+")
"""An API key: visible ASCII characters, no space."""


def check_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` as a dict, refused unless every one can go into an HTTP request.

    Checked when a client is made, so a header that no request could carry fails there
    rather than on every attempt of a run (docs/models.md, "Connections and headers").

    Raises:
        UsageError: a name is not an HTTP token, or a value holds a line break or another
            control character, a character outside ASCII, or whitespace at either end. The
            message names the header, never its value (it may be a credential).
    """
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise UsageError(f"the header name {name!r} is not an HTTP header name (a token)")
        if not isinstance(value, str) or not _HEADER_VALUE.fullmatch(value):
            raise UsageError(
                f"the value of header {name!r} is not one an HTTP header can carry: only "
                "printable ASCII, without a line break, a control character or whitespace at "
                "either end"
            )
    return dict(headers)


def check_userinfo(base_url: str, headers: Mapping[str, str]) -> None:
    """Refuse user information in ``base_url`` beside an ``Authorization`` header.

    httpx sends a URL's ``user:password@`` as ``Authorization: Basic``, in place of the
    ``Authorization`` header the request had (an OpenAI ``api_key``'s ``Bearer``, or one of
    ``headers``), so that key would silently not be sent (docs/models.md, "What goes on the
    wire").

    Args:
        base_url: the client's base URL (already checked by
            `treadle._credentials.check_base_url`).
        headers: every header the client sends, names in any case.

    Raises:
        UsageError: both are given. The message quotes neither the password nor the key.
    """
    parts = urllib.parse.urlsplit(base_url)
    if not (parts.username or parts.password):
        return
    if any(name.lower() == "authorization" for name in headers):
        raise UsageError(
            "base_url holds user information (user:password@), which is sent as an "
            "Authorization: Basic header in place of the request's own Authorization header "
            "(the API key's, or one of extra_headers or the http_client's): give only one"
        )


def own_http_client() -> httpx.AsyncClient:
    """The HTTP client a model client makes when none is given (it closes it in ``aclose``).

    Without httpx's default limit of 100 connections: a client may be shared by any number
    of concurrent runs, and the 101st call would otherwise wait for a connection and fail
    (docs/models.md, "Connections and headers"). Up to 20 idle connections are kept alive,
    as httpx's default keeps them.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=20)
    return httpx.AsyncClient(limits=limits)


class _RedactUrlSecrets(logging.Filter):
    """Rewrites a log record so that no credential of a URL's query string is in it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_url_secrets(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


HTTP_LOGGERS = (
    "httpx",
    "httpcore",
    "httpcore.connection",
    "httpcore.http11",
    "httpcore.http2",
    "httpcore.proxy",
)
"""The loggers of httpx and httpcore, which log request URLs (httpx at INFO)."""

_FILTER = _RedactUrlSecrets()


def install_log_redaction() -> None:
    """Put the URL-credential filter on the httpx and httpcore loggers (once; idempotent).

    A filter on a logger applies to what is logged on that very logger, so each of
    `HTTP_LOGGERS` gets it. Called by every model client when it is made.
    """
    for name in HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def encode_body(body: dict[str, Any]) -> bytes:
    """A request body as UTF-8 JSON bytes.

    Text that is not valid Unicode (a lone surrogate, in a log written before treadle made
    such text valid where it enters the log, or in a system prompt) is sent with U+FFFD in
    its place rather than making the request, and so the run, impossible to send
    (docs/crash-safety.md, "Text that is not Unicode").

    Raises:
        UsageError: ``body`` is not JSON data (a value JSON has no form for, NaN or
            infinity included).
    """
    try:
        text = json.dumps(body, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"the request cannot be encoded as JSON: {exc}") from exc
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return valid_text(text)[0].encode("utf-8")


def digest(data: bytes) -> str:
    """``sha256:<hex>`` of ``data`` (how image references carry their bytes' digest)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def load_image(
    image: ImageRef, own: ImageSource | None, run: ImageSource | None
) -> tuple[str, bytes]:
    """The media type and bytes of a ``ref:`` image, checked against its digest.

    The client's own source (``own``) is asked first; the run's (``run``: the attempt's
    `treadle.types.Attempt.image_source`, the executor's images) when ``own`` is missing or
    raises `LookupError` (docs/models.md, "Images").

    Raises:
        UsageError: there is no source at all, no source holds the image (or one raised
            `OSError`), its bytes do not match ``image.digest``, or its media type is
            unknown. Raised before anything is sent.
    """
    sources = [s for s in (own, run) if s is not None]
    if not sources:
        raise UsageError(f"image {image.url!r} needs an image_source, and none was given")
    failure: Exception | None = None
    for source in sources:
        try:
            data = source(image)
        except LookupError as exc:
            failure = exc
            continue
        except OSError as exc:
            raise UsageError(f"image {image.url!r} could not be loaded: {exc!r}") from exc
        break
    else:
        raise UsageError(f"image {image.url!r} could not be loaded: {failure!r}") from failure
    if image.digest is not None and image.digest != digest(data):
        raise UsageError(f"image {image.url!r}: bytes do not match digest {image.digest}")
    media_type = image.media_type or sniff(data)
    if media_type is None:
        raise UsageError(f"image {image.url!r}: unknown media type; set ImageRef.media_type")
    return media_type, data


def sniff(data: bytes) -> str | None:
    """The image media type from the first bytes, or ``None``."""
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


async def dispose(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
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


PEEK_BYTES = 256
"""Bytes of a body with an unexpected content type looked at to tell what it holds."""
NDJSON_TYPES = ("ndjson", "jsonl", "json-seq", "jsonlines")
"""Content-type labels of newline-delimited JSON: one chunk object a line."""
_BOM = b"\xef\xbb\xbf"
"""The UTF-8 byte order mark a body may start with."""
SSE_START = re.compile(rb"\A(?:\xef\xbb\xbf)?\s*(?::|(?:data|event|id|retry|error)\s*:)")
"""How a body of server-sent events starts (a comment, or one of the fields)."""


def _line_ended(head: bytes) -> bool:
    """Whether ``head`` holds a whole line that is not blank, after a byte order mark.

    A line ends at a CR or an LF, as in an event stream.
    """
    rest = head.removeprefix(_BOM).lstrip()
    return b"\n" in rest or b"\r" in rest


class _Replayed:
    """A body's reads again: those already taken (``first``), then the rest of ``rest``.

    An iterator object rather than an async generator, so one that a failed attempt leaves
    unfinished holds no suspended frame for the garbage collector to finalize.
    """

    def __init__(self, first: list[bytes], rest: AsyncIterator[bytes]) -> None:
        self._first = collections.deque(first)
        self._rest = rest

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        if self._first:
            return self._first.popleft()
        return await anext(self._rest)


async def as_sse(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """Newline-delimited JSON as server-sent events: each non-empty line one ``data`` event.

    A last line the body ends without a newline is an event when it is whole JSON; otherwise
    the body broke off inside it, and it is passed on as an event never ended (a ``data``
    field without the empty line that dispatches it), which the SSE decoder discards and
    reports at the end, as for a cut event stream: a retryable ``incomplete_stream``
    (docs/models.md, "Errors and retryability"), not an ``invalid_response``.

    A line is kept as the pieces it was read in, each byte joined once when it ends. A byte
    order mark the body starts with is no part of its first line, as in an event stream.

    Raises:
        SSEDecodeError: the line not ended yet grew past `MAX_EVENT_BYTES`, the bound of an
            event stream's line, as soon as it did: a server that never ends a line cannot
            fill the memory (docs/models.md, "Replies, finish reasons, reasoning"). Its
            ``offset`` is where that line starts in the body.
    """
    line: list[bytes] = []  # the pieces of the line not ended yet, as read
    size = start = 0  # that line's length, and where it starts in the body
    async for chunk in chunks:
        *ended, rest = chunk.split(b"\n")
        if ended:
            ended[0] = _without_bom(b"".join((*line, ended[0])), start)
            start += size + len(chunk) - len(rest)
            line, size = [], 0
            out = b"".join(b"data: " + one.strip() + b"\n\n" for one in ended if one.strip())
            if out:
                yield out
        if rest:
            line.append(rest)
            size += len(rest)
            if size > MAX_EVENT_BYTES:
                message = f"a line longer than {MAX_EVENT_BYTES} bytes, not ended"
                raise SSEDecodeError(message, offset=start)
    last = _without_bom(b"".join(line), start).strip()
    if last:
        yield b"data: " + last + (b"\n\n" if _whole_line(last) else b"\n")


def _without_bom(line: bytes, start: int) -> bytes:
    """A line of a body that starts at byte ``start``, without the body's byte order mark."""
    return line.removeprefix(_BOM) if start == 0 else line


def _whole_line(line: bytes) -> bool:
    """Whether an NDJSON line that no newline ended is whole: JSON, or the ``[DONE]`` marker."""
    if line == b"[DONE]":
        return True
    try:
        loads_event(line.decode("utf-8", "replace"))
    except ValueError:
        return False
    return True


def decode_chunk(decoder: SSEDecoder, chunk: bytes, acc: Accumulator) -> list[SSEEvent]:
    """Feed one read to the SSE decoder; a malformed stream is an ``invalid_response``."""
    try:
        return decoder.feed(chunk)
    except SSEDecodeError as exc:
        raise acc.failure("invalid_response", str(exc)) from exc
