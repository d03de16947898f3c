"""A model server on 127.0.0.1 that replays recorded conversations (OpenAI-compatible).

``POST /r/<key>/v1/chat/completions`` answers for the recording ``<key>`` (``<task>-<trial>``,
see `recording_key`). The answer to a request is chosen by the request's position in the
conversation: a request whose history holds ``k`` assistant messages gets the recording's
assistant message ``k`` (0-based), so a request repeated after a crash gets the same reply.

Replies stream as ``chat.completion.chunk`` server-sent events in realistic fragments: the
text in several deltas, a tool call's id and name in its first delta and its arguments split
across several more, then the finish reason (``stop`` or ``tool_calls``), a usage chunk when
``stream_options.include_usage`` asks for one, and ``[DONE]``. Each event is one write.

Every request's messages are compared with the recording's messages before that assistant
message (role, content, tool-call ids, names and decoded arguments, ``tool_call_id``); each
difference is kept as a `HistoryMismatch`. The history a client builds must be exactly what
the recorded model saw.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import attrs

from treadle.demo.airline.data import Recording
from treadle.demo.airline.data import recording_key as recording_key
from treadle.testing.loopback import (
    LoopbackServer,
    RecordedRequest,
    ResponseWriter,
    open_loopback_server,
)

ROUTE: Final = re.compile(r"^/r/(?P<key>[^/]+)/v1/chat/completions/?(?:\?.*)?$")
"""The request path: the recording key, then the OpenAI path."""

MAX_DIFFERENCES: Final = 5
"""Differences described per mismatching request (the count is always complete)."""

_CLIP: Final = 80
_TOKEN: Final = re.compile(r"\s*\S+|\s+")


@attrs.frozen(kw_only=True)
class HistoryMismatch:
    """A request whose messages differ from the recording's.

    Attributes:
        key: the recording key.
        position: the request's position (assistant messages in its history).
        differences: what differs, one short text each (at most `MAX_DIFFERENCES`).
        count: how many differences there were in all.
    """

    key: str
    position: int
    differences: tuple[str, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        """A JSON object with the same fields."""
        return {
            "key": self.key,
            "position": self.position,
            "differences": list(self.differences),
            "count": self.count,
        }


# --------------------------------------------------------------------------- comparing


def _arguments(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # compared as text


def _content(value: Any) -> Any:
    """Message content as text; a list of text parts is joined (other parts kept as is)."""
    if isinstance(value, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" for p in value
    ):
        return "".join(str(p.get("text", "")) for p in value)
    return value


def comparable(message: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a chat message that must match: role, content, calls, answered call.

    Tool calls keep their id, function name and decoded arguments (so ``{"a": 1}`` and
    ``{"a":1}`` are equal); an absent list and an empty one are equal.
    """
    calls = [
        {
            "id": call.get("id"),
            "name": (call.get("function") or {}).get("name"),
            "arguments": _arguments((call.get("function") or {}).get("arguments")),
        }
        for call in message.get("tool_calls") or ()
    ]
    return {
        "role": message.get("role"),
        "content": _content(message.get("content")),
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
    }


def _clip(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= _CLIP else text[: _CLIP - 1] + "…"


def history_differences(
    expected: Sequence[Mapping[str, Any]], actual: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Describe every difference between two chat histories (empty when they are equal).

    Args:
        expected: the recording's messages, oldest first.
        actual: the request's messages, oldest first.

    Returns:
        One text per differing field or missing/extra message, in message order.
    """
    found: list[str] = []
    if len(expected) != len(actual):
        found.append(f"expected {len(expected)} messages, got {len(actual)}")
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        a, b = comparable(want), comparable(got)
        for field in ("role", "content", "tool_calls", "tool_call_id"):
            if a[field] != b[field]:
                found.append(
                    f"message {index} ({a['role']}) {field}: expected {_clip(a[field])}, "
                    f"got {_clip(b[field])}"
                )
    return found


# --------------------------------------------------------------------------- streaming


def _pieces(text: str, rng: random.Random, *, words: bool) -> list[str]:
    """Split ``text`` into fragments: 1-5 whole words each, or 1-16 characters each."""
    if words:
        tokens = _TOKEN.findall(text)
        pieces, i = [], 0
        while i < len(tokens):
            n = rng.randint(1, 5)
            pieces.append("".join(tokens[i : i + n]))
            i += n
        return pieces
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 16)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def _event(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def estimate_tokens(text: str) -> int:
    """A rough token count for usage reports: one token per four characters, at least 1."""
    return max(1, len(text) // 4)


def stream_events(
    message: Mapping[str, Any],
    *,
    response_id: str,
    model: str,
    rng: random.Random,
    usage: Mapping[str, int] | None,
) -> list[bytes]:
    """The server-sent events that stream one recorded assistant message.

    Args:
        message: the recorded assistant message (``content``, ``tool_calls``).
        response_id: the ``id`` of every chunk.
        model: the ``model`` of every chunk.
        rng: chooses the fragment sizes (seed it for a reproducible split).
        usage: the usage chunk's counts (``prompt_tokens``, ``completion_tokens``,
            ``total_tokens``); ``None`` sends no usage chunk.

    Returns:
        The encoded events, ``data: [DONE]`` last.
    """
    head = {"id": response_id, "object": "chat.completion.chunk", "created": 0, "model": model}

    def chunk(delta: Mapping[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": dict(delta), "finish_reason": finish}
        return _event({**head, "choices": [choice]})

    text = message.get("content")
    calls = message.get("tool_calls") or []
    events = [chunk({"role": "assistant", "content": "" if text else None})]
    for piece in _pieces(text or "", rng, words=True):
        events.append(chunk({"content": piece}))
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        first = {
            "index": index,
            "id": call.get("id"),
            "type": "function",
            "function": {"name": function.get("name"), "arguments": ""},
        }
        events.append(chunk({"tool_calls": [first]}))
        for piece in _pieces(str(function.get("arguments") or ""), rng, words=False):
            more = {"index": index, "function": {"arguments": piece}}
            events.append(chunk({"tool_calls": [more]}))
    events.append(chunk({}, "tool_calls" if calls else "stop"))
    if usage is not None:
        events.append(_event({**head, "choices": [], "usage": dict(usage)}))
    events.append(_event("[DONE]"))
    return events


def completion_body(
    message: Mapping[str, Any], *, response_id: str, model: str, usage: Mapping[str, int]
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` body for one recorded assistant message."""
    calls = message.get("tool_calls") or []
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if calls:
        reply["tool_calls"] = [dict(call) for call in calls]
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": reply, "finish_reason": "tool_calls" if calls else "stop"}
        ],
        "usage": dict(usage),
    }


# --------------------------------------------------------------------------- the server


@attrs.frozen(kw_only=True)
class _Replay:
    """One recording prepared for serving: its assistant messages and their positions."""

    recording: Recording
    assistant_at: tuple[int, ...]

    @classmethod
    def of(cls, recording: Recording) -> _Replay:
        positions = tuple(
            i for i, m in enumerate(recording.messages) if m.get("role") == "assistant"
        )
        return cls(recording=recording, assistant_at=positions)

    def prefix(self, position: int) -> Sequence[Mapping[str, Any]]:
        """The messages the model saw before its reply number ``position``."""
        return self.recording.messages[: self.assistant_at[position]]

    def reply(self, position: int) -> Mapping[str, Any]:
        return self.recording.messages[self.assistant_at[position]]


class BadRequest(Exception):
    """A request the replay server cannot answer (answered with an HTTP error).

    Attributes:
        status: the HTTP status.
        message: the error message sent.
        key: the recording key, ``?`` when the path names none.
    """

    def __init__(self, status: int, message: str, *, key: str = "?") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.key = key


MismatchCallback = Callable[[HistoryMismatch], None]
"""Called synchronously, in the server's trio thread, for every mismatching request."""


@attrs.define(eq=False)
class ReplayServer:
    """A running replay model server (see `open_replay_server`).

    Attributes:
        port: the TCP port on 127.0.0.1.
        pause_s: seconds between two streamed events (0: as fast as the client reads).
        mismatches: every mismatching request, in arrival order.
        served: recording key -> requests answered (mismatching ones included).
        refused: recording key -> requests refused (unknown key, past the recording's end,
            unreadable body).
    """

    port: int = 0
    pause_s: float = 0.0
    mismatches: list[HistoryMismatch] = attrs.Factory(list)
    served: dict[str, int] = attrs.Factory(dict)
    refused: dict[str, int] = attrs.Factory(dict)
    _replays: dict[str, _Replay] = attrs.field(init=False, factory=dict)
    _on_mismatch: MismatchCallback | None = None
    _loopback: LoopbackServer | None = attrs.field(init=False, default=None)

    def add(self, recording: Recording) -> str:
        """Serve ``recording`` too (it may be added while the server runs); return its key."""
        key = recording_key(recording)
        self._replays[key] = _Replay.of(recording)
        return key

    def base_url(self, key: str) -> str:
        """The API root for recording ``key``, e.g. ``http://127.0.0.1:PORT/r/30-1/v1``."""
        return f"http://127.0.0.1:{self.port}/r/{key}/v1"

    @property
    def abandoned_responses(self) -> int:
        """Responses whose client went away before they were complete."""
        return self._loopback.early_disconnects if self._loopback is not None else 0

    def mismatches_of(self, key: str) -> list[HistoryMismatch]:
        """The mismatching requests of one recording, in arrival order."""
        return [m for m in self.mismatches if m.key == key]

    async def handle(self, request: RecordedRequest, writer: ResponseWriter) -> None:
        """Answer one HTTP request (the loopback server's stream handler)."""
        if self._loopback is not None:
            self._loopback.requests.clear()  # bodies are large; the server keeps none
        try:
            key, replay, body, position = self._route(request)
        except BadRequest as exc:
            self.refused[exc.key] = self.refused.get(exc.key, 0) + 1
            await _error(writer, exc)
            return
        differences = history_differences(replay.prefix(position), body["messages"])
        if differences:
            self._mismatch(key, position, differences)
        self.served[key] = self.served.get(key, 0) + 1
        await self._answer(writer, key, position, replay, body, len(request.body))

    def _route(self, request: RecordedRequest) -> tuple[str, _Replay, dict[str, Any], int]:
        """The recording, decoded body and position of a request.

        Raises:
            BadRequest: no such route or recording, an unreadable body, or a position past
                the recording's end (also recorded as a mismatch).
        """
        match = ROUTE.match(request.path)
        if request.method != "POST" or match is None:
            raise BadRequest(404, f"no route for {request.method} {request.path}")
        key = match["key"]
        replay = self._replays.get(key)
        if replay is None:
            raise BadRequest(404, f"no recording {key!r}", key=key)
        try:
            body = request.json()
        except ValueError as exc:
            raise BadRequest(400, f"the body is not JSON: {exc}", key=key) from exc
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(400, "the body has no list of message objects", key=key)
        position = sum(1 for m in messages if m.get("role") == "assistant")
        if position >= len(replay.assistant_at):
            self._mismatch(key, position, [f"request {position} is past the recording's end"])
            count = len(replay.assistant_at)
            raise BadRequest(400, f"the recording has {count} assistant messages", key=key)
        return key, replay, body, position

    def _mismatch(self, key: str, position: int, differences: list[str]) -> None:
        mismatch = HistoryMismatch(
            key=key,
            position=position,
            differences=tuple(differences[:MAX_DIFFERENCES]),
            count=len(differences),
        )
        self.mismatches.append(mismatch)
        if self._on_mismatch is not None:
            self._on_mismatch(mismatch)

    async def _answer(
        self,
        writer: ResponseWriter,
        key: str,
        position: int,
        replay: _Replay,
        body: Mapping[str, Any],
        request_bytes: int,
    ) -> None:
        message = replay.reply(position)
        model = str(body.get("model") or "replay")
        response_id = f"chatcmpl-replay-{key}-{position}"
        produced = str(message.get("content") or "") + "".join(
            str((c.get("function") or {}).get("arguments") or "")
            for c in message.get("tool_calls") or ()
        )
        prompt, completion = estimate_tokens("x" * request_bytes), estimate_tokens(produced)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if body.get("stream") is not True:
            data = json.dumps(
                completion_body(message, response_id=response_id, model=model, usage=usage)
            ).encode()
            await writer.start(200, {"content-type": "application/json"})
            await writer.write(data)
            await writer.end()
            return
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        rng = random.Random(f"{key}/{position}")
        events = stream_events(
            message,
            response_id=response_id,
            model=model,
            rng=rng,
            usage=usage if wants_usage else None,
        )
        await writer.start(200, {"content-type": "text/event-stream", "cache-control": "no-cache"})
        for index, event in enumerate(events):
            if index and self.pause_s:
                await writer.pause(self.pause_s)
            await writer.write(event)
        await writer.end()


async def _error(writer: ResponseWriter, exc: BadRequest) -> None:
    payload = {"error": {"message": exc.message, "type": "invalid_request_error", "code": None}}
    await writer.start(exc.status, {"content-type": "application/json"})
    await writer.write(json.dumps(payload).encode())
    await writer.end()


@asynccontextmanager
async def open_replay_server(
    recordings: Sequence[Recording] = (),
    *,
    on_mismatch: MismatchCallback | None = None,
    pause_s: float = 0.0,
) -> AsyncIterator[ReplayServer]:
    """Serve recorded conversations on 127.0.0.1 (a free port) for the block's duration.

    Args:
        recordings: the recordings to serve (more can be added with `ReplayServer.add`).
        on_mismatch: called for every request whose history differs from the recording.
        pause_s: seconds between two streamed events (to watch replies stream).

    Yields:
        The server; `ReplayServer.base_url` gives each recording's API root.

    Raises:
        RuntimeError: on exit, when answering a request failed unexpectedly (a bug).

    Resource handling:
        A client that disconnects mid-response (a process killed with SIGKILL) only ends
        that response. Leaving the block closes every connection.
    """
    server = ReplayServer(on_mismatch=on_mismatch, pause_s=pause_s)
    for recording in recordings:
        server.add(recording)
    async with open_loopback_server(stream_handler=server.handle) as loopback:
        server.port = loopback.port
        server._loopback = loopback
        yield server
